"""Receiver rules under hostile interleavings (in-process SlotPool, real chunks from the codec).

Several requests, each pushed in several epochs (AR retries), their chunk streams interleaved and
damaged: duplicates, drops, reorders, stale epochs, chunks carrying another request's id or token,
flipped payload bytes, wrong dtype/hidden size/row offset. Whatever happens:

- a slot completes only with exactly the rows its own producer sent in one epoch (bit-identical),
  never with rows of another request or a mix of epochs;
- a chunk is only ever accepted into the slot whose token it carries and whose request id it names;
- every accepted, undamaged chunk lands bit-identical at its place in the staging buffer.
"""

from __future__ import annotations

import asyncio
import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mammoth_core import wire
from mammoth_core.pb import mammoth_pb2 as pb
from stage_dit.receiver import SlotPool

HIDDEN = 4
MAX_ROWS = 32


def producer_rows(request: int, epoch: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct random finite bit patterns per (request, epoch): subnormals, ±0 and extremes
    included; NaN/inf patterns get their lowest exponent bit cleared (the receiver refuses them)."""
    g = torch.Generator().manual_seed(1000 * request + epoch)
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31 - 1, (rows, HIDDEN), generator=g, dtype=torch.int32)
    else:
        bits = torch.randint(-(2**15), 2**15 - 1, (rows, HIDDEN), generator=g, dtype=torch.int16)
    lowest_exponent_bit = {torch.float32: 0x00800000, torch.float16: 0x0400, torch.bfloat16: 0x0080}[dtype]
    bits[~torch.isfinite(bits.view(dtype))] ^= lowest_exponent_bit
    return bits.view(dtype)


def build_stream(request_id, token, epoch, cond, neg, chunk_rows, dtype):
    """The chunk messages an honest sender produces for one epoch (CONDITION then NEGATIVE)."""
    msgs, seq = [], 0
    crc = {pb.CONDITION: 0, pb.NEGATIVE: 0}
    for role, rows in ((pb.CONDITION, cond), (pb.NEGATIVE, neg)):
        if rows is None:
            continue
        for off in range(0, rows.shape[0], chunk_rows):
            part = rows[off : off + chunk_rows]
            data = wire.encode_rows(part)
            crc[role] = wire.crc32c(data, crc[role])
            header = pb.ChunkHeader(
                request_id=request_id, epoch=epoch, sequence=seq, role=role,
                dtype=wire.dtype_to_proto(dtype), shape=list(part.shape), row_offset=off,
                token_ids=list(range(off, off + part.shape[0])),
            )
            msgs.append(pb.HiddenStateChunk(reservation_token=token, header=header, data=data))
            seq += 1
    msgs[0].metadata.CopyFrom(
        pb.StreamMetadata(
            protocol_major=wire.PROTOCOL_MAJOR, hidden_size=HIDDEN, dtype=wire.dtype_to_proto(dtype),
            answer_start_index=1, expected_rows=cond.shape[0],
            expected_negative_rows=0 if neg is None else neg.shape[0],
        )
    )
    msgs[-1].end.CopyFrom(
        pb.StreamEnd(
            total_rows=cond.shape[0], total_negative_rows=0 if neg is None else neg.shape[0],
            crc32c=crc[pb.CONDITION], negative_crc32c=crc[pb.NEGATIVE],
        )
    )
    return msgs


# "late_replay" re-delivers a chunk at the very end, after newer epochs have started (a stale
# epoch's chunk arriving late). Relabelling a chunk's epoch is not a mutation here: a chunk that
# claims another epoch with a consistent payload is, to any receiver, that epoch's chunk.
MUTATIONS = ("none", "none", "none", "duplicate", "drop", "swap", "other_request_id",
             "other_token", "flip_byte", "bad_offset", "bad_dtype", "bad_hidden", "late_replay")


async def scenario(seed: int, n_requests: int, n_epochs: int, mutation_rate: float,
                   dtype: torch.dtype, chunk_rows: int):
    rng = random.Random(seed)
    pool = SlotPool(slots=n_requests, max_rows_per_slot=MAX_ROWS, hidden_size=HIDDEN,
                    dtype=torch.float32, device="cpu")
    slots, truth, deliveries = [], {}, []
    for r in range(n_requests):
        slot = await pool.reserve(f"req-{r}", pb.ImageParams())
        slots.append(slot)
        n_cond = rng.randint(1, 12)
        n_neg = rng.choice([0, 0, rng.randint(1, 6)])
        for e in range(n_epochs):
            cond = producer_rows(r, e, n_cond, dtype)
            neg = producer_rows(r, 100 + e, n_neg, dtype) if n_neg else None
            truth[(r, e)] = (cond, neg)
            stream = build_stream(f"req-{r}", slot.token, e, cond, neg, chunk_rows, dtype)
            # An AR retry may start before or after the old epoch's last chunk; streams interleave.
            deliveries.append([(r, e, m, "none") for m in stream])
    # Interleave all streams preserving each stream's own order, then damage some deliveries.
    merged = []
    queues = [list(d) for d in deliveries]
    while any(queues):
        q = rng.choice([q for q in queues if q])
        merged.append(q.pop(0))
    damaged, replays = [], []
    for r, e, msg, _ in merged:
        if rng.random() >= mutation_rate:
            damaged.append((r, e, msg, "none"))
            continue
        kind = rng.choice(MUTATIONS[3:])
        m = pb.HiddenStateChunk()
        m.CopyFrom(msg)
        if kind == "duplicate":
            damaged += [(r, e, msg, "none"), (r, e, m, "duplicate")]
            continue
        if kind == "drop":
            continue
        if kind == "swap" and damaged:
            damaged.insert(len(damaged) - 1, (r, e, m, "swap"))
            continue
        if kind == "other_request_id":
            m.header.request_id = f"req-{(r + 1) % n_requests}" if n_requests > 1 else "intruder"
        elif kind == "other_token" and n_requests > 1:
            m.reservation_token = slots[(r + 1) % n_requests].token
        elif kind == "flip_byte" and m.data:
            b = bytearray(m.data)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            m.data = bytes(b)
        elif kind == "bad_offset":
            m.header.row_offset += 1
        elif kind == "bad_dtype":
            m.header.dtype = pb.FLOAT16 if m.header.dtype != pb.FLOAT16 else pb.BFLOAT16
        elif kind == "bad_hidden":
            m.header.shape[1] = HIDDEN + 1
        elif kind == "late_replay":
            damaged.append((r, e, msg, "none"))
            replays.append((r, e, m, "late_replay"))
            continue
        damaged.append((r, e, m, kind))
    damaged += replays

    completed_by = {}
    for r, e, msg, kind in damaged:
        try:
            slot = pool.lookup(msg.reservation_token)
        except wire.WireError:
            continue
        owner = slots.index(slot)
        try:
            result = slot.accept(msg)
        except wire.WireError:
            continue
        # Accepted: it is addressed to this slot, by this request, in the slot's current epoch.
        assert msg.header.request_id == f"req-{owner}"
        assert slot.epoch == msg.header.epoch
        if kind in ("none", "swap", "duplicate", "late_replay") and result.rows:
            # Undamaged payload: bit-identical at its place in the staging buffer.
            cond, neg = truth[(owner, msg.header.epoch)]
            isz = wire.itemsize(dtype)
            base = 0 if result.role == pb.CONDITION else cond.shape[0]
            start = (base + msg.header.row_offset) * HIDDEN * isz
            assert bytes(slot.staging[start : start + len(msg.data)].numpy()) == msg.data
        if result.complete:
            await slot.finish()
            completed_by[owner] = msg.header.epoch

    for owner, epoch in completed_by.items():
        slot = slots[owner]
        assert slot.complete
        cond, neg = truth[(owner, epoch)]
        c = slot.conditions()
        assert c.hidden.dtype == dtype
        assert torch.equal(c.hidden.view(torch.uint8), cond.view(torch.uint8))
        assert c.token_ids.tolist() == list(range(cond.shape[0]))
        if neg is None:
            assert c.negative is None
        else:
            assert torch.equal(c.negative.view(torch.uint8), neg.view(torch.uint8))
    # Undamaged runs complete: with no mutation every slot finishes with its newest epoch that
    # was not superseded mid-way (at least one epoch completes).
    if mutation_rate == 0:
        assert set(completed_by) == set(range(n_requests))
    for s in slots:
        assert s.release("completed" if s.complete else "cancelled")
        assert not s.release("cancelled")  # idempotent
    assert pool.in_use == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_requests=st.integers(1, 4),
    n_epochs=st.integers(1, 3),
    mutation_rate=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    chunk_rows=st.integers(1, 5),
)
def test_interleaved_damaged_streams(seed, n_requests, n_epochs, mutation_rate, dtype, chunk_rows):
    asyncio.run(scenario(seed, n_requests, n_epochs, mutation_rate, dtype, chunk_rows))
