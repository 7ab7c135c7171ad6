#!/usr/bin/env python3
# A store that resets its connections, as a rank 0 that dies mid-rendezvous
# looks to the others:
#   fake_store_reset.py COMMAND [ARGS...]
# Listens on a free port of 127.0.0.1, runs COMMAND with MASTER_ADDR and
# MASTER_PORT naming it, accepts every connection and resets it (RST) as
# soon as a request comes in; exits with COMMAND's status.
import os
import socket
import struct
import subprocess
import sys
import threading

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(16)
port = server.getsockname()[1]


def reset_on_request(conn):
    with conn:
        if conn.recv(1):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def accept():
    while True:
        conn, _ = server.accept()
        threading.Thread(target=reset_on_request, args=(conn,), daemon=True).start()


threading.Thread(target=accept, daemon=True).start()
print(f"fake_store_reset.py: a store on 127.0.0.1:{port} that resets each connection at its first request", flush=True)
env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
sys.exit(subprocess.run(sys.argv[1:], env=env).returncode)
