"""Hidden-state rows <-> chunk payload codec (the ``mammoth.v1`` hidden-state stream).

A payload is the raw little-endian bytes of a ``[rows, hidden]`` tensor: ``rows * hidden *
itemsize`` bytes, no upcast, no pickle. bfloat16 and float16 travel as their 16-bit patterns, so
every value (NaN payloads, ±inf, ±0, subnormals, bfloat16 values above the float16 range) arrives
bit-exact. Only the dtypes of `ALLOWED_DTYPES` are accepted.

Every check of `validate_header` runs on the header and the payload *length* before anything is
allocated, so a hostile header (huge shape, wrong length, unknown dtype) costs nothing. Violations
raise `WireError` carrying the gRPC status the receiver answers with.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import google_crc32c as _crc32c
import grpc
import numpy as np
import torch

from mammoth_core.pb import mammoth_pb2 as pb

#: Protocol version carried in `StreamMetadata`. A receiver refuses another major version with
#: FAILED_PRECONDITION; minor versions only add fields (ignored by older receivers).
PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 0

#: proto `DType` -> torch dtype: the allow-list.
ALLOWED_DTYPES: dict[int, torch.dtype] = {
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT16: torch.float16,
    pb.FLOAT32: torch.float32,
}
_PROTO_OF: dict[torch.dtype, int] = {v: k for k, v in ALLOWED_DTYPES.items()}

#: Bytes reserved in every message for everything but the payload and the token ids (header,
#: metadata, end, reservation token, protobuf framing). Generous: real headers are ~150 bytes.
MESSAGE_OVERHEAD_BYTES = 4096
#: Upper bound of one token id in the message (a negative int64 varint takes 10 bytes + tag slack).
TOKEN_ID_BYTES = 11

_LITTLE = sys.byteorder == "little"


class WireError(Exception):
    """A chunk or stream violates the wire contract.

    Attributes:
        code: the `grpc.StatusCode` the receiver answers with (INVALID_ARGUMENT, DATA_LOSS,
            FAILED_PRECONDITION, NOT_FOUND, RESOURCE_EXHAUSTED).
        message: what was wrong, for the caller.
        reason: a ``mammoth.v1.RefusalReason`` when the code alone does not say why (sent as the
            ``google.rpc.Status`` detail, `mammoth_core.errors`); 0 otherwise.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: int = 0):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason


def _invalid(message: str) -> WireError:
    return WireError(grpc.StatusCode.INVALID_ARGUMENT, message)


def dtype_to_proto(dtype: torch.dtype) -> int:
    """The proto `DType` of an allowed torch dtype.

    Raises:
        WireError: INVALID_ARGUMENT for a dtype outside the allow-list.
    """
    try:
        return _PROTO_OF[dtype]
    except KeyError:
        raise _invalid(f"dtype {dtype} is not allowed on the wire (bfloat16, float16, float32)") from None


def dtype_from_proto(value: int) -> torch.dtype:
    """The torch dtype of a proto `DType` value.

    Raises:
        WireError: INVALID_ARGUMENT for DTYPE_UNSPECIFIED or an unknown value.
    """
    try:
        return ALLOWED_DTYPES[int(value)]
    except (KeyError, TypeError, ValueError):
        raise _invalid(f"dtype {value!r} is not allowed (BFLOAT16, FLOAT16, FLOAT32)") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


