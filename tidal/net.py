"""This machine's address, a free TCP port, and a TCP store served from here, for process groups
and servers that other processes (Ray actors, engine servers) must reach."""

from __future__ import annotations

import socket
from typing import Any


def free_port() -> int:
    """A TCP port nobody listens on right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This node's IP as Ray sees it when Ray runs here, else the address of the default route
    (127.0.0.1 when there is none)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def host_store(host: str, timeout_s: float) -> Any:
    """A torch.distributed TCP store served from this process on a port the kernel picks as it binds
    (`.port`), for ranks in other processes to meet at `host`:`.port` as clients.

    A port chosen free here and bound later by a rank in another process is free only until then:
    under load, another process's server or outgoing connection can take it meanwhile, and the
    rank fails to start ("address already in use"). Binding before anyone is told the port leaves
    no such moment. Keep the store while its ranks use it: dropping it stops the server."""
    import datetime

    import torch.distributed as dist

    limit = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, None, True, timeout=limit, wait_for_workers=False)


def join_store(url: str, timeout_s: float) -> Any:
    """A client of the TCP store at `url` (tcp://host:port, served by `host_store`), waiting up to
    `timeout_s` seconds for it to answer and then for each key asked of it."""
    import datetime
    from urllib.parse import urlparse

    import torch.distributed as dist

    where = urlparse(url)
    return dist.TCPStore(where.hostname, where.port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
