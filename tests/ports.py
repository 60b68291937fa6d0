"""The one way tests pick a port for what they start (a server process, a gloo group, etcd, MLflow).

It is `kubedistill run`'s own choice (runtime/entrypoints/local.free_port): a port between Ray's
worker ports and the kernel's ephemeral range. A port from bind-to-0 lies in the ephemeral range,
where a vLLM engine's own sockets, a torch.distributed store or any outgoing connection may take
it between the pick and the server's bind ("[Errno 98] address already in use"). What can still
take it (another test run drawing the same port at that moment) is left to the starters, which
start again on new ports (server_fixtures.retry_on_port_taken).
"""

from __future__ import annotations

import socket

_taken: set[int] = set()
"""Every port handed out in this process: none twice."""


def free_port(host: str = "127.0.0.1") -> int:
    from kubedistill.runtime.entrypoints.local import free_port as pick

    for _ in range(100):
        port = pick(_taken)
        if host == "127.0.0.1" or _binds(host, port):
            return port
    raise RuntimeError(f"no free port on {host}")


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
