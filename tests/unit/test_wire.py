"""The hidden-state codec: allow-list, shape-vs-bytes rules, bit-exact 16-bit payloads."""

from __future__ import annotations

import grpc
import pytest
import torch

from mammoth_core import wire
from mammoth_core.pb import mammoth_pb2 as pb


def _header(dtype: int, rows: int, hidden: int, **kw) -> pb.ChunkHeader:
    return pb.ChunkHeader(dtype=dtype, shape=[rows, hidden], token_ids=list(range(rows)), **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern_round_trips_bit_exact(dtype):
    # All 65,536 bit patterns: NaNs with payloads, ±inf, ±0, subnormals, the largest finite values.
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).reshape(256, 256)
    t = bits.view(dtype)
    data = wire.encode_rows(t)
    assert len(data) == t.numel() * 2
    out = wire.decode_rows(
        _header(wire.dtype_to_proto(dtype), 256, 256), data, hidden_size=256, max_rows=256
    )
    assert out.dtype == dtype
    assert torch.equal(out.view(torch.int16), bits)


def test_bfloat16_values_beyond_float16_range_are_not_clipped():
    vals = torch.tensor([[1e5, -3.0e38, 3.3e38, 65520.0, 1e-39, -0.0]], dtype=torch.bfloat16)
    out = wire.decode_rows(
        _header(pb.BFLOAT16, 1, 6), wire.encode_rows(vals), hidden_size=6, max_rows=1
    )
    assert torch.equal(out.view(torch.int16), vals.view(torch.int16))
    assert out[0, 2].item() > 3e38  # would be inf after a float16 detour


def test_float32_bit_exact_and_little_endian():
    t = torch.tensor([[1.0, -2.5, float("nan"), float("-inf")]], dtype=torch.float32)
    data = wire.encode_rows(t)
    assert data[:4] == b"\x00\x00\x80\x3f"  # 1.0f little-endian
    out = wire.decode_rows(_header(pb.FLOAT32, 1, 4), data, hidden_size=4, max_rows=1)
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))


def test_encode_non_contiguous_and_empty():
    t = torch.randn(4, 6).to(torch.bfloat16)[:, ::2]
    assert wire.encode_rows(t) == wire.encode_rows(t.contiguous())
    assert wire.encode_rows(torch.empty(0, 8, dtype=torch.float16)) == b""


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8, torch.float8_e4m3fn])
def test_dtype_outside_allow_list_is_invalid_argument(dtype):
    with pytest.raises(wire.WireError) as exc:
        wire.encode_rows(torch.zeros(2, 2).to(dtype))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_encode_rejects_non_2d():
    with pytest.raises(wire.WireError):
        wire.encode_rows(torch.zeros(2, 2, 2))


@pytest.mark.parametrize(
    "header, data, why",
    [
        (_header(pb.DTYPE_UNSPECIFIED, 1, 4), b"\0" * 8, "not allowed"),
        (_header(17, 1, 4), b"\0" * 8, "not allowed"),
        (_header(pb.BFLOAT16, 1, 5), b"\0" * 10, "hidden size"),
        (_header(pb.BFLOAT16, 1, 4), b"\0" * 9, "bytes"),
        (_header(pb.BFLOAT16, 9, 4), b"\0" * 72, "exceed"),
        (pb.ChunkHeader(dtype=pb.BFLOAT16, shape=[2, 4], token_ids=[1]), b"\0" * 16, "token ids"),
        (pb.ChunkHeader(dtype=pb.BFLOAT16, shape=[2, 4, 1], token_ids=[1, 2]), b"\0" * 16, "shape"),
        (pb.ChunkHeader(dtype=pb.BFLOAT16), b"\0" * 2, "without a shape"),
        (_header(pb.FLOAT32, 2, 4), b"\0" * 16, "bytes"),  # float16-sized payload for float32
    ],
)
def test_header_violations(header, data, why):
    with pytest.raises(wire.WireError) as exc:
        wire.decode_rows(header, data, hidden_size=4, max_rows=8)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert why in exc.value.message


def test_expected_dtype_mismatch():
    with pytest.raises(wire.WireError, match="differs from the stream"):
        wire.validate_header(
            _header(pb.FLOAT16, 1, 4), 8, hidden_size=4, max_rows=8, expected_dtype=torch.bfloat16
        )


def test_huge_shape_is_rejected_before_allocation():
    h = pb.ChunkHeader(dtype=pb.FLOAT32, shape=[2**63, 2**63], token_ids=[])
    with pytest.raises(wire.WireError):
        wire.decode_rows(h, b"", hidden_size=2**63, max_rows=2**64)


def test_empty_chunk():
    info = wire.validate_header(pb.ChunkHeader(), 0, hidden_size=4, max_rows=8, expected_dtype=torch.float16)
    assert info.rows == 0 and info.nbytes == 0


def test_rows_per_message_respects_limit():
    # 4,096 x bf16 = 8 KiB per row; 1 MiB messages leave room for 127 rows after the overhead.
    n = wire.rows_per_message(4096, torch.bfloat16, 1 << 20, chunk_rows=1024)
    assert n * (4096 * 2 + wire.TOKEN_ID_BYTES) + wire.MESSAGE_OVERHEAD_BYTES <= 1 << 20
    assert n == 127
    assert wire.rows_per_message(4096, torch.bfloat16, 1 << 26, chunk_rows=64) == 64
    with pytest.raises(ValueError):
        wire.rows_per_message(1 << 20, torch.float32, 1 << 20, chunk_rows=1)


def test_crc32c_check_value_incremental_and_in_place():
    # RFC 3720 / CRC catalogue check value of CRC-32C over "123456789".
    assert wire.crc32c(b"123456789") == 0xE3069283
    assert wire.crc32c(b"6789", wire.crc32c(b"12345")) == 0xE3069283
    # A writable staging view (read in place) and a read-only view give the same value.
    staged = torch.tensor(list(b"123456789"), dtype=torch.uint8)
    assert wire.crc32c(wire.staged_buffer(staged)) == 0xE3069283
    assert wire.crc32c(memoryview(b"123456789")) == 0xE3069283
    assert wire.crc32c(b"", 7) == 7
    assert wire.crc32c(b"a") != wire.crc32c(b"b")


def test_dtype_mapping_round_trip():
    for proto, dtype in wire.ALLOWED_DTYPES.items():
        assert wire.dtype_to_proto(dtype) == proto
        assert wire.dtype_from_proto(proto) == dtype
