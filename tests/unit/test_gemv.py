"""`stage_ar.gemv` (weight-streaming GEMV kernels for M <= 16, Triton) against `stage_ar.gemv_reference`,
and `stage_ar.fp8` (per-output-channel E4M3 weights).

Without a GPU the kernels run in Triton's CPU interpreter (`tests/conftest.py` turns it on); on a
GPU machine the same tests run compiled and add bfloat16 (`benchmarks/gemv.py` checks the Preview
shapes there). The interpreter computes ``tl.dot`` with numpy, which has no bfloat16, so the CPU
cases are float32 and float16 activations (FP8 weights included: they are widened in registers).
W8A8 (``fp8_compute="fp8"``) runs in the interpreter too: its FP8 x FP8 ``tl.dot`` is numpy's float32
matmul of the exact code values (checked: equal to torch's), and its activation pre-pass rounds to
E4M3's grid itself (the interpreter's direct float32 -> E4M3 cast misrounds binade carries).

Shapes are small on purpose (the interpreter is slow) but cross every boundary the kernel has: K
spans several K tiles and ends in a partial one, N ends in a partial column block; the RoPE variant
has heads of 8 columns (a 16-column program block spans several heads), 3 heads rotated, 2 passed
through (a fused qkv's v heads).

Tolerances (output vs the reference, which accumulates in float32 in another order): float32
``2e-5`` abs+rel; float16 ``3e-3`` (two float16 ulps near 1: the dot's rounding, then one more in
the SiLU/residual epilogue); bfloat16 ``2e-2`` (two bfloat16 ulps).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
N, K = 40, 600  # K: two full tiles of 256 and a partial one; N: 16 + 16 + 8

#: name -> which optional inputs the variant uses (how the AR uses them: qkv, o/down, gate_up, ...)
VARIANTS = {
    "plain": {},
    "bias": {"bias": True},
    "norm_bias": {"norm": True, "bias": True},
    "residual": {"residual": True},
    "norm_swiglu": {"norm": True, "swiglu": True},
    "norm": {"norm": True},
    "bias_rope": {"bias": True, "rope": True},  # the fused qkv
}
HEAD_DIM, ROPE_COLUMNS = 8, 24  # N = 40: 5 heads, the first 3 rotated


@pytest.fixture
def gemv():
    import stage_ar.gemv as module

    if not module.available(torch.device(DEVICE)):
        pytest.skip("triton cannot run here (no CUDA, interpreter off)")
    return module


def make_inputs(variant, dtype, fp8=False, m=16, n=N, k=K, seed=0):
    """Activations ``(m, k)`` and the keyword arguments of `gemv` for ``variant``."""
    from stage_ar.fp8 import quantize_fp8_per_channel

    use = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if use.get("swiglu") else n
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = (torch.randn(rows, k, generator=g) / k**0.5).to(dtype)
    kwargs = {}
    if fp8:
        weight, kwargs["weight_scale"] = quantize_fp8_per_channel(weight)
    if use.get("bias"):
        kwargs["bias"] = torch.randn(rows, generator=g).to(dtype)
    if use.get("norm"):
        x = x * 3.0  # the norm must really rescale
        kwargs["norm_weight"] = (1.0 + 0.1 * torch.randn(k, generator=g)).to(dtype)
        kwargs["norm_eps"] = 1e-6
    if use.get("residual"):
        kwargs["residual"] = torch.randn(m, n, generator=g).to(dtype)
    if use.get("swiglu"):
        kwargs["swiglu"] = True
    if use.get("rope"):
        kwargs["cos"], kwargs["sin"] = rope_tables(torch.arange(m) * 7 + 3, dtype)
        kwargs["rope_columns"] = ROPE_COLUMNS
    to_device = {key: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
    return x.to(DEVICE), weight.to(DEVICE), to_device


def rope_tables(positions: torch.Tensor, dtype: torch.dtype, head_dim: int = HEAD_DIM):
    """``(cos, sin)`` ``(len(positions), head_dim)`` in ``dtype``: the model's own rotary embedding."""
    from types import SimpleNamespace

    from stage_ar.modeling_mammoth_ar import MammothRotaryEmbedding

    rotary = MammothRotaryEmbedding(SimpleNamespace(head_dim=head_dim, rope_theta=10000.0))
    cos, sin = rotary(positions[None], dtype)
    return cos[0], sin[0]


def row_slice(kwargs: dict, lo: int, hi: int) -> dict:
    """``kwargs`` with its per-row tensors (residual, cos, sin) cut to rows ``[lo, hi)``."""
    return kwargs | {key: kwargs[key][lo:hi] for key in ("residual", "cos", "sin") if key in kwargs}