_ITEMSIZE: dict[torch.dtype, int] = {}


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC-32C (Castagnoli polynomial 0x1EDC6F41, RFC 3720) of ``data`` continuing from ``value``;
    unsigned 32-bit: the checksum of `StreamEnd`. ``crc32c(b"123456789") == 0xE3069283``.

    Computed by google-crc32c (SSE4.2 / ARMv8 CRC instructions: several times the speed of
    zlib's CRC-32 here). ``data`` is any C-contiguous buffer; a writable one (a staging block) is
    read in place, without a copy.
    """
    if type(data) is not bytes:
        view = memoryview(data)
        if not view.nbytes:
            return value & 0xFFFFFFFF
        if not view.c_contiguous:
            raise ValueError("crc32c needs a contiguous buffer")
        view = view.cast("B")
        # google-crc32c takes only buffers without a release hook (bytes, ctypes arrays): a ctypes
        # array over the same memory, no copy. ``keep`` holds the buffer export during the call.
        if not view.readonly:
            data = (ctypes.c_char * view.nbytes).from_buffer(view)
        else:
            keep = np.frombuffer(view, dtype=np.uint8)
            data = (ctypes.c_char * view.nbytes).from_address(keep.ctypes.data)
    return _crc32c.extend(value & 0xFFFFFFFF, data)


def rows_per_message(hidden_size: int, dtype: torch.dtype, max_message_bytes: int, chunk_rows: int) -> int:
    """Rows one message may carry: ``chunk_rows``, lowered so the message stays within
    ``max_message_bytes`` (payload + token ids + `MESSAGE_OVERHEAD_BYTES`).

    Raises:
        ValueError: not even one row fits in ``max_message_bytes``.
    """
    per_row = hidden_size * itemsize(dtype) + TOKEN_ID_BYTES
    fit = (max_message_bytes - MESSAGE_OVERHEAD_BYTES) // per_row
    if fit < 1:
        raise ValueError(
            f"one row of {hidden_size} x {dtype} does not fit in max_message_bytes={max_message_bytes}"
        )
    return max(1, min(int(chunk_rows), int(fit)))


def tensor_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous CPU tensor's storage (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def encode_rows(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of ``t`` (`torch.Tensor` of shape ``(rows, hidden)``, an allowed dtype).

    Tensors on an accelerator are copied to the host first (blocking); the hot path of the sender
    stages rows itself and calls `encode_staged`. Returns ``rows * hidden * itemsize`` bytes.

    Raises:
        WireError: INVALID_ARGUMENT for a dtype outside the allow-list or a tensor that is not 2-D.
    """
    dtype_to_proto(t.dtype)
    if t.dim() != 2:
        raise _invalid(f"hidden states must be [rows, hidden], got shape {tuple(t.shape)}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return encode_staged(t.contiguous())


def encode_staged(t: torch.Tensor) -> bytes:
    """Bytes of a contiguous CPU tensor, little-endian (no dtype or shape checks)."""
    raw = tensor_bytes_view(t).numpy()
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        raw = raw.view(f"u{t.element_size()}").byteswap().view(np.uint8)
    return raw.tobytes()


def staged_buffer(t: torch.Tensor) -> memoryview | bytes:
    """A zero-copy little-endian byte view of a contiguous CPU tensor (bytes on big-endian hosts);
    valid while ``t`` is alive and unchanged."""
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        return encode_staged(t)
    return memoryview(tensor_bytes_view(t).numpy())


def copy_payload(data: bytes | memoryview, out: torch.Tensor) -> None:
    """Copy payload bytes into ``out`` (a contiguous CPU tensor of exactly ``len(data)`` bytes),
    converting from little-endian on big-endian hosts. One memcpy, no intermediate buffer."""
    src = np.frombuffer(data, dtype=np.uint8)
    dst = tensor_bytes_view(out).numpy()
    if src.size != dst.size:
        raise _invalid(f"payload has {src.size} bytes, destination {dst.size}")
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        src = src.view(f"<u{out.element_size()}").astype(f"=u{out.element_size()}").view(np.uint8)
    np.copyto(dst, src)


@dataclass(frozen=True)
class RowsInfo:
    """What a validated chunk header describes."""

    rows: int
    dtype: torch.dtype
    itemsize: int
    nbytes: int


def validate_header(
    header: pb.ChunkHeader,
    data_len: int,
    *,
    hidden_size: int,
    max_rows: int,
    expected_dtype: torch.dtype | None = None,
) -> RowsInfo:
    """Check a chunk header against its payload length and the receiver's limits, allocating nothing.

    Rules: dtype allowed (and equal to ``expected_dtype`` when given); shape ``[rows, hidden]`` with
    ``hidden == hidden_size`` (an empty shape means an empty chunk); ``rows <= max_rows``;
    ``len(token_ids) == rows``; ``data_len == rows * hidden * itemsize``.

    Raises:
        WireError: INVALID_ARGUMENT naming the broken rule.
    """
    shape = list(header.shape)
    if not shape:
        if data_len or len(header.token_ids):
            raise _invalid("chunk without a shape carries data or token ids")
        dtype = expected_dtype if expected_dtype is not None else dtype_from_proto(header.dtype)
        return RowsInfo(0, dtype, itemsize(dtype), 0)
    dtype = dtype_from_proto(header.dtype)
    if expected_dtype is not None and dtype != expected_dtype:
        raise _invalid(f"chunk dtype {dtype} differs from the stream's dtype {expected_dtype}")
    if len(shape) != 2:
        raise _invalid(f"shape must be [rows, hidden], got {shape}")
    rows, hidden = int(shape[0]), int(shape[1])
    if hidden != hidden_size:
        raise _invalid(f"hidden size {hidden} differs from the receiver's {hidden_size}")
    if rows > max_rows:
        raise _invalid(f"{rows} rows exceed the limit of {max_rows}")
    if len(header.token_ids) != rows:
        raise _invalid(f"{len(header.token_ids)} token ids for {rows} rows")
    size = itemsize(dtype)
    nbytes = rows * hidden * size
    if data_len != nbytes:
        raise _invalid(f"payload has {data_len} bytes, shape {shape} of {dtype} needs {nbytes}")
    return RowsInfo(rows, dtype, size, nbytes)


def decode_rows(
    header: pb.ChunkHeader,
    data: bytes,
    *,
    hidden_size: int,
    max_rows: int,
    expected_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The rows of one chunk as a new CPU tensor of shape ``(rows, hidden_size)`` in the wire dtype.

    Validates with `validate_header` before allocating ``rows * hidden * itemsize`` bytes.

    Raises:
        WireError: INVALID_ARGUMENT for any violated rule.
    """
    info = validate_header(
        header, len(data), hidden_size=hidden_size, max_rows=max_rows, expected_dtype=expected_dtype
    )
    out = torch.empty((info.rows, hidden_size), dtype=info.dtype)
    if info.nbytes:
        copy_payload(data, out)
    return out
