"""The hidden-state chunk stream on the wire: framing (AR) and parsing (DiT) of ``HiddenStateChunk``
messages, and the ``DiT.PushConditions`` method that carries them as raw bytes on both ends.

The one home of the stream's byte layout. Field numbers and the method path are read from the
generated descriptor (`mammoth_core.pb.mammoth_pb2`), never written here, so the layout follows
``proto/mammoth_core/pb/mammoth.proto`` alone.

- `frame_chunk` (sender): the message without its payload, serialised by protobuf, then the
  ``data`` field appended; the payload is copied once, from staging into the message bytes.
  Protobuf readers accept fields in any order, so every reader sees the message with ``data`` set.
- `split_chunk` (receiver): the inverse without copying the payload: ``data`` becomes a view of the
  received bytes, every other field is parsed by protobuf.
- `push_conditions_callable` / `push_conditions_handler`: the client multi-callable and the server
  handler of ``PushConditions`` with no request (de)serializer, so the framed bytes travel as they
  are (two fewer copies of every row per side than protobuf's own path).
"""

from __future__ import annotations

from typing import Any, Callable

import grpc

from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.wire import WireError

_CHUNK_FIELDS = pb.HiddenStateChunk.DESCRIPTOR.fields_by_name
#: ``HiddenStateChunk.data``'s field number, from the descriptor.
DATA_FIELD: int = _CHUNK_FIELDS["data"].number
_PUSH = pb.DESCRIPTOR.services_by_name["DiT"].methods_by_name["PushConditions"]
#: ``mammoth.v1.DiT``, the service that receives the stream.
DIT_SERVICE: str = _PUSH.containing_service.full_name
#: The method name (``PushConditions``) and its gRPC path (``/mammoth.v1.DiT/PushConditions``).
PUSH_METHOD_NAME: str = _PUSH.name
PUSH_METHOD_PATH: str = f"/{DIT_SERVICE}/{PUSH_METHOD_NAME}"

# Protobuf encoding (https://protobuf.dev/programming-guides/encoding/): a tag is
# ``field_number << 3 | wire_type``; these are the wire types, fixed by the encoding itself.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _invalid(message: str) -> WireError:
    return WireError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if not n:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


_DATA_TAG = _varint((DATA_FIELD << 3) | _LEN)  # ``data`` is a bytes field: length-delimited


def frame_chunk(msg: pb.HiddenStateChunk, payload: bytes | memoryview) -> bytes:
    """``msg`` serialised with ``payload`` (any bytes-like, C-contiguous) as its ``data`` field.

    ``msg`` must not have ``data`` set itself. The result parses (protobuf, `split_chunk`) to ``msg``
    with ``data == bytes(payload)``; it has ``len(msg.SerializeToString()) + len(payload) + 2..11``
    bytes.
    """
    return b"".join((msg.SerializeToString(), _DATA_TAG, _varint(len(payload)), payload))


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _invalid("malformed chunk message (truncated or overlong varint)")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _skip_field(buf: memoryview, wire_type: int, pos: int, end: int) -> tuple[int, int]:
    """(start of the field's value payload, position after the field) for a non-group field."""
    if wire_type == _VARINT:
        _, after = _read_varint(buf, pos, end)
        return pos, after
    if wire_type == _I64:
        return pos, pos + 8
    if wire_type == _I32:
        return pos, pos + 4
    if wire_type == _LEN:
        length, start = _read_varint(buf, pos, end)
        if length > end - start:
            raise _invalid("malformed chunk message (field longer than the message)")
        return start, start + length
    raise _invalid(f"malformed chunk message (wire type {wire_type})")


def split_chunk(raw: bytes) -> tuple[pb.HiddenStateChunk, memoryview]:
    """Parse a serialised ``HiddenStateChunk`` without copying its payload.

    Walks the top-level fields: the ``data`` field (the last one wins, as in protobuf) becomes a
    zero-copy view of ``raw``; every other field is parsed by protobuf as usual. When ``data`` is
    the last field (as `frame_chunk` lays it out) the rest is parsed in place.

    Returns:
        (the message without ``data``, the payload as a read-only ``memoryview`` of ``raw``, empty
        when absent; valid while ``raw`` is alive).

    Raises:
        WireError: INVALID_ARGUMENT for a malformed message (bad tag, wire type or length, a
            truncated field, or protobuf's own parse error).
    """
    buf = memoryview(raw).cast("B")
    end = len(buf)
    pos = 0
    data = (0, 0)
    rest: list[tuple[int, int]] = []  # (start, stop) of every field but ``data``
    while pos < end:
        start = pos
        tag, pos = _read_varint(buf, pos, end)
        field, wire_type = tag >> 3, tag & 7
        if field == 0:
            raise _invalid("malformed chunk message (field number 0)")
        value_start, pos = _skip_field(buf, wire_type, pos, end)
        if pos > end:
            raise _invalid("malformed chunk message (truncated field)")
        if field == DATA_FIELD and wire_type == _LEN:
            data = (value_start, pos)
        else:
            rest.append((start, pos))
    try:
        msg = pb.HiddenStateChunk.FromString(_joined(buf, rest))
    except Exception as exc:  # google.protobuf.message.DecodeError and friends
        raise _invalid(f"malformed chunk message ({exc})") from None
    return msg, buf[data[0] : data[1]].toreadonly()


def _joined(buf: memoryview, spans: list[tuple[int, int]]) -> bytes | memoryview:
    """The bytes of ``spans`` of ``buf``, in order: a view when they are contiguous."""
    if not spans:
        return b""
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return buf[spans[0][0] : spans[-1][1]]
    return b"".join(buf[a:b] for a, b in spans)


def push_conditions_callable(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    """``DiT.PushConditions`` on ``channel``, taking each request as the framed ``bytes`` of
    `frame_chunk` and returning a `PushConditionsResponse`."""
    return channel.stream_unary(
        PUSH_METHOD_PATH,
        request_serializer=None,
        response_deserializer=pb.PushConditionsResponse.FromString,
    )


def push_conditions_handler(behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """The server handler of ``DiT.PushConditions`` whose request iterator yields each message as
    the raw ``bytes`` gRPC received (to be parsed by `split_chunk`)."""
    return grpc.stream_unary_rpc_method_handler(
        behavior,
        request_deserializer=None,
        response_serializer=pb.PushConditionsResponse.SerializeToString,
    )
