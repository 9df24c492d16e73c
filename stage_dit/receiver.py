"""The DiT side of the hidden-state stream: a fixed pool of condition slots.

A `SlotPool` owns ``slots`` preallocated `Slot` s. Each slot has its own host staging buffer
(pinned on CUDA) and device buffer, sized for ``max_rows_per_slot`` rows of ``hidden_size`` in the
pool dtype, plus a token-id buffer. Nothing is allocated per request.

Life of a slot (one reservation):

1. `SlotPool.reserve` hands out a free slot with a fresh random reservation token (fails fast with
   RESOURCE_EXHAUSTED, or waits within its timeout; waiting never blocks the event loop).
2. `Slot.accept` takes the `HiddenStateChunk` s of ``DiT.PushConditions``. Every chunk is checked
   before any byte is copied (see `Slot.accept` for the rules). Accepted rows are written into the
   staging buffer at their place and, on CUDA, copied host->device on a side stream right away,
   with an event per copy. The last message carries `StreamEnd`: totals and CRC-32C are checked, then
   the receiver waits for the last copy's event, so when the stream is acknowledged the conditions
   are already on the device ("H2D-complete").
3. The consumer (``DiT.Generate``) awaits `Slot.wait_complete`, reads `Slot.conditions`, and calls
   `Slot.release` with the outcome when it is done. Release is idempotent: the slot is retired and
   counted exactly once; it returns to the free list only after its last copy completed.

Identity: ``(request_id, epoch)`` scopes everything. Epochs start at sequence 0 with the stream
metadata. A chunk of an older epoch is rejected; the first chunk of a newer epoch discards the
current epoch's partial rows (an AR retry). A violation in the current epoch poisons that epoch
(its rows are discarded and its further chunks refused): only a newer epoch can continue. Once the
final chunk was accepted, every further chunk is refused (FAILED_PRECONDITION).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from mammoth_core import chunk_stream
from mammoth_core import transport_metrics as metrics
from mammoth_core import wire
from mammoth_core.cuda_events import wait_event
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.wire import WireError

logger = logging.getLogger(__name__)

_ROLES = (pb.CONDITION, pb.NEGATIVE)
# Labelled counters of the per-chunk hot path, resolved once.
_CHUNKS_RECEIVED = metrics.CHUNKS.labels(side="receive")
_BYTES_RECEIVED = metrics.BYTES.labels(side="receive")
_ROWS_RECEIVED = metrics.ROWS.labels(side="receive")


#: Exponent mask of each wire dtype, viewed as unsigned integers: all exponent bits set = NaN or inf.
_EXPONENT_MASKS = {
    torch.bfloat16: (np.uint16, 0x7F80),
    torch.float16: (np.uint16, 0x7C00),
    torch.float32: (np.uint32, 0x7F800000),
}


def all_finite(data: bytes | memoryview, dtype: torch.dtype) -> bool:
    """Whether every value of the raw little-endian ``data`` (``dtype`` from `wire.ALLOWED_DTYPES`)
    is finite; bit tests on the exponent, no float conversion, no copy of ``data``."""
    kind, mask = _EXPONENT_MASKS[dtype]
    bits = np.frombuffer(data, dtype=np.dtype(kind).newbyteorder("<"))
    return not bool(np.any((bits & kind(mask)) == kind(mask)))


def _invalid(msg: str) -> WireError:
    return WireError(grpc.StatusCode.INVALID_ARGUMENT, msg)


def _precondition(msg: str) -> WireError:
    return WireError(grpc.StatusCode.FAILED_PRECONDITION, msg)


def _data_loss(msg: str) -> WireError:
    return WireError(grpc.StatusCode.DATA_LOSS, msg)


@dataclass
class SlotConditions:
    """What the consumer reads from a complete slot (views into the slot's device buffer, valid
    until `Slot.release`).

    Attributes:
        hidden: `torch.Tensor` of shape ``(rows, hidden)``, wire dtype, on the pool device.
        token_ids: `torch.LongTensor` of shape ``(rows,)`` on the CPU.
        negative: NEGATIVE rows ``(negative_rows, hidden)`` on the device, or None.
        negative_token_ids: `torch.LongTensor` ``(negative_rows,)`` or None.
        metadata: the stream's `StreamMetadata`.
    """

    hidden: torch.Tensor
    token_ids: torch.Tensor
    negative: torch.Tensor | None
    negative_token_ids: torch.Tensor | None
    metadata: pb.StreamMetadata


@dataclass
class ChunkResult:
    """Outcome of one accepted chunk."""

    role: int
    rows: int
    complete: bool


@dataclass
class SlotTimings:
    """Monotonic timestamps (seconds) and the sender clock of the final chunk (unix ms)."""

    reserved_at: float = 0.0
    first_chunk_at: float | None = None
    last_chunk_at: float | None = None
    resident_at: float | None = None
    last_sent_unix_ms: float | None = None
    last_received_unix_ms: float | None = None
    resident_unix_ms: float | None = None


@dataclass
class _EpochState:
    epoch: int
    metadata: pb.StreamMetadata | None = None
    dtype: torch.dtype | None = None
    next_sequence: int = 0
    rows: dict[int, int] = field(default_factory=lambda: {pb.CONDITION: 0, pb.NEGATIVE: 0})
    crc: dict[int, int] = field(default_factory=lambda: {pb.CONDITION: 0, pb.NEGATIVE: 0})
    chunks: int = 0
    poisoned: str | None = None


class Slot:
    """One preallocated condition slot. Created by `SlotPool`; see the module docstring.

    Buffers (allocated once):
        staging: ``uint8`` host tensor of ``capacity_bytes`` (pinned on CUDA when possible).
        device_buffer: ``uint8`` tensor of ``capacity_bytes`` on the pool device (the staging
            buffer itself on CPU, where no host->device copy exists).
        token_ids: ``int64`` CPU tensor of ``max_rows`` ids.
    """

    def __init__(self, pool: "SlotPool", index: int):
        self.pool = pool
        self.index = index
        self.slot_id = f"slot-{index}"
        cap = pool.capacity_bytes
        self.pinned = False
        if pool.device.type == "cuda":
            try:
                self.staging = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
            except RuntimeError:  # pinned memory exhausted: pageable staging, counted
                logger.warning("slot %d: pinned staging unavailable, using pageable memory", index)
                metrics.PAGEABLE_FALLBACK.labels(side="receive").inc()
                self.staging = torch.empty(cap, dtype=torch.uint8)
            self.device_buffer = torch.empty(cap, dtype=torch.uint8, device=pool.device)
        else:
            self.staging = torch.empty(cap, dtype=torch.uint8)
            self.device_buffer = self.staging
        self.staging.zero_()  # fault the pages in now, not on the first request's hot path
        self.token_buffer = torch.zeros(pool.max_rows, dtype=torch.int64)
        self._last_event: torch.cuda.Event | None = None
        self._reset_reservation()
        self.state = "free"

    # -- reservation lifecycle ---------------------------------------------------------------

    def _reset_reservation(self) -> None:
        self.request_id = ""
        self.token = ""
        self.params: pb.ImageParams | None = None
        self.outcome: str | None = None
        self._epoch: _EpochState | None = None
        self._complete = False
        self._finishing = False
        self.producer_lost = False
        #: `time.monotonic` when the producer's stream broke (None while it has not).
        self.producer_lost_at: float | None = None
        self.last_rejection: WireError | None = None
        self.timings = SlotTimings()
        #: Accepted chunks of this reservation: (epoch, sequence, role, row_offset, rows, unix ms).
        #: Kept for request traces (the ``trace_dir`` setting); a few dozen tuples per request.
        self.chunk_log: list[tuple[int, int, int, int, int, float]] = []
        self._changed = asyncio.Event()
        self._final_chunks = 0

    def _open(self, request_id: str, params: pb.ImageParams | None) -> None:
        self._reset_reservation()
        self.state = "reserved"
        self.request_id = request_id
        self.params = params
        self.token = secrets.token_urlsafe(24)
        self.timings.reserved_at = time.monotonic()

    @property
    def complete(self) -> bool:
        """True once the final chunk was accepted and every row is resident on the device."""
        return self._complete

    @property
    def epoch(self) -> int | None:
        """The current epoch (None before the first accepted chunk)."""
        return None if self._epoch is None else self._epoch.epoch

    def rows_received(self, role: int = pb.CONDITION) -> int:
        """Rows of ``role`` accepted in the current epoch."""
        return 0 if self._epoch is None else self._epoch.rows[role]

    @property
    def chunks_accepted(self) -> int:
        """Messages accepted in the current epoch."""
        return 0 if self._epoch is None else self._epoch.chunks

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout: float | None) -> None:
        """Wait until rows arrive, the slot completes or is released, or ``timeout`` seconds pass."""
        changed = self._changed
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # arrives as the event fires, leaving a cancelled Generate holding its slot.
        try:
            async with asyncio.timeout(timeout):
                await changed.wait()
        except TimeoutError:
            pass

    async def wait_complete(self, timeout: float | None = None) -> None:
        """Wait until the conditions are complete and resident on the device.

        Raises:
            asyncio.TimeoutError: ``timeout`` seconds passed first.
            WireError: FAILED_PRECONDITION if the slot was released meanwhile.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._complete:
            if self.state != "reserved":
                raise _precondition("slot released before the conditions were complete")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError()
            await self.wait_changed(remaining)

    def mark_producer_lost(self, token: str) -> None:
        """A push stream of this reservation ended without its `StreamEnd` (disconnect, cancel)."""
        if self.state == "reserved" and self.token == token and not self._complete:
            self.producer_lost = True
            self.producer_lost_at = time.monotonic()
            self._notify()

    def release(self, outcome: str) -> bool:
        """Retire the slot with ``outcome`` (one of `transport_metrics.SLOT_OUTCOMES`).

        Idempotent: only the first call counts; returns True for it. The token dies at once (further
        pushes answer NOT_FOUND); the buffers return to the pool once the last host->device copy
        has completed.
        """
        if self.state != "reserved":
            return False
        if outcome not in metrics.SLOT_OUTCOMES:
            raise ValueError(f"unknown slot outcome {outcome!r}")
        self.state = "releasing"
        self.outcome = outcome
        metrics.SLOT_OUTCOMES_TOTAL.labels(outcome=outcome).inc()
        self.pool._forget_token(self)
        self._notify()
        event = self._last_event
        if event is None or event.query():
            self._return_to_pool()
        else:
            asyncio.get_running_loop().create_task(self._return_after(event))
        return True

    async def _return_after(self, event: "torch.cuda.Event") -> None:
        await wait_event(event)
        self._return_to_pool()

    def _return_to_pool(self) -> None:
        self._last_event = None
        self._epoch = None
        self.state = "free"
        self.pool._give_back(self)

    # -- chunks ------------------------------------------------------------------------------

    def _byte_offset(self, st: _EpochState, role: int, row: int) -> int:
        base = 0 if role == pb.CONDITION else int(st.metadata.expected_rows)
        return (base + row) * self.pool.hidden_size * wire.itemsize(st.dtype)

    def _check_metadata(self, md: pb.StreamMetadata) -> torch.dtype:
        if md.protocol_major != wire.PROTOCOL_MAJOR:
            raise _precondition(
                f"unsupported protocol major version {md.protocol_major} (this DiT speaks "
                f"{wire.PROTOCOL_MAJOR}.{wire.PROTOCOL_MINOR})"
            )
        if md.hidden_size != self.pool.hidden_size:
            raise _invalid(f"hidden size {md.hidden_size} differs from the DiT's {self.pool.hidden_size}")
        dtype = wire.dtype_from_proto(md.dtype)
        if md.expected_rows < 1:
            raise _invalid("expected_rows must be >= 1")
        total = md.expected_rows + md.expected_negative_rows
        fit = self.pool.capacity_bytes // (self.pool.hidden_size * wire.itemsize(dtype))
        if total > min(fit, self.pool.max_rows):
            raise _invalid(
                f"{total} rows exceed the slot capacity of {min(fit, self.pool.max_rows)} rows "
                "(max_rows_per_slot)"
            )
        if md.answer_start_index > md.expected_rows:
            raise _invalid("answer_start_index is beyond the expected rows")
        return dtype

    def accept(self, chunk: pb.HiddenStateChunk, data: bytes | memoryview | None = None) -> ChunkResult:
        """Validate one chunk and, if valid, stage its rows (synchronous part of a push).

        ``data`` is the payload when it was split off the message (`chunk_stream.split_chunk`: a zero-copy
        view); None reads ``chunk.data``.

        Rules, in order: slot reserved and not yet complete (FAILED_PRECONDITION); header present,
        request id equal to the reservation's (INVALID_ARGUMENT); epoch not older than the current
        one (INVALID_ARGUMENT), a poisoned epoch refused (FAILED_PRECONDITION); sequence equal to
        the next expected one, so no gap, duplicate or reordering (INVALID_ARGUMENT); metadata on
        sequence 0 with a supported protocol major (FAILED_PRECONDITION), the DiT's hidden size, an
        allowed dtype and row counts within the slot; role CONDITION or NEGATIVE (NEGATIVE only when
        announced); dtype equal to the metadata's, shape ``[rows, hidden]`` matching the payload
        length, ``len(token_ids) == rows``; ``row_offset`` equal to the rows already received for
        the role; rows within the announced count; every value finite (INVALID_ARGUMENT); on
        `StreamEnd`, totals equal
        to the rows announced and received and CRC-32C equal to the received bytes' (DATA_LOSS).

        After a final chunk call `finish` (async) before acknowledging the stream.

        Raises:
            WireError: the rule broken; a chunk of the current (or a newer) epoch also poisons it.
        """
        received_unix_ms = time.time() * 1000.0
        if self.state != "reserved":
            raise WireError(grpc.StatusCode.NOT_FOUND, "reservation is no longer valid")
        if self._complete or self._finishing:
            raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                            "conditions already complete; no further chunks are accepted",
                            reason=pb.CONDITIONS_COMPLETE)
        if not chunk.HasField("header"):
            raise _invalid("chunk without header")
        h = chunk.header
        if h.request_id != self.request_id:
            raise _invalid(f"request id {h.request_id!r} does not own this reservation")
        current = self._epoch
        if current is not None and h.epoch < current.epoch:
            raise _invalid(f"stale epoch {h.epoch} (current epoch is {current.epoch})")
        if current is not None and h.epoch == current.epoch and current.poisoned:
            raise _precondition(f"epoch {h.epoch} was rejected earlier ({current.poisoned}); retry with a newer epoch")
        new_epoch = current is None or h.epoch > current.epoch
        st = _EpochState(epoch=h.epoch) if new_epoch else current
        try:
            result, plan = self._validate(chunk, st, data)
        except WireError as err:
            if new_epoch:
                self._adopt(st)
            st.poisoned = err.message
            self._discard(st)
            self.last_rejection = err
            self._notify()
            raise
        if new_epoch:
            self._adopt(st)
        plan["received_unix_ms"] = received_unix_ms
        self._apply(chunk, st, result, plan)
        return result

    def _adopt(self, st: _EpochState) -> None:
        old = self._epoch
        if old is not None:
            self._discard(old)
            # The new epoch rewrites the staging buffer from row 0: no DMA may still read it.
            if self._last_event is not None:
                self._last_event.synchronize()
        self._epoch = st
        self.last_rejection = None
        self.producer_lost = False
        self.producer_lost_at = None

    @staticmethod
    def _discard(st: _EpochState) -> None:
        dropped = st.rows[pb.CONDITION] + st.rows[pb.NEGATIVE]
        if dropped:
            metrics.DISCARDED_ROWS.inc(dropped)
        st.rows = {pb.CONDITION: 0, pb.NEGATIVE: 0}

    def _validate(
        self, chunk: pb.HiddenStateChunk, st: _EpochState, data: bytes | memoryview | None = None
    ) -> tuple[ChunkResult, dict]:
        h = chunk.header
        if h.sequence != st.next_sequence:
            kind = "duplicate or reordered" if h.sequence < st.next_sequence else "gap before"
            raise _invalid(f"sequence {h.sequence}: {kind} (expected {st.next_sequence})")
        md, dtype = st.metadata, st.dtype
        if h.sequence == 0:
            if not chunk.HasField("metadata"):
                raise _invalid("sequence 0 must carry the stream metadata")
            md = chunk.metadata
            dtype = self._check_metadata(md)
        if data is None:
            data = chunk.data  # each read of a bytes field builds a new copy: read it once
        rows_info = wire.validate_header(
            h, len(data), hidden_size=self.pool.hidden_size, max_rows=self.pool.max_rows,
            expected_dtype=dtype,
        )
        role = h.role
        if rows_info.rows:
            if role not in _ROLES:
                raise _invalid(f"role {role} is not CONDITION or NEGATIVE")
            if not all_finite(data, dtype):
                # NaN/inf conditions would denoise into a blank image without a word.
                raise _invalid(f"{pb.Role.Name(role)} rows {h.row_offset}..{h.row_offset + rows_info.rows - 1} "
                               "hold non-finite values (NaN or inf)")
            expected = md.expected_rows if role == pb.CONDITION else md.expected_negative_rows
            if role == pb.NEGATIVE and expected == 0:
                raise _invalid("NEGATIVE rows in a stream that announced none")
            if h.row_offset != st.rows[role]:
                raise _invalid(f"row_offset {h.row_offset} for {pb.Role.Name(role)}, expected {st.rows[role]}")
            if st.rows[role] + rows_info.rows > expected:
                raise _invalid(
                    f"{st.rows[role] + rows_info.rows} {pb.Role.Name(role)} rows exceed the announced {expected}"
                )
        rows_after = dict(st.rows)
        crc_after = dict(st.crc)
        if rows_info.rows:
            rows_after[role] += rows_info.rows
            crc_after[role] = wire.crc32c(data, st.crc[role])
        final = chunk.HasField("end")
        if final:
            end = chunk.end
            if end.total_rows != md.expected_rows or end.total_rows != rows_after[pb.CONDITION]:
                raise _data_loss(
                    f"stream ended with {rows_after[pb.CONDITION]} CONDITION rows received, "
                    f"{end.total_rows} sent, {md.expected_rows} announced"
                )
            if (
                end.total_negative_rows != md.expected_negative_rows
                or end.total_negative_rows != rows_after[pb.NEGATIVE]
            ):
                raise _data_loss(
                    f"stream ended with {rows_after[pb.NEGATIVE]} NEGATIVE rows received, "
                    f"{end.total_negative_rows} sent, {md.expected_negative_rows} announced"
                )
            if end.crc32c != crc_after[pb.CONDITION] or end.negative_crc32c != crc_after[pb.NEGATIVE]:
                raise _data_loss("CRC-32C of the received rows differs from the sender's")
        plan = {"md": md, "dtype": dtype, "rows_after": rows_after, "crc_after": crc_after,
                "info": rows_info, "data": data}
        return ChunkResult(role=role, rows=rows_info.rows, complete=final), plan

    def _apply(self, chunk: pb.HiddenStateChunk, st: _EpochState, result: ChunkResult, plan: dict) -> None:
        h = chunk.header
        now = time.monotonic()
        if st.metadata is None:
            st.metadata, st.dtype = plan["md"], plan["dtype"]
        if result.rows:
            start = self._byte_offset(st, result.role, st.rows[result.role])
            stop = start + plan["info"].nbytes
            wire.copy_payload(plan["data"], self.staging[start:stop])
            if self.device_buffer is not self.staging:
                self._copy_to_device(start, stop)
            tok0 = (0 if result.role == pb.CONDITION else int(st.metadata.expected_rows)) + st.rows[result.role]
            self.token_buffer.numpy()[tok0 : tok0 + result.rows] = h.token_ids
        st.rows = plan["rows_after"]
        st.crc = plan["crc_after"]
        st.next_sequence += 1
        st.chunks += 1
        self.timings.first_chunk_at = self.timings.first_chunk_at or now
        self.timings.last_chunk_at = now
        self.chunk_log.append((st.epoch, h.sequence, result.role, h.row_offset, result.rows, time.time() * 1000.0))
        _CHUNKS_RECEIVED.inc()
        _BYTES_RECEIVED.inc(plan["info"].nbytes)
        _ROWS_RECEIVED.inc(result.rows)
        if result.complete:
            self._finishing = True
            self.timings.last_sent_unix_ms = h.sent_unix_ms or None
            self.timings.last_received_unix_ms = plan["received_unix_ms"]
        self._notify()

    def _copy_to_device(self, start: int, stop: int) -> None:
        stream = self.pool.copy_stream
        with torch.cuda.stream(stream):
            self.device_buffer[start:stop].copy_(self.staging[start:stop], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._last_event = event

    async def finish(self) -> None:
        """After the final chunk: wait for the last host->device copy, then mark the slot complete
        (the conditions are resident on the device) and wake the consumer."""
        await wait_event(self._last_event)
        if self.state != "reserved":
            return
        self._finishing = False
        self._complete = True
        self.timings.resident_at = time.monotonic()
        self.timings.resident_unix_ms = time.time() * 1000.0
        if self.timings.last_sent_unix_ms:
            tail = (self.timings.resident_unix_ms - self.timings.last_sent_unix_ms) / 1000.0
            metrics.TAIL_SECONDS.observe(max(0.0, tail))
        self._notify()

    def conditions(self) -> SlotConditions:
        """Views of the complete conditions (see `SlotConditions`).

        Raises:
            WireError: FAILED_PRECONDITION when the slot is not complete.
        """
        if not self._complete or self._epoch is None:
            raise _precondition("conditions are not complete")
        st = self._epoch
        md = st.metadata
        hidden, isz = self.pool.hidden_size, wire.itemsize(st.dtype)
        n, m = int(md.expected_rows), int(md.expected_negative_rows)
        buf = self.device_buffer
        cond = buf[: n * hidden * isz].view(st.dtype).view(n, hidden)
        neg = neg_ids = None
        if m:
            neg = buf[n * hidden * isz : (n + m) * hidden * isz].view(st.dtype).view(m, hidden)
            neg_ids = self.token_buffer[n : n + m]
        return SlotConditions(cond, self.token_buffer[:n], neg, neg_ids, md)


class SlotPool:
    """A fixed pool of condition slots.

    Args:
        slots: number of slots (concurrent requests).
        max_rows_per_slot: CONDITION + NEGATIVE rows one slot holds, in ``dtype``.
        hidden_size: width of a hidden-state row (the AR's hidden size).
        dtype: the pool dtype; staging holds ``max_rows_per_slot * hidden_size`` of it (a wider wire
            dtype gets proportionally fewer rows).
        device: where conditions must be resident (``cpu`` or ``cuda[:n]``).

    Must be created and used on one asyncio event loop thread.
    """

    def __init__(self, slots: int, max_rows_per_slot: int, hidden_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        if slots < 1 or max_rows_per_slot < 1 or hidden_size < 1:
            raise ValueError("slots, max_rows_per_slot and hidden_size must be >= 1")
        wire.dtype_to_proto(dtype)
        self.hidden_size = int(hidden_size)
        self.max_rows = int(max_rows_per_slot)
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity_bytes = self.max_rows * self.hidden_size * wire.itemsize(dtype)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.slots = [Slot(self, i) for i in range(slots)]
        self._free: list[Slot] = list(reversed(self.slots))
        self._by_token: dict[str, Slot] = {}
        self._waiters: list[asyncio.Future] = []
        self.closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        metrics.SLOTS_TOTAL.set(slots)
        metrics.SLOTS_IN_USE.set(0)

    @property
    def in_use(self) -> int:
        """Slots reserved or still finishing a copy."""
        return len(self.slots) - len(self._free)

    async def reserve(self, request_id: str, params: pb.ImageParams | None = None,
                      timeout: float | None = 0.0) -> Slot:
        """A slot for ``request_id`` with a fresh reservation token.

        Args:
            timeout: seconds to wait for a free slot; 0 fails fast; None waits without limit.

        Raises:
            WireError: RESOURCE_EXHAUSTED when no slot frees up in time; UNAVAILABLE when closed.
        """
        if self.closed:
            metrics.RESERVATIONS.labels(result="refused").inc()
            raise WireError(grpc.StatusCode.UNAVAILABLE, "DiT is draining; no new reservations")
        if not self._free and timeout is not None and timeout <= 0:
            metrics.RESERVATIONS.labels(result="exhausted").inc()
            raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {len(self.slots)} slots are busy")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._free:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                metrics.RESERVATIONS.labels(result="timeout").inc()
                raise WireError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no slot became free within {timeout:.3g} s",
                ) from None
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
            if self.closed:
                raise WireError(grpc.StatusCode.UNAVAILABLE, "DiT is draining; no new reservations")
        slot = self._free.pop()
        self._idle.clear()
        slot._open(request_id, params)
        self._by_token[slot.token] = slot
        metrics.RESERVATIONS.labels(result="reserved").inc()
        metrics.SLOTS_IN_USE.set(self.in_use)
        return slot

    def lookup(self, token: str) -> Slot:
        """The reserved slot of ``token``.

        Raises:
            WireError: NOT_FOUND for an unknown, expired or released token.
        """
        slot = self._by_token.get(token)
        if slot is None:
            raise WireError(grpc.StatusCode.NOT_FOUND, "unknown or expired reservation token")
        return slot

    async def wait_idle(self) -> None:
        """Return once every slot is free (used by the drain)."""
        while self.in_use:
            await self._idle.wait()

    def close(self) -> None:
        """Refuse new reservations (drain); reserved slots live on until released."""
        self.closed = True
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    def _forget_token(self, slot: Slot) -> None:
        self._by_token.pop(slot.token, None)

    def _give_back(self, slot: Slot) -> None:
        self._free.append(slot)
        metrics.SLOTS_IN_USE.set(self.in_use)
        if not self.in_use:
            self._idle.set()
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
                break


def add_dit_servicer(servicer, server) -> None:
    """Register a ``mammoth.v1.DiT`` servicer on a `grpc.aio.Server`, like the generated
    ``add_DiTServicer_to_server``, except that ``PushConditions`` receives each message as raw
    ``bytes`` (`mammoth_core.chunk_stream.push_conditions_handler`): the servicer splits it with
    `mammoth_core.chunk_stream.split_chunk`, so the payload reaches the slot as a view of gRPC's
    buffer instead of through two more copies (protobuf's parse and the ``data`` field read)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=pb.DiTGenerateRequest.FromString,
            response_serializer=pb.DiTGenerateResponse.SerializeToString,
        ),
        chunk_stream.PUSH_METHOD_NAME: chunk_stream.push_conditions_handler(servicer.PushConditions),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(chunk_stream.DIT_SERVICE, handlers),))
    server.add_registered_method_handlers(chunk_stream.DIT_SERVICE, handlers)
