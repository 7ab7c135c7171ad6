# torchrun, with one fix for Debian 13's python3-torch 2.6: it is built
# without libuv, yet TCPStore's Python default asks for libuv, so torchrun's
# own agent fails before starting any rank ("use_libuv was requested but
# PyTorch was build without libuv support"). Here TCPStore defaults to the
# classic backend; everything else is torchrun's own code and defaults.
import sys

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous


class _TCPStore(dist.TCPStore):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("use_libuv", False)
        super().__init__(*args, **kwargs)


for module in (dist, static_tcp_rendezvous, c10d_rendezvous_backend):
    module.TCPStore = _TCPStore

from torch.distributed.run import main  # noqa: E402

sys.exit(main())
