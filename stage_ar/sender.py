"""The AR side of the hidden-state stream: one `HiddenStateSender` per request.

Two threads meet here:

- the **decode thread** calls `HiddenStateSender.put_rows` after each step (and for prefill rows)
  and `finish` at the end. `put_rows` never waits on the network: it copies the new rows into the
  request's open staging block and returns. On CUDA the copy is issued on a side stream (after
  the decode stream, via ``wait_stream``) into a pinned block and an event is recorded; the source
  tensor is marked with ``record_stream`` so the caching allocator cannot reuse it early. On CPU
  the same path copies synchronously and records no event. When the pinned pool is exhausted the
  block is plain pageable memory, counted in ``mammoth_transport_pageable_fallback_total``.
- the **event loop** runs `HiddenStateSender.run`, which drives the ``DiT.PushConditions`` client
  stream: a sealed block (``rows_per_chunk`` rows, or the rest at `finish`) becomes one message
  once its copy event has completed, then the block returns to the pool.

Messages: sequence 0 carries the `StreamMetadata`; every message carries the reservation token
and a header (request id, epoch, sequence, role, dtype, ``[rows, hidden]``, row offset within the
role, token ids, ``sent_unix_ms``); the last message carries `StreamEnd` (totals and CRC-32C per
role). If `finish` comes after the last block was already sent, the end travels in a message
without rows. Memory is bounded by the request's own row count: a slow or absent consumer holds
only this request's blocks, and never the decode loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import grpc
import numpy as np
import torch

from mammoth_core import transport_metrics as metrics
from mammoth_core import wire
from mammoth_core.chunk_stream import frame_chunk, push_conditions_callable
from mammoth_core.cuda_events import wait_event
from mammoth_core.pb import mammoth_pb2 as pb
from stage_ar.staging import StagingPool, copy_stream, default_staging_pool

logger = logging.getLogger(__name__)
# Labelled counters of the per-message hot path, resolved once.
_CHUNKS_SENT = metrics.CHUNKS.labels(side="send")
_BYTES_SENT = metrics.BYTES.labels(side="send")
_ROWS_SENT = metrics.ROWS.labels(side="send")


def staging_block_bytes(hidden_size: int, dtype: torch.dtype, chunk_rows: int, max_message_bytes: int) -> int:
    """Bytes of one host staging block: one message's rows (`mammoth_core.wire.rows_per_message`)
    of ``hidden_size`` x ``dtype``.

    Raises:
        ValueError: one row does not fit in ``max_message_bytes``.
    """
    rows = wire.rows_per_message(hidden_size, dtype, max_message_bytes, chunk_rows)
    return rows * int(hidden_size) * wire.itemsize(dtype)


def prepare_staging(hidden_size: int, dtype: torch.dtype, chunk_rows: int, max_message_bytes: int,
                    pin: bool) -> StagingPool:
    """Build the process-wide staging pool every request's sender takes its blocks from, before
    the stage reports ready (the AR server calls it after the engine's warm-up).

    Built on first use instead, the pool (`stage_ar.staging.DEFAULT_STAGING_BLOCKS` pinned blocks,
    allocated and faulted in) cost the first request 0.5 s on the H200, inside its first rows'
    delivery on the decode thread (issue 17: first request vs tenth). Arguments as
    `HiddenStateSender`'s; ``pin``: page-locked blocks (rows on CUDA).

    Raises:
        ValueError: one row does not fit in ``max_message_bytes``.
    """
    return default_staging_pool(staging_block_bytes(hidden_size, dtype, chunk_rows, max_message_bytes), pin=pin)


class SenderAborted(Exception):
    """`HiddenStateSender.abort` was called; the stream was cancelled."""


@dataclass
class _Sent:
    rows: int
    nbytes: int
    unix_ms: float


@dataclass
class _Block:
    role: int
    buf: torch.Tensor
    pooled: bool
    row_offset: int
    rows: int = 0
    token_ids: list[int] = field(default_factory=list)
    event: Any = None


class HiddenStateSender:
    """Stream one request's hidden-state rows to its DiT slot.

    Args:
        channel: a `grpc.aio.Channel` to the DiT holding the slot (the push writes the framed
            bytes of `mammoth_core.chunk_stream.frame_chunk` on it as they are).
        request_id, epoch: identity of this attempt (a retry uses ``epoch + 1``).
        reservation_token: the DiT's `Reserved.reservation_token`.
        hidden_size: row width ``H``.
        dtype: the rows' dtype (bfloat16, float16 or float32); sent as is, no upcast.
        answer_start_index: CONDITION rows ``>=`` this index are the answer (image) rows.
        expected_rows: CONDITION rows that will be put (prompt + generated, no look-ahead).
        expected_negative_rows: NEGATIVE rows that will be put (0: none).
        chunk_rows: rows per message (lowered to fit ``max_message_bytes``).
        max_message_bytes: the gRPC message limit, the same on both stages.
        metadata: call metadata (e.g. `mammoth_core.grpc_common.auth_metadata(token)`).
        timeout: deadline of the ``PushConditions`` call in seconds (None: none).
        answer_boundary: the rule that produced ``answer_start_index`` (carried in the metadata).
        staging: host staging pool; default the process-wide one (pinned when rows are on CUDA).

    Raises:
        ValueError: a dtype outside the allow-list, or one row does not fit in a message.
    """

    def __init__(
        self, channel: grpc.aio.Channel, request_id: str, epoch: int, reservation_token: str,
        hidden_size: int, dtype: torch.dtype, answer_start_index: int, expected_rows: int,
        expected_negative_rows: int, chunk_rows: int, max_message_bytes: int,
        metadata: Sequence[tuple[str, str]] = (), timeout: float | None = None, *,
        answer_boundary: str = "prompt_length", staging: StagingPool | None = None,
    ):
        try:
            self._proto_dtype = wire.dtype_to_proto(dtype)
        except wire.WireError as exc:
            raise ValueError(exc.message) from None
        self._push = push_conditions_callable(channel)
        self.request_id = request_id
        self.epoch = int(epoch)
        self.token = reservation_token
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.itemsize = wire.itemsize(dtype)
        self.rows_per_chunk = wire.rows_per_message(hidden_size, dtype, max_message_bytes, chunk_rows)
        self.block_bytes = staging_block_bytes(hidden_size, dtype, chunk_rows, max_message_bytes)
        self.expected = {pb.CONDITION: int(expected_rows), pb.NEGATIVE: int(expected_negative_rows)}
        self._metadata_msg = pb.StreamMetadata(
            protocol_major=wire.PROTOCOL_MAJOR, protocol_minor=wire.PROTOCOL_MINOR,
            hidden_size=self.hidden_size, dtype=self._proto_dtype, answer_start_index=int(answer_start_index),
            expected_rows=int(expected_rows), expected_negative_rows=int(expected_negative_rows),
            answer_boundary=answer_boundary,
        )
        self._call_metadata = tuple(metadata)
        self._timeout = timeout
        self._staging = staging
        self._lock = threading.Lock()
        self._open: dict[int, _Block | None] = {pb.CONDITION: None, pb.NEGATIVE: None}
        self._ready: collections.deque[_Block] = collections.deque()
        self._put = {pb.CONDITION: 0, pb.NEGATIVE: 0}
        self._staged_rows = {pb.CONDITION: 0, pb.NEGATIVE: 0}  # rows in sealed blocks, per role
        self._finished = False
        self._closed = False  # no more put_rows accepted (finished, aborted or failed)
        self._aborted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        # True while the event loop waits for a sealed block (set under the lock by `_next_ready`):
        # only then does sealing a block cost a cross-thread wake-up.
        self._waiting = False
        self._call: Any = None

        self.pageable_fallbacks = 0
        self.rows_sent = {pb.CONDITION: 0, pb.NEGATIVE: 0}
        self.chunks_sent = 0
        self.bytes_sent = 0
        self.last_sent_unix_ms: float | None = None
        self.error: BaseException | None = None

    # -- decode thread -----------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """False once the sender finished, was aborted or its stream failed (stop decoding)."""
        return not self._closed

    def put_rows(self, role: int, hidden: torch.Tensor, token_ids: Sequence[int]) -> bool:
        """Stage new rows for sending. Thread-safe, never waits on the network.

        Args:
            role: ``pb.CONDITION`` or ``pb.NEGATIVE``.
            hidden: `torch.Tensor` of shape ``(rows, hidden_size)`` in the sender's dtype, on any
                device (rows on CUDA are copied on a side stream after the current stream's work).
            token_ids: the ``rows`` token ids of these rows.

        Returns:
            True if staged; False when the sender no longer accepts rows (finished, aborted, or the
            stream failed: the caller should stop producing for this request).

        Raises:
            ValueError: wrong role, shape, dtype or token count, or more rows than announced.
        """
        if role not in (pb.CONDITION, pb.NEGATIVE):
            raise ValueError(f"role must be CONDITION or NEGATIVE, got {role}")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be (rows, {self.hidden_size}), got {tuple(hidden.shape)}")
        if hidden.dtype != self.dtype:
            raise ValueError(f"hidden dtype {hidden.dtype} differs from the stream dtype {self.dtype}")
        rows = hidden.shape[0]
        if len(token_ids) != rows:
            raise ValueError(f"{len(token_ids)} token ids for {rows} rows")
        hidden = hidden.detach()
        with self._lock:
            if self._closed:
                return False
            if self._put[role] + rows > self.expected[role]:
                raise ValueError(
                    f"{self._put[role] + rows} {pb.Role.Name(role)} rows exceed the announced {self.expected[role]}"
                )
            self._put[role] += rows
        # The lock is taken per block, so the event loop can send each block as soon as it is
        # sealed while a long put (prefill rows) is still being staged.
        i = 0
        while i < rows:
            with self._lock:
                if self._closed:
                    return False
                block = self._open[role] or self._new_block(role, hidden.is_cuda)
                n = min(rows - i, self.rows_per_chunk - block.rows)
                self._stage(block, hidden[i : i + n])
                block.token_ids.extend(int(t) for t in token_ids[i : i + n])
                block.rows += n
                i += n
                wake = False
                if block.rows == self.rows_per_chunk:
                    self._seal(role)
                    wake, self._waiting = self._waiting, False
            if wake:
                self._wakeup()
        return True

    def finish(self) -> None:
        """No more rows: seal the partial blocks; the last message will carry `StreamEnd`.
        Thread-safe; idempotent."""
        with self._lock:
            if self._closed:
                return
            for role in (pb.CONDITION, pb.NEGATIVE):
                if self._open[role] is not None:
                    self._seal(role)
            self._finished = True
            self._closed = True
        self._wakeup()

    def abort(self) -> None:
        """Cancel the stream (thread-safe; idempotent). `run` raises `SenderAborted`."""
        with self._lock:
            self._aborted = True
            self._closed = True
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._cancel_call)
            except RuntimeError:  # loop already closed
                pass

    def _pool(self, on_cuda: bool) -> StagingPool:
        if self._staging is None:
            self._staging = default_staging_pool(self.block_bytes, pin=on_cuda)
        return self._staging

    def _new_block(self, role: int, on_cuda: bool) -> _Block:
        pool = self._pool(on_cuda)
        buf = pool.acquire() if pool.block_bytes >= self.block_bytes else None
        pooled = buf is not None
        if not pooled:
            buf = torch.empty(self.block_bytes, dtype=torch.uint8)
            self.pageable_fallbacks += 1
            metrics.PAGEABLE_FALLBACK.labels(side="send").inc()
        block = _Block(role=role, buf=buf, pooled=pooled, row_offset=self._staged_rows[role])
        self._open[role] = block
        return block

    def _stage(self, block: _Block, rows: torch.Tensor) -> None:
        start = block.rows * self.hidden_size * self.itemsize
        nbytes = rows.shape[0] * self.hidden_size * self.itemsize
        dst = block.buf[start : start + nbytes].view(self.dtype).view(rows.shape[0], self.hidden_size)
        if rows.is_cuda:
            stream = copy_stream(rows.device)
            stream.wait_stream(torch.cuda.current_stream(rows.device))
            with torch.cuda.stream(stream):
                dst.copy_(rows, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            rows.record_stream(stream)
            block.event = event
        elif rows.stride(-1) == 1:
            # Host rows: a byte copy through numpy (one single-threaded memcpy per row run, GIL
            # released). ``Tensor.copy_`` between CPU tensors goes through the intra-op thread
            # pool, which on a busy host costs tens of times more than the bytes themselves.
            src = rows.view(torch.uint8).numpy()  # (n, hidden * itemsize), rows may be strided
            np.copyto(dst.view(torch.uint8).numpy(), src)
        else:
            dst.copy_(rows)

    def _seal(self, role: int) -> None:
        block = self._open[role]
        self._open[role] = None
        self._staged_rows[role] += block.rows
        self._ready.append(block)

    def _wakeup(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass

    def _cancel_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._wake is not None:
            self._wake.set()

    # -- event loop --------------------------------------------------------------------------

    async def framed_messages(self) -> AsyncIterator[bytes]:
        """The stream's messages as framed bytes, in order, without a call: for in-process transfers
        (the GPU transport probe feeds a `stage_dit.slots.Slot` with them). Use instead of `run`."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        async for raw in self._messages():
            yield raw

    async def run(self) -> pb.PushConditionsResponse:
        """Drive ``DiT.PushConditions`` until `finish` has been sent and the DiT answered.

        Returns:
            The DiT's `PushConditionsResponse` (rows and chunks accepted).

        Raises:
            grpc.aio.AioRpcError: the DiT refused the stream (its status code says why) or the
                call failed (deadline, connection lost).
            SenderAborted: `abort` was called.
        """
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        result = "failed"
        try:
            if self._aborted:
                raise SenderAborted(f"request {self.request_id} aborted before sending")
            self._call = self._push(self._messages(), metadata=self._call_metadata, timeout=self._timeout)
            try:
                response = await self._call
            except asyncio.CancelledError:
                if self._aborted:
                    raise SenderAborted(f"request {self.request_id} aborted") from None
                raise
            except grpc.aio.AioRpcError as exc:
                if self._aborted and exc.code() == grpc.StatusCode.CANCELLED:
                    raise SenderAborted(f"request {self.request_id} aborted") from None
                raise
            result = "ok"
            return response
        except SenderAborted:
            result = "aborted"
            raise
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            metrics.STREAMS.labels(side="send", result=result).inc()
            with self._lock:
                self._closed = True
                leftovers = list(self._ready) + [b for b in self._open.values() if b is not None]
                self._ready.clear()
                self._open = {pb.CONDITION: None, pb.NEGATIVE: None}
            for block in leftovers:
                await self._release_block(block)

    async def _release_block(self, block: _Block) -> None:
        # A block with a device->host copy in flight goes back only after that copy completed.
        await wait_event(block.event)
        if block.pooled:
            self._staging.release(block.buf)

    def _next_ready(self) -> tuple[_Block | None, bool]:
        """(next sealed block or None, whether the stream is finished after it)."""
        with self._lock:
            block = self._ready.popleft() if self._ready else None
            self._waiting = block is None
            return block, self._finished and not self._ready

    def _end_message(self) -> pb.StreamEnd:
        return pb.StreamEnd(
            total_rows=self.rows_sent[pb.CONDITION],
            total_negative_rows=self.rows_sent[pb.NEGATIVE],
            crc32c=self._crc[pb.CONDITION],
            negative_crc32c=self._crc[pb.NEGATIVE],
        )

    def _header(self, sequence: int, block: _Block | None) -> pb.HiddenStateChunk:
        header = pb.ChunkHeader(request_id=self.request_id, epoch=self.epoch, sequence=sequence,
                                dtype=self._proto_dtype)
        if block is not None:
            header.role = block.role
            header.shape.extend((block.rows, self.hidden_size))
            header.row_offset = block.row_offset
            header.token_ids.extend(block.token_ids)
        msg = pb.HiddenStateChunk(reservation_token=self.token, header=header)
        if sequence == 0:
            msg.metadata.CopyFrom(self._metadata_msg)
        return msg

    def _frame(self, sequence: int, block: _Block | None, last: bool) -> tuple[bytes, _Sent]:
        """Message ``sequence`` as bytes: ``block``'s rows (None: the end alone), `StreamEnd` when
        ``last``; in sequence order (the CRCs chain). The block's copy must have completed
        (`_messages` awaits its event). Returns the block to the pool, whatever happens."""
        try:
            if block is None:
                msg = self._header(sequence, None)
                msg.end.CopyFrom(self._end_message())
                msg.header.sent_unix_ms = time.time() * 1000.0
                return msg.SerializeToString(), _Sent(0, 0, msg.header.sent_unix_ms)
            nbytes = block.rows * self.hidden_size * self.itemsize
            payload = wire.staged_buffer(block.buf[:nbytes])
            self._crc[block.role] = wire.crc32c(payload, self._crc[block.role])
            self.rows_sent[block.role] += block.rows
            msg = self._header(sequence, block)
            if last:
                msg.end.CopyFrom(self._end_message())
            msg.header.sent_unix_ms = time.time() * 1000.0
            # The payload is copied once, from staging straight into the message bytes.
            return frame_chunk(msg, payload), _Sent(block.rows, nbytes, msg.header.sent_unix_ms)
        finally:
            if block is not None and block.pooled:
                self._staging.release(block.buf)

    async def _messages(self):
        """Serialised ``HiddenStateChunk`` messages, in order (see `frame_chunk`): each sealed block
        once its device->host copy completed (D2H-ready), then the end if it travels alone.

        Framing stays on the event loop: a framing thread ahead of the write was measured (CPU
        loopback, 29 MiB pushes) to add sender CPU for thread hand-offs without moving throughput,
        and a thread hop would add to the transfer tail.
        """
        self._crc = {pb.CONDITION: 0, pb.NEGATIVE: 0}
        sequence = 0
        while True:
            self._wake.clear()
            if self._aborted:
                return
            block, last = self._next_ready()
            if block is None and not last:
                await self._wake.wait()
                continue
            # block None and last: finished with everything sent, the end travels alone.
            if block is not None:
                try:
                    await wait_event(block.event)  # D2H-ready: bytes leave only after the copy
                except BaseException:  # cancelled mid-wait: the block goes back once its copy is done
                    asyncio.get_running_loop().create_task(self._release_block(block))
                    raise
            raw, sent = self._frame(sequence, block, last)
            self.last_sent_unix_ms = sent.unix_ms
            if sent.rows:
                self.chunks_sent += 1
                self.bytes_sent += sent.nbytes
                _CHUNKS_SENT.inc()
                _BYTES_SENT.inc(sent.nbytes)
                _ROWS_SENT.inc(sent.rows)
            yield raw
            sequence += 1
            if last:
                return

