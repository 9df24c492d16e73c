"""The AR's DiT allow-list and bounded channel cache (`stage_ar.dit_targets`), with real gRPC channels
and real name resolution (``localhost``)."""

from __future__ import annotations

import grpc
import pytest

from mammoth_core import grpc_common
from stage_ar.dit_targets import DiTAllowList, DiTChannels


async def test_allow_list_static_resolved_any_and_empty():
    allow = DiTAllowList(["10.0.0.5:50052", "dns:///localhost:6000"])
    assert await allow.check("10.0.0.5:50052") is None
    assert await allow.check("127.0.0.1:6000") is None  # an address the name resolves to
    assert "not a DiT" in await allow.check("127.0.0.1:6001")  # another port of the same host
    assert "not a DiT" in await allow.check("169.254.169.254:80")
    with pytest.raises(ValueError):
        await allow.check("dns:///localhost:6000")  # the gateway hands concrete addresses
    with pytest.raises(ValueError):
        await allow.check("no-port")
    assert "empty" in await DiTAllowList([]).check("127.0.0.1:6000")
    assert await DiTAllowList(["*"]).check("203.0.113.9:1") is None
    assert await DiTAllowList(["localhost:6000"]).check("127.0.0.1:6000") is None


async def test_channel_cache_is_bounded_and_never_closes_a_channel_in_use():
    opened: list[grpc.aio.Channel] = []

    def factory(address: str) -> grpc.aio.Channel:
        channel = grpc_common.create_channel(address, 1 << 20)
        opened.append(channel)
        return channel

    cache = DiTChannels(factory, max_idle=2)
    held = cache.acquire("127.0.0.1:7000")
    for port in range(7001, 7011):  # ten more DiTs, one push each
        cache.acquire(f"127.0.0.1:{port}")
        cache.release(f"127.0.0.1:{port}")
        assert len(cache) <= 3  # 2 idle + the one in use
    assert cache.acquire("127.0.0.1:7000") is held  # in use: kept, the same channel
    cache.release("127.0.0.1:7000")
    cache.release("127.0.0.1:7000")
    assert len(cache) == 2
    assert len(opened) == 11
    await cache.close()
    assert len(cache) == 0