@pytest.mark.parametrize("fp8", [False, True], ids=["w16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(gemv, variant, dtype, fp8):
    from stage_ar.gemv_reference import gemv_reference

    if dtype == torch.bfloat16 and gemv.INTERPRETED:
        pytest.skip("numpy (the interpreter) has no bfloat16")
    x, weight, kwargs = make_inputs(variant, dtype, fp8)
    # one fixed launch: one compile per variant on a GPU, no autotuning (the invariance test tunes)
    got = gemv.gemv(x, weight, config=gemv.GemvConfig(16, 4, 3), **kwargs)
    want = gemv_reference(x, weight, **kwargs)
    assert got.dtype == dtype and got.shape == want.shape == (16, N)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fp8", [False, True], ids=["w16", "fp8"])
@pytest.mark.parametrize("variant", ["plain", "norm_bias", "residual", "norm_swiglu", "bias_rope"])
def test_row_bits_do_not_depend_on_the_other_rows(gemv, variant, fp8):
    """Row i alone (M = 1), inside M = 5 and inside M = 16 gives the same bits (on a GPU each M
    bucket is autotuned on its own, so this also covers different tuned launches)."""
    x, weight, kwargs = make_inputs(variant, torch.float16, fp8, seed=1)
    full = gemv.gemv(x, weight, **kwargs)

    def rows(lo, hi):
        return gemv.gemv(x[lo:hi], weight, **row_slice(kwargs, lo, hi))

    for i in (0, 7, 15):
        assert torch.equal(rows(i, i + 1)[0], full[i]), f"row {i} alone"
    assert torch.equal(rows(3, 8), full[3:8]), "rows 3..7 as M = 5"


@pytest.mark.parametrize("fp8", [False, True], ids=["w16", "fp8"])
@pytest.mark.parametrize("variant", ["norm_bias", "norm_swiglu"])
def test_norm_in_the_prologue_matches_and_is_batch_invariant(gemv, variant, fp8):
    """The alternative launch (every program normalises its tiles) keeps the numerics and the bits per row."""
    from stage_ar.gemv_reference import gemv_reference

    x, weight, kwargs = make_inputs(variant, torch.float16, fp8, seed=5)
    full = gemv.gemv(x, weight, norm_in_prologue=True, **kwargs)
    tol = TOL[torch.float16]
    torch.testing.assert_close(full.float(), gemv_reference(x, weight, **kwargs).float(), atol=tol, rtol=tol)
    assert torch.equal(gemv.gemv(x[4:5], weight, norm_in_prologue=True, **kwargs)[0], full[4])


@pytest.mark.parametrize("fp8", [False, True], ids=["w16", "fp8"])
@pytest.mark.parametrize("variant", ["plain", "norm_bias", "residual", "norm_swiglu", "bias_rope"])
def test_split_k_matches_and_keeps_row_bits(gemv, variant, fp8):
    """Split-K launches (2 and 3 K ranges over K = 600's three tiles; 4: one range left empty) match the
    reference, give a row alone the bits of the row inside M = 16 (the last program adds the partials
    in split order, whichever arrives last), and leave every arrival counter at zero for the next launch."""
    from stage_ar.gemv_reference import gemv_reference

    x, weight, kwargs = make_inputs(variant, torch.float16, fp8, seed=6)
    want = gemv_reference(x, weight, **kwargs).float()
    tol = TOL[torch.float16]
    for split in (2, 3, 4):
        config = gemv.GemvConfig(16, 4, 3, split_k=split)
        full = gemv.gemv(x, weight, config=config, **kwargs)
        torch.testing.assert_close(full.float(), want, atol=tol, rtol=tol)
        for i in (0, 11):
            assert torch.equal(gemv.gemv(x[i : i + 1], weight, config=config, **row_slice(kwargs, i, i + 1))[0],
                               full[i]), f"split {split}: row {i} alone"
        assert torch.equal(gemv.gemv(x, weight, config=config, **kwargs), full), f"split {split}: second launch"
        _, counters = gemv.split_workspace(weight, split, N, False)
        assert int(counters.abs().sum()) == 0, f"split {split}: counters left {counters.tolist()}"


def test_split_k_rule_and_bad_counts(gemv):
    """The split count is a function of the shape alone, at least 1; a config asking for 0 is refused."""
    from stage_ar.gemv_configs import split_k_for

    for n, k in ((4608, 3584), (3584, 18944), (18944, 3584), (40, 600)):
        for dtype in (torch.bfloat16, gemv.FP8_DTYPE):
            assert split_k_for(n, k, dtype) >= 1
    x, weight, _ = make_inputs("plain", torch.float16)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        gemv.gemv(x, weight, config=gemv.GemvConfig(16, 4, 1, split_k=-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_split_k_replays_in_a_cuda_graph(gemv):
    """A captured split launch replays with fresh inputs: the counters it resets and the partials it
    keeps live at addresses the graph holds (`stage_ar.gemv.split_workspace`)."""
    x, weight, kwargs = make_inputs("residual", torch.float16, True, seed=8)
    config = gemv.GemvConfig(16, 4, 3, split_k=3)
    static_x = x.clone()
    gemv.gemv(static_x, weight, config=config, **kwargs)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.gemv(static_x, weight, config=config, **kwargs)
    for seed in (1, 2, 3):
        fresh = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype).to(DEVICE)
        static_x.copy_(fresh)
        graph.replay()
        assert torch.equal(out, gemv.gemv(fresh, weight, config=config, **kwargs)), f"replay {seed}"


def exact_inputs(dtype, rows: int, m: int = 16, seed: int = 4):
    """Activations, weight and bias whose every dot product is exact in float32 whatever the order
    (small integers times eighths) and representable in float16: the linear output has the same
    bits in every launch, so what differs between two paths is their epilogue alone."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (m, K), generator=g).to(dtype)
    weight = (torch.randint(-2, 3, (rows, K), generator=g) / 8).to(dtype)
    bias = (torch.randint(-8, 9, (rows,), generator=g) / 4).to(dtype)
    return x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rope_epilogue_gives_the_bits_of_the_eager_rope(gemv, dtype):
    """The fused qkv launch (q and k heads rotated in the epilogue, v passed through) gives the bits of
    the model's unfused path: the plain GEMV, then `stage_ar.layers.rope_qkv` (each product and the
    sum rounded to the activation dtype). Inputs with exact dot products, so only the epilogues differ.
    Bit for bit in the interpreter; compiled, within one rounding of a product and one of the result
    (the compiler contracts a product and the sum into a fused multiply-add, which skips one rounding)."""
    from stage_ar.layers import rope_qkv

    heads, kv_heads = 2, 1  # q 16 + k 8 rotated columns, v 8, one more pass-through head: N = 40
    x, weight, bias = exact_inputs(dtype, N)
    cos, sin = (t.to(DEVICE) for t in rope_tables(torch.arange(16) * 11 + 5, dtype))
    fused = gemv.gemv(x, weight, bias=bias, cos=cos, sin=sin, rope_columns=(heads + kv_heads) * HEAD_DIM)
    plain = gemv.gemv(x, weight, bias=bias)
    qkv = plain[:, : (heads + 2 * kv_heads) * HEAD_DIM]
    q, k, v = rope_qkv(qkv[:, None], cos[:, None], sin[:, None], heads, kv_heads)
    eager = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), plain[:, qkv.shape[1]:]], dim=1)
    assert not torch.equal(fused, plain)  # it did rotate
    if gemv.INTERPRETED:
        assert torch.equal(fused, eager)
    else:  # compiled, a product and the sum may become one FMA, which skips the product's rounding: off
        # by at most one rounding of a product (|product| <= the row's largest |input|, |cos|, |sin| <= 1)
        # plus one of the result (H200: a few outputs one ulp apart)
        eps = torch.finfo(dtype).eps
        bound = eps * (plain.float().abs().amax(dim=1, keepdim=True) + eager.float().abs())
        assert ((fused.float() - eager.float()).abs() <= bound).all()


@pytest.mark.parametrize("split", [1, 3], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("form", ["w16", "fp8", "w8a8"])
def test_a_paired_launch_sums_as_the_plain_launch(gemv, form, split):
    """A paired launch (the RoPE and SwiGLU forms: each program's one weight tile holds its pairs'
    first rows, then their partners') computes every output's dot sums as the plain launch does: the
    RoPE form with nothing to rotate (``rope_columns=0``: every pair passes through) gives the plain
    launch's bits, for each candidate configuration autotuning may pick (compiled: every
    `tuned_configs` candidate; the interpreter: its one launch), with and without a split."""
    from stage_ar.gemv_configs import tuned_configs

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    x, weight, kwargs = make_inputs("bias", dtype, fp8=form != "w16", n=192, k=768, seed=16)
    if form == "w8a8":
        kwargs["fp8_compute"] = "fp8"
    cos, sin = (t.to(DEVICE) for t in rope_tables(torch.arange(16) * 3 + 1, dtype, 64))
    configs = [gemv.INTERPRETER_CONFIG] if gemv.INTERPRETED else tuned_configs(weight.dtype, kwargs.get("fp8_compute"))
    for c in configs:
        c = gemv.GemvConfig(c.block_n, c.num_warps, c.num_stages, None, split)
        plain = gemv.gemv(x, weight, config=c, **kwargs)
        paired = gemv.gemv(x, weight, config=c, cos=cos, sin=sin, rope_columns=0, **kwargs)
        assert torch.equal(paired, plain), c


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_swiglu_epilogue_matches_the_eager_silu_and_mul(gemv, dtype):
    """The fused gate/up launch against the model's unfused path (the plain GEMV, then
    `stage_ar.layers.silu_and_mul`), exact dot products: they differ only by the exponential's
    implementation inside SiLU (at most one ulp of the activation dtype)."""
    from stage_ar.layers import silu_and_mul

    x, weight, _ = exact_inputs(dtype, 2 * N)
    x = x / 4  # gates in SiLU's curved range
    fused = gemv.gemv(x, weight, swiglu=True)
    eager = silu_and_mul(gemv.gemv(x, weight))
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(fused, eager, atol=ulp, rtol=ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rms_norm_rows_matches_the_model_norm(gemv, dtype):
    from stage_ar.gemv_reference import rms_norm_reference

    g = torch.Generator().manual_seed(6)
    x = (3 * torch.randn(5, 2500, generator=g)).to(dtype).to(DEVICE)  # 2500: a partial 4 x 1024 chunk group
    w = (1 + 0.1 * torch.randn(2500, generator=g)).to(dtype).to(DEVICE)
    got = gemv.rms_norm_rows(x, w, 1e-6)
    torch.testing.assert_close(got.float(), rms_norm_reference(x, w, 1e-6).float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(gemv.rms_norm_rows(x[2:3], w, 1e-6)[0], got[2])


@pytest.mark.parametrize("variant", ["plain", "norm_swiglu", "bias_rope"])
def test_tuned_parameters_do_not_change_bits(gemv, variant):
    """The column block width (what autotuning picks, with warps and stages) leaves every output bit
    as it is: the reduction order of a row is fixed by the K tile alone. GPU only: the interpreter's
    numpy matmul orders its sums by the matrix shapes, the GPU's MMA instructions do not."""
    if gemv.INTERPRETED:
        pytest.skip("needs CUDA: numpy's matmul (the interpreter's tl.dot) sums in a shape-dependent order")
    x, weight, kwargs = make_inputs(variant, torch.float16, seed=2)
    a = gemv.gemv(x, weight, config=gemv.GemvConfig(block_n=16, num_warps=4, num_stages=3), **kwargs)
    b = gemv.gemv(x, weight, config=gemv.GemvConfig(block_n=32, num_warps=8, num_stages=4), **kwargs)
    assert torch.equal(a, b)


@pytest.mark.parametrize("compute", ["float16", "float16_bits"])
@pytest.mark.parametrize("variant", ["plain", "norm_bias", "norm_swiglu", "residual"])
def test_fp8_float16_compute_gives_the_same_bits(gemv, variant, compute):
    """The float16 computes (codes widened to float16 by the hardware conversion, or by integer bit
    operations to ``code * 2^-8`` with ``2^8`` folded into the scale; activations to float16) form the
    same products as widening to the activation dtype: same bits, bfloat16 on a GPU (float16 in the
    interpreter); a row alone equals the row inside the batch; float32 activations are refused."""
    from stage_ar.gemv_reference import gemv_reference

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    x, weight, kwargs = make_inputs(variant, dtype, fp8=True, seed=8)
    config = gemv.GemvConfig(16, 4, 3)
    fast = gemv.gemv(x, weight, config=config, fp8_compute=compute, **kwargs)
    assert torch.equal(fast, gemv.gemv(x, weight, config=config, fp8_compute="activation", **kwargs))
    want = gemv_reference(x, weight, **kwargs).float()
    torch.testing.assert_close(fast.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(gemv.gemv(x[2:3], weight, config=config, fp8_compute=compute, **row_slice(kwargs, 2, 3))[0],
                       fast[2])
    x32, w32, kw32 = make_inputs("plain", torch.float32, fp8=True)
    with pytest.raises(ValueError, match="fp8_compute"):
        gemv.gemv(x32, w32, fp8_compute=compute, **kw32)
    with pytest.raises(ValueError, match="fp8_compute"):
        gemv.gemv(x, weight, fp8_compute="e5m2", **kwargs)


@pytest.mark.parametrize("compute", ["float16", "float16_bits"])
def test_fp8_float16_widening_is_exact_for_every_code(gemv, compute):
    """Every finite E4M3 code (normals, subnormals, both zeros, +-448) comes out of the float16 widenings
    as its exact value: weight row n holds code n in column 0, the activation picks column 0."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN encodings
    weight = torch.zeros(256, 16, dtype=torch.uint8)
    weight[:, 0] = codes
    weight = weight.view(gemv.FP8_DTYPE).to(DEVICE)
    scale = torch.ones(256, dtype=torch.float32, device=DEVICE)
    x = torch.zeros(1, 16, dtype=torch.float16, device=DEVICE)
    x[0, 0] = 1.0
    got = gemv.gemv(x, weight, weight_scale=scale, fp8_compute=compute, config=gemv.GemvConfig(16, 4, 1))
    assert torch.equal(got[0].float(), weight[:, 0].float())


def test_fp8_float16_compute_saturates_activations(gemv):
    """Activations beyond float16's range are clamped to +-65504 (no inf/NaN): the same output as
    clamped inputs computed by widening to the activation dtype."""
    x, weight, kwargs = make_inputs("plain", torch.float32, fp8=True, seed=3)
    x = x.to(torch.float16 if gemv.INTERPRETED else torch.bfloat16)
    if not gemv.INTERPRETED:
        x[0, :3] = torch.tensor([1e5, -3e5, 7e4])
    big = gemv.gemv(x, weight, fp8_compute="float16_bits", config=gemv.GemvConfig(16, 4, 1), **kwargs)
    assert torch.isfinite(big).all()
    clamped = x.float().clamp(-65504, 65504)
    if gemv.INTERPRETED:
        assert torch.equal(big, gemv.gemv(clamped.to(x.dtype), weight, fp8_compute="activation",
                                          config=gemv.GemvConfig(16, 4, 1), **kwargs))
    else:  # bfloat16 cannot hold 65504 (it rounds to 65536): compare with the float32 chain of the clamped rows
        from stage_ar.gemv_reference import gemv_reference

        tol = TOL[torch.bfloat16]
        want = gemv_reference(clamped, weight, **kwargs)
        torch.testing.assert_close(big.float(), want, atol=tol, rtol=tol)
        unclamped = gemv_reference(x.float(), weight, **kwargs)
        assert not torch.allclose(big.float()[0], unclamped[0], atol=tol, rtol=tol)  # row 0 really was clamped


def test_bad_inputs_are_refused_with_clear_errors(gemv):
    x, weight, _ = make_inputs("plain", torch.float16)
    w8, scale = _fp8(weight)
    cases = [
        (ValueError, "at most 16 rows", dict(x=torch.zeros(17, K, dtype=x.dtype, device=DEVICE))),
        (ValueError, "2-D", dict(x=x[0])),
        (ValueError, "columns", dict(weight=weight[:, :-1].contiguous())),
        (TypeError, "dtype", dict(weight=weight.float())),
        (TypeError, "dtype", dict(x=x.to(torch.int32))),
        (ValueError, "contiguous", dict(weight=weight.t().contiguous().t())),
        (ValueError, "weight_scale", dict(weight=w8)),
        (ValueError, "weight_scale", dict(weight_scale=scale)),
        (ValueError, "weight_scale", dict(weight=w8, weight_scale=scale[:-1])),
        (TypeError, "weight_scale", dict(weight=w8, weight_scale=scale.double())),
        (ValueError, "bias", dict(bias=torch.zeros(N + 1, dtype=x.dtype, device=DEVICE))),
        (ValueError, "residual", dict(residual=torch.zeros(16, N + 1, dtype=x.dtype, device=DEVICE))),
        (ValueError, "norm_weight", dict(norm_weight=torch.ones(K - 1, dtype=x.dtype, device=DEVICE))),
        (ValueError, "swiglu", dict(weight=weight[:-1].contiguous(), swiglu=True)),
    ]
    cos, sin = (t.to(DEVICE) for t in rope_tables(torch.arange(16), x.dtype))
    rope = dict(cos=cos, sin=sin, rope_columns=ROPE_COLUMNS)
    cases += [
        (ValueError, "cos and sin together", dict(cos=cos)),
        (ValueError, "without cos and sin", dict(rope_columns=8)),
        (TypeError, "cos dtype", rope | dict(cos=cos.float())),
        (ValueError, "sin must have shape", rope | dict(sin=sin[:3])),
        (ValueError, "even head_dim", rope | dict(cos=cos[:, :5].contiguous(), sin=sin[:, :5].contiguous())),
        (ValueError, "rope_columns", rope | dict(rope_columns=12)),
        (ValueError, "rope_columns", rope | dict(rope_columns=N + 8)),
        (ValueError, "does not combine", rope | dict(residual=torch.zeros(16, N, dtype=x.dtype, device=DEVICE))),
    ]
    for error, match, change in cases:
        args = {"x": x, "weight": weight} | change
        with pytest.raises(error, match=match):
            gemv.gemv(args.pop("x"), args.pop("weight"), **args)


def _fp8(weight):
    from stage_ar.fp8 import quantize_fp8_per_channel

    return quantize_fp8_per_channel(weight)


def test_fp8_round_trip_error_is_within_e4m3_rounding():
    """Every weight comes back within half an E4M3 step: 2^-4 relative (3 mantissa bits) in the
    normal range, 2^-10 of the row scale among subnormals; each row's largest magnitude maps to 448."""
    from stage_ar.fp8 import FP8_MAX, dequantize_fp8_per_channel, quantize_fp8_per_channel

    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 300, generator=g) * torch.logspace(-4, 2, 24).unsqueeze(1)  # rows of very different size
    w[5] = 0.0  # an all-zero row gets a finite scale and comes back as zeros
    w[6, ::7] = 1e-9 * w[6, ::7]  # tiny entries beside large ones (subnormal range)
    for dtype in (torch.float32, torch.bfloat16):
        wd = w.to(dtype)
        w8, scale = quantize_fp8_per_channel(wd)
        assert w8.dtype == torch.float8_e4m3fn and w8.shape == wd.shape
        assert scale.dtype == torch.float32 and scale.shape == (24,) and torch.isfinite(scale).all()
        back = dequantize_fp8_per_channel(w8, scale, torch.float32)
        ref = wd.float()
        bound = 2.0**-4 * ref.abs() + 2.0**-10 * scale[:, None] + 1e-6 * ref.abs()
        assert ((back - ref).abs() <= bound).all()
        nonzero = ref.abs().amax(1) > 0
        assert torch.equal(w8.float().abs().amax(1)[nonzero], torch.full((23,), FP8_MAX))
        assert torch.equal(back[5], torch.zeros(300))


def test_fp8_a_row_of_tiny_weights_gets_a_positive_scale_and_finite_codes():
    """A float32 row whose largest magnitude is positive but tiny (1e-44, a subnormal): ``amax / 448``
    underflows to 0, which gave the row scale 0 and NaN codes (break-it pass, 2026-12-07). The scale is
    floored at float32's smallest normal number, so the codes are finite and the row comes back within
    ``2^-10`` of that floor."""
    from stage_ar.fp8 import dequantize_fp8_per_channel, quantize_fp8_per_channel

    w = torch.tensor([[1e-44, -5e-45, 0.0, 3e-45], [1.0, -2.0, 0.5, 448.0], [1e-30, 0.0, -1e-31, 0.0]])
    w8, scale = quantize_fp8_per_channel(w)
    assert torch.isfinite(w8.float()).all() and (scale > 0).all(), (w8.float(), scale)
    assert scale[0] == torch.finfo(torch.float32).tiny
    assert torch.equal(scale[1:], w[1:].abs().amax(1) / 448)  # rows above the floor as before
    back = dequantize_fp8_per_channel(w8, scale, torch.float32)
    assert ((back - w).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * scale[:, None]).all()


def test_fp8_values_on_the_grid_round_trip_exactly():
    from stage_ar.fp8 import dequantize_fp8_per_channel, quantize_fp8_per_channel

    g = torch.Generator().manual_seed(4)
    codes = (torch.randn(8, 64, generator=g) * 50).clamp(-440, 440).to(torch.float8_e4m3fn)
    codes[:, 0] = 448.0
    row_scale = 2.0 ** torch.arange(-6, 2, dtype=torch.float32)
    w = codes.float() * row_scale[:, None]
    w8, scale = quantize_fp8_per_channel(w)
    assert torch.equal(scale, row_scale)
    assert torch.equal(w8.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(dequantize_fp8_per_channel(w8, scale, torch.float32), w)


def test_fp8_converter_refuses_bad_inputs():
    from stage_ar.fp8 import dequantize_fp8_per_channel, quantize_fp8_per_channel

    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_per_channel(torch.ones(4))
    with pytest.raises(TypeError, match="floating"):
        quantize_fp8_per_channel(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="already"):
        quantize_fp8_per_channel(torch.ones(4, 4).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="finite"):
        quantize_fp8_per_channel(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="scale"):
        dequantize_fp8_per_channel(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.ones(3), torch.float32)


# --- W8A8 (fp8_compute="fp8"): per-row E4M3 activations (stage_ar.fp8_activations), FP8 x FP8 dots ---

#: Row 1's values over its scale (2^-3: the row's amax is 56), and the E4M3 value each must become:
#: exact midpoints round to the even neighbour, some carrying into the next binade, subnormals too.
QUANT_CASES = [(448.0, 448.0), (1.0625, 1.0), (1.1875, 1.25), (3.875, 4.0), (7.75, 8.0), (15.5, 16.0),
               (31.0, 32.0), (-124.0, -128.0), (2.0**-10, 0.0), (3 * 2.0**-10, 2.0**-8), (-5 * 2.0**-10, -2.0**-8)]


def _rows_to_quantize(dtype, m=16, k=K, seed=11):
    """``(m, k)`` rows spanning magnitudes 1e-3..1e3 (each row its own), a zero row (2), and row 1
    starting with `QUANT_CASES` (below its amax of 56 = 448 * 2^-3, so its scale is exactly 2^-3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[1] = x[1].clamp(-40.0, 40.0)
    x[1, : len(QUANT_CASES)] = torch.tensor([v for v, _ in QUANT_CASES]) * 0.125
    x[2] = 0.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantize_rows_matches_the_reference_bit_for_bit(gemv, dtype):
    """Scales and E4M3 codes equal the torch reference's exactly (round to nearest even, incl. carries
    into the next binade, subnormals, a zero row -> MIN_ROW_SCALE and zero codes)."""
    from stage_ar.fp8_activations import MIN_ROW_SCALE, quantize_rows
    from stage_ar.gemv_reference import quantize_rows_reference

    if dtype == torch.bfloat16 and gemv.INTERPRETED:
        pytest.skip("numpy (the interpreter) has no bfloat16")
    x = _rows_to_quantize(dtype)
    codes, scales = quantize_rows(x)
    want_codes, want_scales = quantize_rows_reference(x)
    assert codes.dtype == gemv.FP8_DTYPE and codes.shape == x.shape and scales.dtype == torch.float32
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert scales[2] == MIN_ROW_SCALE and not codes[2].view(torch.uint8).any()
    assert scales[1] == 0.125 and codes[1, : len(QUANT_CASES)].float().tolist() == [q for _, q in QUANT_CASES]
    assert codes.float().abs().amax(dim=1)[[0, 1, 3, 15]].eq(448.0).all()  # each row's amax maps to 448


def test_quantize_rows_chunks_of_a_wide_row_share_its_scale(gemv):
    """Rows wider than one program's chunk (2,500 columns: three chunks, the last partial) get the
    reference's scale and codes in every chunk, wherever the row's largest value sits; rows wider than
    `MAX_COLUMNS` are refused before any work."""
    from stage_ar.fp8_activations import MAX_COLUMNS, QUANT_BLOCK, quantize_rows
    from stage_ar.gemv_reference import quantize_rows_reference

    k = 2 * QUANT_BLOCK + 452
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(21))
    x[0, k - 3] = 40.0  # amax in the last, partial chunk
    x[1, 5] = -40.0  # in the first
    x = x.to(torch.float16).to(DEVICE)
    codes, scales = quantize_rows(x)
    want_codes, want_scales = quantize_rows_reference(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    with pytest.raises(ValueError, match="at most"):
        quantize_rows(torch.zeros(1, MAX_COLUMNS + 1, dtype=torch.float16, device=DEVICE))


def test_quantize_rows_row_alone_equals_row_in_a_batch(gemv):
    """A row's scale and codes come from the row alone: bit-equal at M = 1 and inside M = 16."""
    from stage_ar.fp8_activations import quantize_rows

    x = _rows_to_quantize(torch.float16, seed=12)
    codes, scales = quantize_rows(x)
    for i in (0, 1, 9, 15):
        c1, s1 = quantize_rows(x[i : i + 1])
        assert torch.equal(s1[0], scales[i]) and torch.equal(c1[0].view(torch.uint8), codes[i].view(torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(x[0])
    with pytest.raises(TypeError, match="activations"):
        quantize_rows(x.to(torch.int32))


@pytest.mark.parametrize("k", [K, 2 * 1024 + 452, 4 * 1024 + 100], ids=lambda k: f"K{k}")
def test_quantize_rows_with_the_norm_is_the_norm_then_the_quantizer(gemv, k):
    """``quantize_rows(x, norm_weight)`` (one launch) gives the bits of `rms_norm_rows` followed by
    `quantize_rows`: scales and codes equal, for rows narrower than a norm chunk, spanning chunks and
    spanning more than one 4-chunk iteration; a wrong-shaped norm weight is refused."""
    from stage_ar.fp8_activations import quantize_rows

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(31)
    x = (torch.randn(5, k, generator=g) * torch.logspace(-2, 2, 5)[:, None]).to(dtype).to(DEVICE)
    x[2] = 0.0
    w = (1.0 + 0.5 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    codes, scales = quantize_rows(x, w, 1e-5)
    want_codes, want_scales = quantize_rows(gemv.rms_norm_rows(x, w, 1e-5))
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert not torch.equal(scales, quantize_rows(x)[1])  # the norm really ran
    with pytest.raises(ValueError, match="norm_weight"):
        quantize_rows(x, w[:-1])


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_quantize_rows_one_pass_norm_gives_the_bits_of_the_three_pass_form(gemv, residual, monkeypatch):
    """A row of the hidden size (3,584 columns: four norm chunks) is normalised and quantized from one
    load of the row, its residual and the norm weight (``ONE_PASS``), with the bits of the general
    form (the row read for its sum of squares, again for the amax, again for the chunk): codes,
    scales and the summed residual stream equal, and that launch really took the one-pass form."""
    from stage_ar import fp8_activations
    from stage_ar.fp8_activations import quantize_rows

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(35)
    k = 3584
    x = (torch.randn(3, k, generator=g) * torch.logspace(-2, 2, 3)[:, None]).to(dtype).to(DEVICE)
    r = (torch.randn(3, k, generator=g) * 3.0).to(dtype).to(DEVICE) if residual else None
    w = (1.0 + 0.5 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    forms = []
    real = fp8_activations._quantize_rows_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                forms.append(kwargs["ONE_PASS"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(fp8_activations, "_quantize_rows_kernel", Recording())
    one_pass = quantize_rows(x, w, 1e-5, residual=r)
    monkeypatch.setattr(fp8_activations, "ONE_PASS_NORM", False)
    three_pass = quantize_rows(x, w, 1e-5, residual=r)
    assert forms == [True, False]
    for got, want in zip(one_pass, three_pass):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("k", [K, 4 * 1024 + 100], ids=lambda k: f"K{k}")
def test_quantize_rows_with_a_residual_is_the_add_then_the_norm_then_the_quantizer(gemv, k, norm):
    """``quantize_rows(x, norm_weight, residual=r)`` (one launch: the W8A8 layer's add + norm +
    quantizer) returns torch's ``x + r`` as the new residual stream, bit for bit, and the codes and
    scales of `rms_norm_rows` (or nothing) on that sum followed by `quantize_rows`; the add really
    ran (the codes differ from those of ``x`` alone); a residual of another shape or dtype is refused."""
    from stage_ar.fp8_activations import MIN_ROW_SCALE, quantize_rows

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(33)
    x = (torch.randn(4, k, generator=g) * torch.logspace(-2, 2, 4)[:, None]).to(dtype).to(DEVICE)
    r = (torch.randn(4, k, generator=g) * 3.0).to(dtype).to(DEVICE)
    r[1] = -x[1]  # a row that sums to zero: MIN_ROW_SCALE, zero codes
    w = (1.0 + 0.5 * torch.randn(k, generator=g)).to(dtype).to(DEVICE) if norm else None
    codes, scales, summed = quantize_rows(x, w, 1e-5, residual=r)
    assert summed.dtype == dtype and torch.equal(summed, x + r)
    want_codes, want_scales = quantize_rows(gemv.rms_norm_rows(x + r, w, 1e-5) if norm else x + r)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert not codes[1].float().any() and scales[1] == MIN_ROW_SCALE
    alone = quantize_rows(x, w, 1e-5)[0] if norm else quantize_rows(x)[0]
    assert not torch.equal(codes.view(torch.uint8), alone.view(torch.uint8))
    with pytest.raises(ValueError, match="residual"):
        quantize_rows(x, w, residual=r[:, :-1])
    with pytest.raises(TypeError, match="residual"):
        quantize_rows(x, w, residual=r.float())


@pytest.mark.parametrize("split", [1, 3], ids=lambda s: f"split{s}")
def test_w8a8_rows_with_amax_are_quantized_in_the_consumers_prologue(gemv, split):
    """The W8A8 MLP without the quantizer's launch between its GEMVs: the SwiGLU launch with
    ``amax_out`` stores the bits it stores without, and leaves each row's largest magnitude (float32
    bits) in the buffer; the ``down`` launch on `RowsWithAmax` gives the bits of `quantize_rows` then
    the W8A8 launch (with a residual, split or not), leaves the amax and its arrival counter at
    zero for the next step, and does so again on a second round; a row alone gets its bits inside
    M = 16. Refused: bf16 weights, a norm, RoPE with ``amax_out``, a buffer of the wrong dtype."""
    from stage_ar.fp8 import quantize_fp8_per_channel
    from stage_ar.fp8_activations import RowsWithAmax, amax_buffers

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    x, w_gu, kw_gu = make_inputs("norm_swiglu", dtype, fp8=True, seed=17)
    kw_gu.pop("norm_weight"), kw_gu.pop("norm_eps")
    g = torch.Generator().manual_seed(18)
    w_down, s_down = quantize_fp8_per_channel((torch.randn(24, N, generator=g) / N**0.5).to(dtype))
    w_down, s_down = w_down.to(DEVICE), s_down.to(DEVICE)
    residual = torch.randn(16, 24, generator=g).to(dtype).to(DEVICE)
    config = gemv.GemvConfig(16, 4, 3, split_k=split)
    amax, counter = amax_buffers(w_down)
    assert not amax.any() and not counter.any()
    for _ in range(2):
        hidden = gemv.gemv(x, w_gu, fp8_compute="fp8", amax_out=amax, config=config, **kw_gu)
        assert torch.equal(hidden, gemv.gemv(x, w_gu, fp8_compute="fp8", config=config, **kw_gu))
        assert torch.equal(amax.view(torch.float32), hidden.float().abs().amax(dim=1))
        got = gemv.gemv(RowsWithAmax(hidden, amax, counter), w_down, weight_scale=s_down, residual=residual,
                        config=config)
        want = gemv.gemv(hidden, w_down, weight_scale=s_down, residual=residual, fp8_compute="fp8", config=config)
        assert torch.equal(got, want)
        assert not amax.any() and not counter.any()
    one = gemv.gemv(x[5:6], w_gu, fp8_compute="fp8", amax_out=amax, config=config, **kw_gu)
    alone = gemv.gemv(RowsWithAmax(one, amax, counter), w_down, weight_scale=s_down, residual=residual[5:6],
                      config=config)
    assert torch.equal(alone[0], got[5])
    with pytest.raises(ValueError, match="E4M3 weights"):
        gemv.gemv(RowsWithAmax(hidden, amax, counter), w_down.to(dtype))
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.gemv(RowsWithAmax(hidden, amax, counter), w_down, weight_scale=s_down,
                  norm_weight=torch.ones(N, dtype=dtype, device=DEVICE))
    with pytest.raises(TypeError, match="amax_out"):
        gemv.gemv(x, w_gu, fp8_compute="fp8", amax_out=amax.float(), **kw_gu)
    cos, sin = (t.to(DEVICE) for t in rope_tables(torch.arange(16), dtype))
    with pytest.raises(ValueError, match="RoPE"):
        gemv.gemv(x, x.new_zeros(N, K), amax_out=amax, cos=cos, sin=sin, rope_columns=HEAD_DIM)


def test_w8a8_autotuned_launches_read_the_amax_their_producer_left(gemv):
    """Autotuning (the default launch on CUDA) times each candidate by running it, and a launch on
    `RowsWithAmax` sets the amax it read back to zero: unless the buffer is restored between timing
    runs, the launch that counts reads zeros (every code saturated at the floor scale). On shapes no
    other test launches (so the autotuner times them here), the autotuned MLP gives the bits of
    `quantize_rows` then the W8A8 launch, and leaves the amax at zero. (The interpreter takes one
    fixed launch: there this is the plain equality.)"""
    from stage_ar.fp8 import quantize_fp8_per_channel
    from stage_ar.fp8_activations import RowsWithAmax, amax_buffers

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(23)
    inner, out = 40, 56  # SwiGLU columns, down's columns: launched by this test only
    x = torch.randn(16, K, generator=g).to(dtype).to(DEVICE)
    w_gu, s_gu = (t.to(DEVICE) for t in quantize_fp8_per_channel((torch.randn(2 * inner, K, generator=g) / K**0.5).to(dtype)))
    w_down, s_down = (t.to(DEVICE) for t in quantize_fp8_per_channel((torch.randn(out, inner, generator=g) / inner**0.5).to(dtype)))
    amax, counter = amax_buffers(w_down)
    hidden = gemv.gemv(x, w_gu, weight_scale=s_gu, swiglu=True, fp8_compute="fp8", amax_out=amax)
    assert torch.equal(amax.view(torch.float32), hidden.float().abs().amax(dim=1))
    got = gemv.gemv(RowsWithAmax(hidden, amax, counter), w_down, weight_scale=s_down)
    want = gemv.gemv(hidden, w_down, weight_scale=s_down, fp8_compute="fp8")
    assert torch.equal(got, want), (got - want).abs().max()
    assert not amax.any() and not counter.any()


def test_w8a8_normalised_projection_runs_no_separate_norm(gemv, monkeypatch):
    """A W8A8 GEMV with ``norm_weight`` folds the norm into its quantizer: `rms_norm_rows` is not
    called (its launch was the third of such a projection), and the result is the one of the norm
    run first."""
    x, weight, kwargs = make_inputs("norm_swiglu", torch.float16 if gemv.INTERPRETED else torch.bfloat16,
                                    fp8=True, seed=15)
    normed = gemv.rms_norm_rows(x, kwargs["norm_weight"], kwargs.get("norm_eps", 1e-6))
    want = gemv.gemv(normed, weight, fp8_compute="fp8", **{a: b for a, b in kwargs.items() if a != "norm_weight"})

    def no_separate_norm(*args, **kw):
        raise AssertionError("rms_norm_rows launched for a W8A8 projection")

    monkeypatch.setattr(gemv, "rms_norm_rows", no_separate_norm)
    assert torch.equal(gemv.gemv(x, weight, fp8_compute="fp8", **kwargs), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["plain", "bias", "norm_swiglu", "residual", "bias_rope"])
def test_w8a8_matches_its_reference(gemv, variant, dtype):
    """The FP8 x FP8 launch equals `gemv_reference(..., fp8_compute="fp8")` to the dot's summation order
    (float32 activations too: W8A8 takes them), and really quantizes the activations (it is off
    W8A16's result by far more than that tolerance)."""
    from stage_ar.gemv_reference import gemv_reference

    if dtype == torch.bfloat16 and gemv.INTERPRETED:
        pytest.skip("numpy (the interpreter) has no bfloat16")
    x, weight, kwargs = make_inputs(variant, dtype, fp8=True, seed=13)
    x[3] = 0.0  # an all-zero row: MIN_ROW_SCALE, zero codes, finite output
    got = gemv.gemv(x, weight, config=gemv.GemvConfig(16, 4, 3), fp8_compute="fp8", **kwargs)
    want = gemv_reference(x, weight, fp8_compute="fp8", **kwargs)
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    w8a16 = gemv_reference(x, weight, **kwargs).float()
    assert (want.float() - w8a16).abs().max() > 2 * TOL[dtype]  # beyond the launch's own tolerance


@pytest.mark.parametrize("variant", ["plain", "norm_swiglu", "bias_rope"])
def test_w8a8_row_bits_do_not_depend_on_the_other_rows(gemv, variant):
    """W8A8 keeps batch invariance: row i alone equals row i of the 16-row batch, bit for bit
    (autotuned on a GPU: the first call of the shape fixes the launch for every M)."""
    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    x, weight, kwargs = make_inputs(variant, dtype, fp8=True, seed=14)
    full = gemv.gemv(x, weight, fp8_compute="fp8", **kwargs)
    for i in (0, 7, 15):
        assert torch.equal(gemv.gemv(x[i : i + 1], weight, fp8_compute="fp8", **row_slice(kwargs, i, i + 1))[0],
                           full[i]), f"row {i} alone"


def candidate_inputs(variant: str, fp8: bool, seed: int):
    """`make_inputs` at a Preview-width K (3,584) with 256 output columns; ``bias_rope`` with 128-wide
    RoPE heads (one rotated head). For the candidate-set tests."""
    x, weight, kwargs = make_inputs(variant, torch.bfloat16, fp8=fp8, n=256, k=3584, seed=seed)
    if variant == "bias_rope":
        cos, sin = rope_tables(torch.arange(16) * 7 + 3, torch.bfloat16, 128)
        kwargs |= {"cos": cos.to(DEVICE), "sin": sin.to(DEVICE), "rope_columns": 128}
    return x, weight, kwargs


@pytest.mark.parametrize("variant", ["plain", "norm_swiglu", "residual", "bias_rope"])
def test_bf16_candidates_give_the_same_bits(gemv, variant):
    """Every launch bf16 autotuning may pick (`TUNED_CONFIGS`: 16/32-column ``mma.sync`` and 64-column
    ``wgmma`` blocks, every pipeline depth) gives the bits of every other and matches the reference:
    which candidate a process's timing picks changes no output. GPU only (the interpreter's numpy
    dot orders sums by shape)."""
    from stage_ar.gemv_configs import TUNED_CONFIGS
    from stage_ar.gemv_reference import gemv_reference

    if gemv.INTERPRETED:
        pytest.skip("needs CUDA: numpy's matmul (the interpreter's tl.dot) sums in a shape-dependent order")
    x, weight, kwargs = candidate_inputs(variant, fp8=False, seed=16)
    want = gemv_reference(x, weight, **kwargs).float()
    outs = {c: gemv.gemv(x, weight, config=c, **kwargs) for c in TUNED_CONFIGS
            if gemv.fits_shared_memory(c, torch.bfloat16, torch.bfloat16)}
    first = next(iter(outs.values()))
    torch.testing.assert_close(first.float(), want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    for c, out in outs.items():
        assert torch.equal(out, first), c


@pytest.mark.parametrize("variant", ["plain", "norm_swiglu", "residual", "bias_rope"])
def test_w8a8_candidates_give_the_same_bits(gemv, variant):
    """Every launch W8A8 autotuning may pick (`W8A8_TUNED_CONFIGS`, 64- and 128-column ``wgmma``
    blocks) gives the bits of every other, with and without a split, and matches the reference: a
    process's pick changes no output. GPU only (the interpreter's numpy dot orders sums by shape)."""
    from stage_ar.gemv_configs import W8A8_TUNED_CONFIGS, split_k_for
    from stage_ar.gemv_reference import gemv_reference

    if gemv.INTERPRETED:
        pytest.skip("needs CUDA: numpy's matmul (the interpreter's tl.dot) sums in a shape-dependent order")
    x, weight, kwargs = candidate_inputs(variant, fp8=True, seed=15)
    want = gemv_reference(x, weight, fp8_compute="fp8", **kwargs).float()
    for split in (1, 2, 7):
        outs = {}
        for c in W8A8_TUNED_CONFIGS:
            c = gemv.GemvConfig(c.block_n, c.num_warps, c.num_stages, None, split)
            if gemv.fits_shared_memory(c, gemv.FP8_DTYPE, gemv.FP8_DTYPE):
                outs[c] = gemv.gemv(x, weight, config=c, fp8_compute="fp8", **kwargs)
        first = next(iter(outs.values()))
        torch.testing.assert_close(first.float(), want, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
        for c, out in outs.items():
            assert torch.equal(out, first), (split, c)
    assert split_k_for(256, 3584, gemv.FP8_DTYPE, "fp8") >= 1


def test_forget_tuning_makes_the_next_launch_tune_at_its_own_row_count(gemv):
    """`forget_tuning` (benchmarks that time batch 1 and the padded served shape in one process):
    every pick is dropped and the next launch of the shape tunes again, at its own M, with the same
    bits as before (every candidate gives the same). GPU only (the interpreter does not autotune:
    there the call is a no-op and says so)."""
    if gemv.INTERPRETED:
        assert gemv.forget_tuning() == 0
        pytest.skip("needs CUDA: the interpreter launches one fixed configuration, nothing is tuned")
    x, weight, kwargs = candidate_inputs("residual", fp8=False, seed=17)
    first = gemv.gemv(x, weight, **kwargs)
    tuner = gemv._TUNERS[gemv.tuned_configs(weight.dtype, None)]
    assert len(tuner.cache) >= 1
    assert gemv.forget_tuning() >= 1 and not any(t.cache for t in gemv._TUNERS.values())
    again = gemv.gemv(x[:1], weight, **(kwargs | {"residual": kwargs["residual"][:1]}))
    assert len(tuner.cache) == 1 and torch.equal(again[0], first[0])


@pytest.mark.parametrize("form", ["plain", "residual", "swiglu", "rope", "w8a8", "w8a8_quantized_rows"])
def test_rows_computes_the_first_rows_with_the_same_bits_and_leaves_the_rest(form):
    """``rows`` (the runner's ``trim_gemv_rows``): the first ``rows`` rows are the bits of the launch
    that computes every row, whatever the epilogue or W8A8 input; the output keeps its M rows; the
    rest is not written (here: the NaN the output was poisoned with stays)."""
    from stage_ar import gemv as G
    from stage_ar.fp8 import FP8_DTYPE
    from stage_ar.fp8_activations import QuantizedRows, quantize_rows

    g = torch.Generator().manual_seed(11)
    m, k, n, head = 6, 64, 32, 8
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(2 * n if form == "swiglu" else n, k, generator=g) / 8).to(torch.bfloat16).to(DEVICE)
    kw: dict = {}
    if form == "residual":
        kw["residual"] = torch.randn(m, n, generator=g).to(torch.bfloat16).to(DEVICE)
    elif form == "swiglu":
        kw["swiglu"] = True
    elif form == "rope":
        angles = torch.rand(m, head // 2, generator=g) * 3
        kw.update(cos=torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16).to(DEVICE),
                  sin=torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16).to(DEVICE), rope_columns=n)
    elif form.startswith("w8a8"):
        w = w.float().to(FP8_DTYPE)
        kw.update(weight_scale=(torch.rand(n, generator=g) + 0.5).to(DEVICE), fp8_compute="fp8")
        if form == "w8a8_quantized_rows":
            x = QuantizedRows(*quantize_rows(x), torch.bfloat16, x.shape)
    real_empty = torch.empty

    def poisoned(*shape, **opts):  # the output (and any other buffer) comes back full of NaN
        t = real_empty(*shape, **opts)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    every = G.gemv(x, w, **kw)
    try:
        torch.empty = poisoned
        some = G.gemv(x, w, rows=2, **kw)
    finally:
        torch.empty = real_empty
    assert some.shape == every.shape
    assert torch.equal(some[:2], every[:2])
    assert bool(some[2:].isnan().all())
    assert torch.equal(G.gemv(x, w, rows=m + 3, **kw), every)  # rows past M: all of them
    with pytest.raises(ValueError, match="rows must be at least 1"):
        G.gemv(x, w, rows=0, **kw)
