"""This machine's address and a free TCP port, for process groups and servers that other
processes (Ray actors, engine servers) must reach."""

from __future__ import annotations

import socket


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
