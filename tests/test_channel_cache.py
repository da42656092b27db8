"""The decode worker's channels to prefill workers: bounded, and never closed under a pull."""

from __future__ import annotations

import pytest

from kvservice.connector.channel_cache import ChannelCache

pytestmark = pytest.mark.asyncio


async def test_idle_channels_past_the_capacity_are_closed() -> None:
    cache = ChannelCache(capacity=2)
    try:
        for port in range(1, 50):
            async with cache.use(f"127.0.0.1:{port}"):
                pass
        assert len(cache) == 2
    finally:
        await cache.close()
    assert len(cache) == 0


async def test_a_channel_in_use_stays_open_and_is_reused() -> None:
    cache = ChannelCache(capacity=1)
    try:
        async with cache.use("127.0.0.1:1") as held:
            for port in range(2, 6):
                async with cache.use(f"127.0.0.1:{port}"):
                    pass
            async with cache.use("127.0.0.1:1") as again:
                assert again is held  # still open: its pull goes on
        assert len(cache) == 1
    finally:
        await cache.close()
