"""Which DiTs the AR may dial, and its bounded cache of channels to them.

``AR.Generate`` names the DiT to push to (``dit_address``). The AR dials only addresses it was
configured to reach (`ARSettings.dit_allow_list`), so a caller cannot point it at anything else on
the network (SSRF):

- ``host:port`` entries allow exactly that address, and the addresses its host resolves to;
- ``dns:///name:port`` entries allow every address the name resolves to (the DiT headless
  Service: one A record per pod), re-resolved at most every `RESOLVE_INTERVAL_SECONDS`, and at
  most once per `MIN_RESOLVE_INTERVAL_SECONDS` when an address is not (yet) known, so a new pod is
  allowed within a second while a flood of unknown addresses costs one lookup a second;
- ``*`` allows any address (explicitly insecure); an empty list allows none.

`DiTChannels` keeps one channel per DiT address: channels nobody uses are closed once more than
``max_idle`` are open (least recently used first); channels in use are never closed under a push.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable, Sequence

import grpc

from mammoth_core.addresses import Target, resolve

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_SECONDS = 30.0
MIN_RESOLVE_INTERVAL_SECONDS = 1.0
ANY = "*"


class DiTAllowList:
    """The DiT addresses this AR may dial.

    Args:
        entries: ``host:port``, ``dns:///name:port`` or ``*`` (see the module docstring).

    Raises:
        ValueError: an entry is not a valid address.
    """

    def __init__(self, entries: Sequence[str]) -> None:
        self.any = ANY in entries
        self.targets = [Target.parse(e) for e in entries if e.strip() and e.strip() != ANY]
        self._static = {t.address for t in self.targets if not t.dns}
        self._resolved: set[str] = set()
        self._resolved_at = float("-inf")
        self._lock = asyncio.Lock()

    def __bool__(self) -> bool:
        return self.any or bool(self.targets)

    async def check(self, address: str) -> str | None:
        """None when ``address`` may be dialled, else why not (for PERMISSION_DENIED).

        Raises:
            ValueError: ``address`` is not ``host:port`` (INVALID_ARGUMENT).
        """
        target = Target.parse(address)
        if self.any:
            return None
        if target.dns:
            raise ValueError(f"dit_address must be host:port, got {address!r}")
        if target.address in self._static:
            return None
        if not self.targets:
            return "this AR has no DiT it may reach (setting dit_allow_list is empty)"
        now = time.monotonic()
        stale = now - self._resolved_at
        if stale >= RESOLVE_INTERVAL_SECONDS or (
                target.address not in self._resolved and stale >= MIN_RESOLVE_INTERVAL_SECONDS):
            await self._refresh()
        if target.address in self._resolved:
            return None
        return f"dit_address {target.address} is not a DiT this AR is configured to reach (dit_allow_list)"

    async def _refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._resolved_at < MIN_RESOLVE_INTERVAL_SECONDS:
                return  # another caller refreshed while this one waited
            resolved: set[str] = set()
            for target in self.targets:
                # A static host name resolves too: `host:port` allows the addresses it names.
                addresses = await resolve(Target(target.host, target.port, dns=True))
                resolved |= addresses or set()
            self._resolved = resolved
            self._resolved_at = time.monotonic()


class DiTChannels:
    """One `grpc.aio.Channel` per DiT address, at most ``max_idle`` open beyond those in use.

    Args:
        factory: ``address -> channel`` (e.g. `mammoth_core.grpc_common.create_channel`).
        max_idle: channels kept open while no push uses them.

    Use `acquire` / `release` around each push; must be used from one event loop.
    """

    def __init__(self, factory: Callable[[str], grpc.aio.Channel], max_idle: int) -> None:
        self._factory = factory
        self.max_idle = max(1, int(max_idle))
        self._channels: collections.OrderedDict[str, grpc.aio.Channel] = collections.OrderedDict()
        self._users: collections.Counter[str] = collections.Counter()
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._channels)

    def acquire(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address`` (opened if needed), counted as in use until `release`."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._factory(address)
            self._channels[address] = channel
        self._channels.move_to_end(address)
        self._users[address] += 1
        self._evict()
        return channel

    def release(self, address: str) -> None:
        """One push to ``address`` ended."""
        self._users[address] -= 1
        if self._users[address] <= 0:
            del self._users[address]
        self._evict()

    def _evict(self) -> None:
        idle = [a for a in self._channels if a not in self._users]
        for address in idle[: max(0, len(idle) - self.max_idle)]:
            channel = self._channels.pop(address)
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            logger.debug("closed the idle channel to %s", address)

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
