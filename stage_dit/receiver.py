"""The DiT side of the hidden-state stream: a fixed pool of condition slots, and the
``mammoth.v1.DiT`` registration whose ``PushConditions`` takes raw bytes.

A `SlotPool` owns ``slots`` preallocated `stage_dit.slots.Slot` s (their life, buffers and chunk
handling are described there) and the one `stage_dit.chunk_validator.ChunkValidator` of their
geometry. `SlotPool.reserve` hands out a free slot with a fresh random reservation token (fails fast
with RESOURCE_EXHAUSTED, or waits within its timeout; waiting never blocks the event loop);
`SlotPool.lookup` finds a reserved slot by its token (NOT_FOUND otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc
import torch

from mammoth_core import chunk_stream, tracing, wire
from mammoth_core import transport_metrics as metrics
from mammoth_core.logging import request_id_var
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core import errors
from mammoth_core.errors import Reason, Stage
from mammoth_core.wire import WireError
from stage_dit import metrics as dit_metrics
from stage_dit.chunk_validator import ChunkValidator
from stage_dit.slots import ChunkResult, Slot, SlotConditions, SlotState, SlotTimings

__all__ = ["ChunkResult", "Slot", "SlotConditions", "SlotPool", "SlotState", "SlotTimings", "add_dit_servicer",
           "receive_push"]

logger = logging.getLogger(__name__)


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
        self.validator = ChunkValidator(self.hidden_size, self.max_rows, self.capacity_bytes)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.slots = [Slot(self, i) for i in range(slots)]
        self._free: list[Slot] = list(reversed(self.slots))
        self._by_token: dict[str, Slot] = {}
        self._waiters: list[asyncio.Future] = []
        self.closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        dit_metrics.SLOTS_TOTAL.set(slots)
        dit_metrics.SLOTS_IN_USE.set(0)

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
            dit_metrics.RESERVATIONS.labels(result="refused").inc()
            raise WireError(grpc.StatusCode.UNAVAILABLE, "DiT is draining; no new reservations")
        if not self._free and timeout is not None and timeout <= 0:
            dit_metrics.RESERVATIONS.labels(result="exhausted").inc()
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
                dit_metrics.RESERVATIONS.labels(result="timeout").inc()
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
        slot.open(request_id, params)
        self._by_token[slot.token] = slot
        dit_metrics.RESERVATIONS.labels(result="reserved").inc()
        dit_metrics.SLOTS_IN_USE.set(self.in_use)
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

    def forget_token(self, slot: Slot) -> None:
        """``slot``'s token dies (called by `Slot.release`): further pushes answer NOT_FOUND."""
        self._by_token.pop(slot.token, None)

    def give_back(self, slot: Slot) -> None:
        """``slot`` is FREE again (called by `Slot` once its last copy completed)."""
        self._free.append(slot)
        dit_metrics.SLOTS_IN_USE.set(self.in_use)
        if not self.in_use:
            self._idle.set()
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
                break


async def receive_push(pool: SlotPool, request_iterator: AsyncIterator[bytes | pb.HiddenStateChunk],
                       context: grpc.aio.ServicerContext) -> pb.PushConditionsResponse:
    """``DiT.PushConditions``: every chunk of the stream into the slot its token names.

    Messages arrive as raw bytes (registered by `add_dit_servicer`; split without copying the
    payload) or as parsed chunks. The stream is acknowledged only once the final chunk was accepted
    and the conditions are resident on the device (`Slot.finish`).

    A violation aborts the call with the rule's status (`stage_dit.chunk_validator`; NOT_FOUND for
    an unknown token; FAILED_PRECONDITION with the reason CONDITIONS_COMPLETE in its
    ``google.rpc.Status`` detail once the conditions are complete, `mammoth_core.errors`; every
    abort names the DiT as its origin); a stream that ends or
    breaks before its `StreamEnd` marks the slot's producer lost (the consumer retires the slot
    unless an AR retry begins within the producer grace).
    """
    token: str | None = None
    slot: Slot | None = None
    response: pb.PushConditionsResponse | None = None
    span = tracing.start_span("mammoth.v1.DiT/PushConditions",
                              tracing.extract(context.invocation_metadata()), kind="SERVER")
    try:
        async for chunk in request_iterator:
            data = None
            if isinstance(chunk, bytes):  # registered by add_dit_servicer: payload not copied
                chunk, data = chunk_stream.split_chunk(chunk)
            if token is None:
                token = chunk.reservation_token
                request_id_var.set(chunk.header.request_id or None)
            elif chunk.reservation_token != token:
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "reservation token changed mid-stream")
            slot = pool.lookup(token)
            if slot.accept(chunk, data).complete:
                await slot.finish()  # H2D-complete before the acknowledgement
                # Counted now: once complete, the consumer may release the slot (and reset its
                # counters) before the client half-closes the stream.
                response = pb.PushConditionsResponse(
                    rows_accepted=slot.rows_received(pb.CONDITION),
                    negative_rows_accepted=slot.rows_received(pb.NEGATIVE),
                    chunks_accepted=slot.chunks_accepted)
        if response is None:
            raise WireError(grpc.StatusCode.DATA_LOSS, "stream closed before its StreamEnd")
        metrics.STREAMS.labels(side="receive", result="ok").inc()
        return response
    except WireError as err:
        metrics.REJECTED.labels(code=err.code.name).inc()
        metrics.STREAMS.labels(side="receive", result="rejected").inc()
        if slot is not None and err.code == grpc.StatusCode.DATA_LOSS:
            slot.mark_producer_lost(token)
        await errors.abort(context, err.code, err.message, stage=Stage.DIT,
                           reason=Reason.CONDITIONS_COMPLETE if err.reason == pb.CONDITIONS_COMPLETE
                           else Reason.CHUNK_REJECTED)
    except asyncio.CancelledError:
        metrics.STREAMS.labels(side="receive", result="lost").inc()
        if slot is not None:
            slot.mark_producer_lost(token)
        raise
    finally:
        if span is not None:
            span.set_attribute("mammoth.request_id", request_id_var.get() or "")
            tracing.end_span(span, error=None if response is not None else "incomplete")


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
