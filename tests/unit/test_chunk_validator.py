"""`ChunkValidator`: every rule of the receiver, one case each, in-process (no server, no slot).

Chunks are built by the real sender's framing where rows are involved (`frame_chunk`, then
`split_chunk`, as the DiT receives them) or by hand where a rule needs a header the sender never
writes.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from mammoth_core import wire
from mammoth_core.chunk_stream import frame_chunk, split_chunk
from mammoth_core.pb import mammoth_pb2 as pb
from stage_dit.chunk_validator import Accepted, ChunkValidator, EpochState, Rejected, Rule, all_finite

HIDDEN = 4
MAX_ROWS = 16
REQUEST = "req-1"
INVALID, PRECONDITION, LOSS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                               grpc.StatusCode.DATA_LOSS)


@pytest.fixture
def validator() -> ChunkValidator:
    return ChunkValidator(HIDDEN, MAX_ROWS, MAX_ROWS * HIDDEN * 4)


def metadata(**kw) -> pb.StreamMetadata:
    fields = dict(protocol_major=wire.PROTOCOL_MAJOR, hidden_size=HIDDEN, dtype=pb.FLOAT32, answer_start_index=1,
                  expected_rows=6, expected_negative_rows=0)
    fields.update(kw)
    return pb.StreamMetadata(**fields)


def rows(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN) + start


def chunk(sequence: int = 0, *, epoch: int = 0, role: int = pb.CONDITION, values: torch.Tensor | None = None,
          row_offset: int = 0, md: pb.StreamMetadata | None = None, end: pb.StreamEnd | None = None,
          request_id: str = REQUEST, **header) -> tuple[pb.HiddenStateChunk, memoryview]:
    """A chunk as the receiver sees it: framed like the sender frames it, then split."""
    h = pb.ChunkHeader(request_id=request_id, epoch=epoch, sequence=sequence, dtype=pb.FLOAT32, **header)
    payload = b""
    if values is not None:
        h.role = role
        h.shape.extend(values.shape)
        h.row_offset = row_offset
        h.token_ids.extend(range(values.shape[0]))
        payload = wire.encode_rows(values)
    msg = pb.HiddenStateChunk(reservation_token="t", header=h)
    if sequence == 0 and md is not False:
        msg.metadata.CopyFrom(md or metadata())
    if end is not None:
        msg.end.CopyFrom(end)
    return split_chunk(frame_chunk(msg, payload))


def epoch_after(validator, *chunks, current: EpochState | None = None) -> EpochState:
    """The epoch state after applying ``chunks`` (each must be accepted), as the slot would."""
    for msg, data in chunks:
        verdict = validator.check(msg, data, request_id=REQUEST, current=current)
        assert isinstance(verdict, Accepted), verdict
        current = EpochState(verdict.epoch) if verdict.new_epoch else current
        current.metadata, current.dtype = verdict.metadata, verdict.dtype
        current.rows, current.crc = verdict.rows_after, verdict.crc_after
        current.next_sequence += 1
        current.chunks += 1
    return current


def rejected(validator, msg_data, current=None) -> Rejected:
    verdict = validator.check(*msg_data, request_id=REQUEST, current=current)
    assert isinstance(verdict, Rejected), verdict
    return verdict


def end_for(*tensors: torch.Tensor, negative: tuple[torch.Tensor, ...] = ()) -> pb.StreamEnd:
    crc = neg_crc = 0
    for t in tensors:
        crc = wire.crc32c(wire.encode_rows(t), crc)
    for t in negative:
        neg_crc = wire.crc32c(wire.encode_rows(t), neg_crc)
    return pb.StreamEnd(total_rows=sum(t.shape[0] for t in tensors), crc32c=crc,
                        total_negative_rows=sum(t.shape[0] for t in negative), negative_crc32c=neg_crc)


# -- accepted --------------------------------------------------------------------------------


def test_a_whole_stream_is_accepted_with_its_totals(validator):
    first, second = rows(4), rows(2, 100.0)
    st = epoch_after(validator, chunk(0, values=first))
    assert (st.epoch, st.rows[pb.CONDITION], st.dtype) == (0, 4, torch.float32)
    msg, data = chunk(1, values=second, row_offset=4, end=end_for(first, second))
    verdict = validator.check(msg, data, request_id=REQUEST, current=st)
    assert isinstance(verdict, Accepted)
    assert (verdict.final, verdict.new_epoch, verdict.rows, verdict.nbytes) == (True, False, 2, 2 * HIDDEN * 4)
    assert verdict.rows_after == {pb.CONDITION: 6, pb.NEGATIVE: 0}
    assert st.rows[pb.CONDITION] == 4, "the validator changes no state"


def test_the_end_may_travel_alone(validator):
    values = rows(6)
    st = epoch_after(validator, chunk(0, values=values))
    verdict = validator.check(*chunk(1, end=end_for(values)), request_id=REQUEST, current=st)
    assert isinstance(verdict, Accepted) and verdict.final and verdict.rows == 0


def test_a_newer_epoch_starts_fresh(validator):
    st = epoch_after(validator, chunk(0, values=rows(3)))
    verdict = validator.check(*chunk(0, epoch=1, values=rows(2)), request_id=REQUEST, current=st)
    assert isinstance(verdict, Accepted) and verdict.new_epoch and verdict.epoch == 1
    assert verdict.rows_after[pb.CONDITION] == 2


def test_negative_rows_when_announced(validator):
    md = metadata(expected_negative_rows=2)
    st = epoch_after(validator, chunk(0, values=rows(6), md=md))
    verdict = validator.check(*chunk(1, role=pb.NEGATIVE, values=rows(2)), request_id=REQUEST, current=st)
    assert isinstance(verdict, Accepted) and verdict.rows_after == {pb.CONDITION: 6, pb.NEGATIVE: 2}


# -- identity (no poisoning) -----------------------------------------------------------------


def test_no_header(validator):
    r = rejected(validator, (pb.HiddenStateChunk(reservation_token="t"), b""))
    assert (r.rule, r.code, r.poisons) == (Rule.NO_HEADER, INVALID, False)


def test_wrong_request_id(validator):
    r = rejected(validator, chunk(0, values=rows(1), request_id="someone-else"))
    assert (r.rule, r.code, r.poisons) == (Rule.WRONG_REQUEST, INVALID, False)


def test_stale_epoch(validator):
    st = epoch_after(validator, chunk(0, epoch=3, values=rows(1)))
    r = rejected(validator, chunk(1, epoch=2, values=rows(1), row_offset=1), st)
    assert (r.rule, r.code, r.poisons) == (Rule.STALE_EPOCH, INVALID, False)


def test_poisoned_epoch(validator):
    st = dataclasses.replace(epoch_after(validator, chunk(0, values=rows(1))), poisoned="earlier")
    r = rejected(validator, chunk(1, values=rows(1), row_offset=1), st)
    assert (r.rule, r.code, r.poisons) == (Rule.POISONED_EPOCH, PRECONDITION, False)


# -- rules that poison the epoch ---------------------------------------------------------------


@pytest.mark.parametrize("sequence", [0, 2])
def test_sequence_gap_or_duplicate(validator, sequence):
    st = epoch_after(validator, chunk(0, values=rows(1)))
    r = rejected(validator, chunk(sequence, values=rows(1), row_offset=1, md=False), st)
    assert (r.rule, r.code, r.poisons, r.new_epoch, r.epoch) == (Rule.SEQUENCE, INVALID, True, False, 0)


def test_first_chunk_of_a_new_epoch_that_breaks_a_rule_poisons_that_epoch(validator):
    st = epoch_after(validator, chunk(0, values=rows(1)))
    r = rejected(validator, chunk(1, epoch=4, values=rows(1)), st)
    assert (r.rule, r.poisons, r.new_epoch, r.epoch) == (Rule.SEQUENCE, True, True, 4)


@pytest.mark.parametrize("md, rule, code", [
    (False, Rule.NO_METADATA, INVALID),
    (metadata(protocol_major=wire.PROTOCOL_MAJOR + 1), Rule.PROTOCOL_MAJOR, PRECONDITION),
    (metadata(hidden_size=HIDDEN + 1), Rule.METADATA_HIDDEN_SIZE, INVALID),
    (metadata(dtype=pb.DTYPE_UNSPECIFIED), Rule.METADATA_DTYPE, INVALID),
    (metadata(expected_rows=0), Rule.EXPECTED_ROWS, INVALID),
    (metadata(expected_rows=MAX_ROWS, expected_negative_rows=1), Rule.SLOT_CAPACITY, INVALID),
    (metadata(answer_start_index=7), Rule.ANSWER_START, INVALID),
])
def test_metadata_rules(validator, md, rule, code):
    r = rejected(validator, chunk(0, values=rows(1), md=md))
    assert (r.rule, r.code, r.poisons) == (rule, code, True)


def test_slot_capacity_counts_a_wider_dtype_as_fewer_rows():
    bf16_pool = ChunkValidator(HIDDEN, MAX_ROWS, MAX_ROWS * HIDDEN * 2)  # a bfloat16 pool, float32 rows
    r = rejected(bf16_pool, chunk(0, values=rows(1), md=metadata(expected_rows=MAX_ROWS // 2 + 1)))
    assert r.rule is Rule.SLOT_CAPACITY and f"{MAX_ROWS // 2} rows" in r.message


def test_header_disagreeing_with_its_payload(validator):
    msg, data = chunk(0, values=rows(2))
    r = rejected(validator, (msg, data[:-4]))
    assert (r.rule, r.code, r.poisons) == (Rule.HEADER, INVALID, True)


def test_role(validator):
    r = rejected(validator, chunk(0, values=rows(1), role=pb.ROLE_UNSPECIFIED))
    assert (r.rule, r.code) == (Rule.ROLE, INVALID)


def test_non_finite_values(validator):
    values = rows(2)
    values[1, 2] = float("nan")
    r = rejected(validator, chunk(0, values=values))
    assert (r.rule, r.code) == (Rule.NON_FINITE, INVALID) and "rows 0..1" in r.message


def test_negative_rows_never_announced(validator):
    r = rejected(validator, chunk(0, values=rows(1), role=pb.NEGATIVE))
    assert (r.rule, r.code) == (Rule.UNANNOUNCED_NEGATIVE, INVALID)


def test_row_offset(validator):
    st = epoch_after(validator, chunk(0, values=rows(2)))
    r = rejected(validator, chunk(1, values=rows(1), row_offset=3), st)
    assert (r.rule, r.code) == (Rule.ROW_OFFSET, INVALID)


def test_more_rows_than_announced(validator):
    r = rejected(validator, chunk(0, values=rows(7)))
    assert (r.rule, r.code) == (Rule.TOO_MANY_ROWS, INVALID)


def test_end_with_wrong_condition_totals(validator):
    values = rows(5)
    r = rejected(validator, chunk(0, values=values, end=end_for(values)))  # 5 of the 6 announced
    assert (r.rule, r.code) == (Rule.END_CONDITION_TOTALS, LOSS)


def test_end_with_wrong_negative_totals(validator):
    values = rows(6)
    st = epoch_after(validator, chunk(0, values=values, md=metadata(expected_negative_rows=2)))
    r = rejected(validator, chunk(1, end=end_for(values)), st)
    assert (r.rule, r.code) == (Rule.END_NEGATIVE_TOTALS, LOSS)


def test_end_with_wrong_checksum(validator):
    values = rows(6)
    end = end_for(values)
    end.crc32c ^= 1
    r = rejected(validator, chunk(0, values=values, end=end))
    assert (r.rule, r.code) == (Rule.END_CRC, LOSS)


def test_rejection_becomes_the_wire_error(validator):
    err = rejected(validator, chunk(0, values=rows(7))).error()
    assert isinstance(err, wire.WireError) and err.code == INVALID and "exceed the announced 6" in err.message


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 0x7F80), (torch.float16, 0x7C00)])
def test_all_finite_reads_exponent_bits(dtype, bits):
    finite = torch.tensor([0.0, -0.0, 1e-40, 3.0], dtype=torch.float32).to(dtype)
    assert all_finite(wire.encode_rows(finite.reshape(1, -1)), dtype)
    assert not all_finite(bits.to_bytes(2, "little") * 3, dtype)
