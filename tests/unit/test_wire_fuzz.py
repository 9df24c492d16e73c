"""Hostile chunk headers and payloads never crash the codec and never allocate beyond its limits."""

from __future__ import annotations

import google.protobuf.message
from hypothesis import given, settings
from hypothesis import strategies as st

from mammoth_core import wire
from mammoth_core.pb import mammoth_pb2 as pb

HIDDEN = 8
MAX_ROWS = 16

u64 = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))


@st.composite
def headers(draw):
    shape = draw(st.lists(u64, max_size=4))
    n_tokens = draw(st.one_of(st.integers(0, 40), st.sampled_from([len(shape) and shape[0] or 0])))
    n_tokens = min(n_tokens, 64)
    tokens = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n_tokens, max_size=n_tokens))
    dtype = draw(st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(-(2**31), 2**31 - 1)))
    h = pb.ChunkHeader(shape=shape, token_ids=tokens)
    h.dtype = dtype  # open enum: unknown values are kept
    return h


def _check(header: pb.ChunkHeader, data: bytes) -> None:
    try:
        out = wire.decode_rows(header, data, hidden_size=HIDDEN, max_rows=MAX_ROWS)
    except wire.WireError as exc:
        assert exc.code.name == "INVALID_ARGUMENT"
        return
    # Accepted: exactly what the header announced, within the limits, nothing more.
    assert out.shape[1] == HIDDEN and out.shape[0] <= MAX_ROWS
    assert out.shape[0] == len(header.token_ids)
    assert out.numel() * out.element_size() == len(data)
    assert out.dtype in wire.ALLOWED_DTYPES.values()


@settings(max_examples=400, deadline=None)
@given(headers(), st.binary(max_size=600))
def test_random_headers_and_payloads(header, data):
    _check(header, data)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([pb.BFLOAT16, pb.FLOAT16, pb.FLOAT32]),
    st.integers(0, MAX_ROWS + 2),
    st.integers(-3, 3),
)
def test_length_off_by_a_few_bytes(dtype, rows, delta):
    size = wire.itemsize(wire.dtype_from_proto(dtype))
    header = pb.ChunkHeader(dtype=dtype, shape=[rows, HIDDEN], token_ids=[7] * rows)
    data = b"\x01" * max(0, rows * HIDDEN * size + delta)
    _check(header, data)
    if delta == 0 and rows <= MAX_ROWS:
        out = wire.decode_rows(header, data, hidden_size=HIDDEN, max_rows=MAX_ROWS)
        assert wire.encode_rows(out) == data


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_a_chunk_message(raw):
    msg = pb.HiddenStateChunk()
    try:
        msg.ParseFromString(raw)
    except google.protobuf.message.DecodeError:
        return
    _check(msg.header, msg.data)


@settings(max_examples=100, deadline=None)
@given(st.integers(MAX_ROWS + 1, 2**64 - 1), st.sampled_from([pb.BFLOAT16, pb.FLOAT32]))
def test_huge_row_counts_rejected_without_allocation(rows, dtype):
    # A payload "matching" a huge shape cannot be built; the row bound must reject it first.
    header = pb.ChunkHeader(dtype=dtype, shape=[rows, HIDDEN])
    try:
        wire.decode_rows(header, b"", hidden_size=HIDDEN, max_rows=MAX_ROWS)
    except wire.WireError as exc:
        assert "exceed" in exc.message or "token ids" in exc.message
    else:  # pragma: no cover
        raise AssertionError("huge shape accepted")
