"""`chunk_stream.split_chunk` (the receiver's zero-copy parse) agrees with protobuf on every message and
answers INVALID_ARGUMENT, never another exception, on malformed bytes."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mammoth_core import wire
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.chunk_stream import frame_chunk, split_chunk


def _reference(raw: bytes) -> tuple[pb.HiddenStateChunk, bytes]:
    full = pb.HiddenStateChunk.FromString(raw)
    data = full.data
    full.ClearField("data")
    return full, data


@st.composite
def chunks(draw):
    msg = pb.HiddenStateChunk(reservation_token=draw(st.text(max_size=40)))
    if draw(st.booleans()):
        msg.header.CopyFrom(pb.ChunkHeader(
            request_id=draw(st.text(max_size=20)), epoch=draw(st.integers(0, 2**32 - 1)),
            sequence=draw(st.integers(0, 2**64 - 1)), shape=draw(st.lists(st.integers(0, 2**64 - 1), max_size=3)),
            token_ids=draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8)),
            sent_unix_ms=draw(st.floats(allow_nan=False)),
        ))
    if draw(st.booleans()):
        msg.metadata.CopyFrom(pb.StreamMetadata(protocol_major=1, hidden_size=draw(st.integers(0, 2**32 - 1))))
    if draw(st.booleans()):
        msg.end.CopyFrom(pb.StreamEnd(total_rows=draw(st.integers(0, 2**64 - 1)), crc32c=draw(st.integers(0, 2**32 - 1))))
    return msg


@settings(max_examples=200, deadline=None)
@given(chunks(), st.binary(max_size=300), st.sampled_from(["framed", "serialized", "data-twice"]))
def test_split_equals_protobuf(msg, payload, layout):
    if layout == "framed":  # the sender's layout: data last
        raw = frame_chunk(msg, payload)
    elif layout == "serialized":  # protobuf's own field order (data before end)
        msg.data = payload
        raw = msg.SerializeToString()
    else:  # a repeated singular field: the last one wins
        raw = frame_chunk(msg, b"first") + frame_chunk(pb.HiddenStateChunk(), payload)
    head, data = split_chunk(raw)
    ref_head, ref_data = _reference(raw)
    assert head == ref_head
    assert bytes(data) == ref_data
    assert data.readonly
    assert wire.crc32c(data) == wire.crc32c(ref_data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_split_never_crashes_on_garbage(raw):
    try:
        head, data = split_chunk(raw)
    except wire.WireError as err:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        return
    ref_head, ref_data = _reference(raw)  # accepted: protobuf must agree
    assert head == ref_head and bytes(data) == ref_data


@pytest.mark.parametrize("raw", [b"\x00", b"\x22\x10abc", b"\x0b", b"\xff" * 12, b"\x12\x03\xff\xff\xff", b"\x09\x01"])
def test_split_rejects_malformed(raw):
    with pytest.raises(wire.WireError) as info:
        split_chunk(raw)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
