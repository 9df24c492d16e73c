"""One condition slot of the DiT: its buffers, its life, and how accepted chunks land in it.

A `Slot` has its own host staging buffer (pinned on CUDA) and device buffer, sized for
``max_rows_per_slot`` rows of ``hidden_size`` in the pool dtype, plus a token-id buffer, allocated
once by `stage_dit.receiver.SlotPool`. Nothing is allocated per request.

Life of a slot (one reservation; `SlotState`):

1. `SlotPool.reserve` hands out a FREE slot, now RESERVED, with a fresh random reservation token.
2. `Slot.accept` takes the `HiddenStateChunk` s of ``DiT.PushConditions``. Every chunk is judged by
   `stage_dit.chunk_validator.ChunkValidator` before any byte is copied. Accepted rows are written
   into the staging buffer at their place and, on CUDA, copied host->device on a side stream right
   away, with an event per copy. After the final chunk (`StreamEnd`: totals and CRC-32C checked)
   `Slot.finish` waits for the last copy's event, so when the stream is acknowledged the conditions
   are already on the device ("H2D-complete").
3. The consumer (``DiT.Generate``) awaits `Slot.wait_complete`, reads `Slot.conditions`, and calls
   `Slot.release` with the outcome when it is done (RELEASING). Release is idempotent: the slot is
   retired and counted exactly once; it is FREE again only after its last copy completed.

Identity: ``(request_id, epoch)`` scopes everything. Epochs start at sequence 0 with the stream
metadata. A chunk of an older epoch is rejected; the first chunk of a newer epoch discards the
current epoch's partial rows (an AR retry). A violation in the current epoch poisons that epoch
(its rows are discarded and its further chunks refused): only a newer epoch can continue. Once the
final chunk was accepted, every further chunk is refused (FAILED_PRECONDITION).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from mammoth_core import transport_metrics as metrics
from mammoth_core import wire
from mammoth_core.cuda_events import wait_event
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.wire import WireError
from stage_dit.chunk_validator import Accepted, EpochState, Rejected

if TYPE_CHECKING:
    from stage_dit.receiver import SlotPool

logger = logging.getLogger(__name__)

# Labelled counters of the per-chunk hot path, resolved once.
_CHUNKS_RECEIVED = metrics.CHUNKS.labels(side="receive")
_BYTES_RECEIVED = metrics.BYTES.labels(side="receive")
_ROWS_RECEIVED = metrics.ROWS.labels(side="receive")


def _precondition(msg: str) -> WireError:
    return WireError(grpc.StatusCode.FAILED_PRECONDITION, msg)


class SlotState(enum.Enum):
    """Where a slot is in its life: FREE (in the pool) -> RESERVED (`SlotPool.reserve`: a token
    lives, chunks are accepted) -> RELEASING (`Slot.release`: the token is dead, a host->device copy
    may still run) -> FREE."""

    FREE = "free"
    RESERVED = "reserved"
    RELEASING = "releasing"


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
        self.state = SlotState.FREE

    # -- reservation lifecycle ---------------------------------------------------------------

    def _reset_reservation(self) -> None:
        self.request_id = ""
        self.token = ""
        self.params: pb.ImageParams | None = None
        self.outcome: str | None = None
        self._epoch: EpochState | None = None
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

    def open(self, request_id: str, params: pb.ImageParams | None) -> None:
        """FREE -> RESERVED for ``request_id`` with a fresh token (called by `SlotPool.reserve`)."""
        self._reset_reservation()
        self.state = SlotState.RESERVED
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
            if self.state is not SlotState.RESERVED:
                raise _precondition("slot released before the conditions were complete")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError()
            await self.wait_changed(remaining)

    def mark_producer_lost(self, token: str) -> None:
        """A push stream of this reservation ended without its `StreamEnd` (disconnect, cancel)."""
        if self.state is SlotState.RESERVED and self.token == token and not self._complete:
            self.producer_lost = True
            self.producer_lost_at = time.monotonic()
            self._notify()

    def release(self, outcome: str) -> bool:
        """Retire the slot with ``outcome`` (one of `transport_metrics.SLOT_OUTCOMES`).

        Idempotent: only the first call counts; returns True for it. The token dies at once (further
        pushes answer NOT_FOUND); the buffers return to the pool once the last host->device copy
        has completed.
        """
        if self.state is not SlotState.RESERVED:
            return False
        if outcome not in metrics.SLOT_OUTCOMES:
            raise ValueError(f"unknown slot outcome {outcome!r}")
        self.state = SlotState.RELEASING
        self.outcome = outcome
        metrics.SLOT_OUTCOMES_TOTAL.labels(outcome=outcome).inc()
        self.pool.forget_token(self)
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
        self.state = SlotState.FREE
        self.pool.give_back(self)

    # -- chunks ------------------------------------------------------------------------------

    def _byte_offset(self, st: EpochState, role: int, row: int) -> int:
        base = 0 if role == pb.CONDITION else int(st.metadata.expected_rows)
        return (base + row) * self.pool.hidden_size * wire.itemsize(st.dtype)

    def accept(self, chunk: pb.HiddenStateChunk, data: bytes | memoryview | None = None) -> ChunkResult:
        """Validate one chunk and, if valid, stage its rows (synchronous part of a push).

        ``data`` is the payload when it was split off the message (`chunk_stream.split_chunk`: a
        zero-copy view); None reads ``chunk.data``.

        The slot must be reserved (else NOT_FOUND) and not yet complete (else FAILED_PRECONDITION
        with the refusal reason CONDITIONS_COMPLETE); then every rule of
        `stage_dit.chunk_validator` applies, in its order. After a final chunk call `finish`
        (async) before acknowledging the stream.

        Raises:
            WireError: the rule broken; a chunk of the current (or a newer) epoch also poisons it.
        """
        received_unix_ms = time.time() * 1000.0
        if self.state is not SlotState.RESERVED:
            raise WireError(grpc.StatusCode.NOT_FOUND, "reservation is no longer valid")
        if self._complete or self._finishing:
            raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                            "conditions already complete; no further chunks are accepted",
                            reason=pb.CONDITIONS_COMPLETE)
        if data is None:
            data = chunk.data  # each read of a bytes field builds a new copy: read it once
        verdict = self.pool.validator.check(chunk, data, request_id=self.request_id, current=self._epoch)
        if isinstance(verdict, Rejected):
            if verdict.poisons:
                self._poison(verdict)
            raise verdict.error()
        if verdict.new_epoch:
            self._adopt(EpochState(verdict.epoch))
        self._apply(chunk.header, verdict, received_unix_ms)
        return ChunkResult(role=verdict.role, rows=verdict.rows, complete=verdict.final)

    def _poison(self, rejected: Rejected) -> None:
        """The chunk's epoch (a new one starts for it) is rejected: its rows are discarded and its
        further chunks refused."""
        if rejected.new_epoch:
            self._adopt(EpochState(rejected.epoch))
        st = self._epoch
        st.poisoned = rejected.message
        self._discard(st)
        self.last_rejection = rejected.error()
        self._notify()

    def _adopt(self, st: EpochState) -> None:
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
    def _discard(st: EpochState) -> None:
        dropped = st.rows[pb.CONDITION] + st.rows[pb.NEGATIVE]
        if dropped:
            metrics.DISCARDED_ROWS.inc(dropped)
        st.rows = {pb.CONDITION: 0, pb.NEGATIVE: 0}

    def _apply(self, h: pb.ChunkHeader, ok: Accepted, received_unix_ms: float) -> None:
        """Stage an accepted chunk's rows and token ids, start their host->device copy, count."""
        st = self._epoch
        now = time.monotonic()
        if st.metadata is None:
            st.metadata, st.dtype = ok.metadata, ok.dtype
        if ok.rows:
            start = self._byte_offset(st, ok.role, st.rows[ok.role])
            stop = start + ok.nbytes
            wire.copy_payload(ok.payload, self.staging[start:stop])
            if self.device_buffer is not self.staging:
                self._copy_to_device(start, stop)
            tok0 = (0 if ok.role == pb.CONDITION else int(st.metadata.expected_rows)) + st.rows[ok.role]
            self.token_buffer.numpy()[tok0 : tok0 + ok.rows] = h.token_ids
        st.rows, st.crc = ok.rows_after, ok.crc_after
        st.next_sequence += 1
        st.chunks += 1
        self.timings.first_chunk_at = self.timings.first_chunk_at or now
        self.timings.last_chunk_at = now
        self.chunk_log.append((st.epoch, h.sequence, ok.role, h.row_offset, ok.rows, time.time() * 1000.0))
        _CHUNKS_RECEIVED.inc()
        _BYTES_RECEIVED.inc(ok.nbytes)
        _ROWS_RECEIVED.inc(ok.rows)
        if ok.final:
            self._finishing = True
            self.timings.last_sent_unix_ms = h.sent_unix_ms or None
            self.timings.last_received_unix_ms = received_unix_ms
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
        if self.state is not SlotState.RESERVED:
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
