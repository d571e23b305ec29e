"""Refuse a port another process holds, instead of sharing it.

grpc sets SO_REUSEPORT by default, so a second server on a busy port starts and the
kernel splits connections between the two. The server turns that off ("grpc.so_reuseport"
0) and probes the port first: the probe gives the one-line ``PortInUseError`` before grpc
logs its own bind error, and before the model loads.
"""

from __future__ import annotations

import errno
import socket


class PortInUseError(OSError):
    """``port`` is bound by another socket; ``flag`` names the option that chose it."""

    def __init__(self, port: int, flag: str | None = None) -> None:
        where = f" ({flag})" if flag else ""
        super().__init__(
            f"port {port} is already in use{where}; stop the other server or pick another port"
        )
        self.errno = errno.EADDRINUSE
        self.port = port
        self.flag = flag


def ensure_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if binding ``host:port`` without SO_REUSEPORT would fail.

    Port 0 (any free port) and hosts that do not resolve here are left to the real bind.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return
    for family, kind, proto, _name, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                # As the real listener: SO_REUSEADDR (a TIME_WAIT port is free), no REUSEPORT.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:  # other errors (no IPv6 here, ...) are left to the real bind
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(port) from None
