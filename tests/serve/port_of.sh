# port_of NAME PID: the port $d/NAME.log says dtp-serve's rank 0 listens on,
# waiting up to 60 s while process PID runs; fails naming NAME otherwise.
# Sourced by serve_test.sh and prefix_cache_bench.sh (which define $d and
# fail); called as port=$(port_of NAME PID), so a failure's message goes to
# stderr and the assignment fails the script (set -e).
port_of() {
  local port=""
  for _ in $(seq 1 600); do
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$d/$1.log" | grep -o '[0-9]*$' || true)
    [ -n "$port" ] && break
    kill -0 "$2" 2>/dev/null || fail "$1 server exited: $(cat "$d/$1.log")" >&2
    sleep 0.1
  done
  [ -n "$port" ] || fail "$1 server not listening after 60 s: $(cat "$d/$1.log")" >&2
  echo "$port"
}
