"""`benchmarks/gemv_fp8_cuda_core.fp8_gemv_cuda_core` (FP8 weights, CUDA-core GEMV, Triton) on tiny shapes.

Without a GPU the kernel runs in Triton's CPU interpreter (`tests/conftest.py` turns it on before
triton is imported); on a GPU machine the same cases run compiled. Shapes cross every boundary the
kernel has: K ends in a partial K tile (and, unrolled, in a wholly masked second tile), N in a
partial row block; launches cover ``unroll`` 1 and 2, ``prefetch`` and ``late_reduce``.

Checked: the output against the float32 reference ``x @ (w.float() * scale).T + bias`` (float32
activations: ``1e-5`` of the largest output; float16: one float16 ulp at the largest output, the
final rounding), and batch invariance: rows 0, 6 and 15 launched alone, rows 3..7 as M = 5 and the
first 2, 4 and 8 rows as M = 2, 4, 8 equal their rows of the M = 16 launch bit for bit.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

pytest.importorskip("triton")

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # appended: benchmarks/ must not shadow other tests' top-level modules
    sys.path.append(str(BENCHMARKS))

import gemv_fp8_cuda_core as cc  # noqa: E402

from stage_ar.fp8 import quantize_fp8_per_channel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: K = 200: three 64-column tiles and a partial one (unroll 2: the last iteration's second tile is
#: partial); K = 96 with 32-column tiles, unroll 2: the second iteration's second tile is wholly past K.
#: N = 40, 24 and 20: a partial last row block of 16 or 8 rows, except 8-row blocks at N = 24 (no N mask).
LAUNCHES = {
    "bn16-bk64": (200, 40, cc.CCConfig(16, 64, 4)),
    "bn8-bk64-u2-bias": (200, 24, cc.CCConfig(8, 64, 2, unroll=2)),
    "bn16-bk32-u2": (96, 24, cc.CCConfig(16, 32, 2, unroll=2)),
    "bn16-bk64-pf-bias": (200, 24, cc.CCConfig(16, 64, 2, prefetch=True)),
    "bn8-bk32-u2-pf": (96, 20, cc.CCConfig(8, 32, 4, unroll=2, prefetch=True)),
    "bn16-bk64-late-bias": (200, 24, cc.CCConfig(16, 64, 2, late_reduce=True)),
    "bn8-bk32-u2-late": (96, 20, cc.CCConfig(8, 32, 2, unroll=2, late_reduce=True)),
}


def _inputs(k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w8, scale = quantize_fp8_per_channel(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(16, k, generator=g).to(dtype)
    b = (0.1 * torch.randn(n, generator=g)).to(dtype) if bias else None
    return x.to(DEVICE), w8.to(DEVICE), scale.to(DEVICE), None if b is None else b.to(DEVICE)


#: every launch with float32 activations, two with float16 (the interpreter is slow: ~2 s a case)
CASES = [(name, torch.float32) for name in LAUNCHES] + [(name, torch.float16) for name in ("bn16-bk64", "bn8-bk32-u2-pf")]


@pytest.mark.parametrize(("name", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_matches_reference_and_is_batch_invariant(name, dtype):
    k, n, cfg = LAUNCHES[name]
    x, w8, scale, bias = _inputs(k, n, dtype, bias=name.endswith("bias"))
    tol = 1e-5 if dtype == torch.float32 else 2.0**-10
    rec = cc.check_launch(x, w8, scale, bias, cfg, tol=tol, alone_rows=(0, 6, 15))
    assert rec["rel_max_err_M16"] <= tol and rec["rel_max_err_M1"] <= tol, rec
    assert rec["rows_alone_equal"] and rec["slice_equal"], rec
    assert rec["ok"]
    out = cc.fp8_gemv_cuda_core(x[:3], w8, scale, bias, **cfg.kwargs())
    assert out.shape == (3, n) and out.dtype == dtype


def test_rejects_bad_arguments():
    x, w8, scale, _ = _inputs(64, 16, torch.float32, bias=False)
    cfg = cc.CCConfig(16, 32, 2).kwargs()
    with pytest.raises(ValueError):
        cc.fp8_gemv_cuda_core(torch.cat([x, x]), w8, scale, **cfg)  # M = 32 > 16
    with pytest.raises(ValueError):
        cc.fp8_gemv_cuda_core(x, w8.float(), scale, **cfg)  # not FP8
    with pytest.raises(ValueError):
        cc.fp8_gemv_cuda_core(x, w8, scale, **(cfg | {"block_k": 48}))  # not a power of two
    with pytest.raises(ValueError):
        cc.fp8_gemv_cuda_core(x, w8, scale, **(cfg | {"unroll": 3}))
