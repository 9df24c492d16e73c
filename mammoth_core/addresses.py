"""Stage addresses as the settings write them: ``host:port``, ``[v6]:port`` or ``dns:///name:port``.

One parser for every component that is configured with stage addresses: the gateway's backend
targets and the AR's DiT allow-list.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One configured target: a static address or a DNS name to resolve."""

    host: str
    port: int
    dns: bool

    @classmethod
    def parse(cls, text: str) -> "Target":
        """Parse ``host:port``, ``[v6]:port`` or ``dns:///name:port``.

        Raises:
            ValueError: the text has no valid port.
        """
        raw = text.strip()
        dns = False
        if raw.startswith("dns:"):
            dns = True
            rest = raw[len("dns:"):]
            if rest.startswith("//"):
                rest = rest[2:]
                rest = rest.split("/", 1)[1] if "/" in rest else rest
            raw = rest
        if raw.startswith("["):
            host, _, port = raw[1:].partition("]:")
        else:
            host, _, port = raw.rpartition(":")
        if not host or not port.isdigit() or not (0 < int(port) < 65536):
            raise ValueError(f"backend target {text!r}: expected host:port or dns:///name:port")
        return cls(host=host, port=int(port), dns=dns)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


def format_address(host: str, port: int) -> str:
    """``host:port`` with IPv6 hosts bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(target: Target) -> set[str] | None:
    """Every ``ip:port`` ``target`` names: its own address when it is static, else the A/AAAA
    records of its host (a headless Service: one per pod). None when the name does not resolve."""
    if not target.dns:
        return {target.address}
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        logger.warning("cannot resolve %s: %s", target.host, exc)
        return None
    return {format_address(info[4][0], target.port) for info in infos}
