"""In-memory store of generated images for ``response_format: url``.

Each image gets an unguessable id (`secrets.token_urlsafe`, 192 bits); the URL is a capability
(``GET /v1/images/files/{id}.{ext}`` needs no API key, like OpenAI's signed URLs). Images live
``ttl_seconds`` and then answer 404; when ``max_bytes`` is exceeded the oldest go first.

The store is per gateway process: with more than one gateway replica the gateway Service must use
client-IP session affinity (``sessionAffinity: ClientIP``) so a client fetches its URL from the
replica that generated it (docs/API.md, "url responses").
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from dataclasses import dataclass
from typing import Callable

CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass
class StoredImage:
    """One kept image: encoded ``data``, its ``format`` and absolute ``expires_at`` (monotonic s)."""

    data: bytes
    format: str
    expires_at: float

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES.get(self.format, "application/octet-stream")


class ImageStore:
    """Images by id with a time-to-live and a byte cap.

    Args:
        ttl_seconds: lifetime of each image, seconds (> 0).
        max_bytes: total bytes kept at most; the oldest images are evicted first.
        clock: monotonic clock (seconds), injectable for tests.
        on_change: called with ``(count, bytes)`` after every change (metrics).
    """

    def __init__(
        self,
        ttl_seconds: float,
        max_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be > 0")
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._on_change = on_change
        self._items: collections.OrderedDict[str, StoredImage] = collections.OrderedDict()
        self._bytes = 0
        self._sweeper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, data: bytes, fmt: str) -> str:
        """Keep ``data`` (encoded as ``fmt``) and return its id (``<token>.<fmt>``)."""
        self.purge()
        image_id = f"{secrets.token_urlsafe(24)}.{fmt}"
        self._items[image_id] = StoredImage(data, fmt, self._clock() + self.ttl_seconds)
        self._bytes += len(data)
        while self._bytes > self.max_bytes and len(self._items) > 1:
            self._drop(next(iter(self._items)))
        self._changed()
        return image_id

    def get(self, image_id: str) -> StoredImage | None:
        """The image, or None when unknown or expired."""
        item = self._items.get(image_id)
        if item is None:
            return None
        if item.expires_at <= self._clock():
            self._drop(image_id)
            self._changed()
            return None
        return item

    def purge(self) -> int:
        """Drop expired images; returns how many were dropped."""
        now = self._clock()
        expired = [k for k, v in self._items.items() if v.expires_at <= now]
        for k in expired:
            self._drop(k)
        if expired:
            self._changed()
        return len(expired)

    def clear(self) -> None:
        for k in list(self._items):
            self._drop(k)
        self._changed()

    def _drop(self, image_id: str) -> None:
        item = self._items.pop(image_id, None)
        if item is not None:
            self._bytes -= len(item.data)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._items), self._bytes)

    async def run_sweeper(self, interval: float | None = None) -> None:
        """Purge expired images every ``interval`` seconds (default ttl/4, within [0.05, 30])."""
        period = interval if interval is not None else min(30.0, max(0.05, self.ttl_seconds / 4))
        while True:
            await asyncio.sleep(period)
            self.purge()
