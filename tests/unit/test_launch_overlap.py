"""`stage_ar.launch_overlap`: programmatic dependent launch (PDL) of the decode kernels.

On CPU (Triton's interpreter) the flag is off and the kernels run as before (every other kernel
test covers that). On a GPU of compute capability 9.0 or more: the compiled kernels carry the grid
dependency control, and a chain of decode kernels launched with them gives the bits
of serial launches, eagerly and replayed from a CUDA graph (the case that would show a kernel reading
its input before the previous kernel wrote it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from stage_ar import launch_overlap  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs CUDA with compute capability >= 9.0 (PDL)")


def test_off_cuda_no_flags_are_set():
    assert launch_overlap.pdl_enabled(torch.device("cpu")) is False
    assert launch_overlap.launch_options(False) == {}


def test_an_unknown_mode_is_refused_at_import():
    env = dict(os.environ, **{launch_overlap.MODE_ENV: "sometimes"})
    done = subprocess.run([sys.executable, "-c", "import stage_ar.launch_overlap"], env=env, capture_output=True,
                          text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode != 0
    assert "MAMMOTH_AR_LAUNCH_OVERLAP must be one of ('off', 'pdl', 'early'), got 'sometimes'" in done.stderr


@needs_hopper
@pytest.mark.parametrize("mode", ["off", "pdl", "early"])
def test_compiled_gemv_carries_what_its_mode_asks_for(monkeypatch, mode):
    from stage_ar import gemv

    monkeypatch.setattr(launch_overlap, "MODE", mode)
    for weight_dtype, rows, k in ((torch.bfloat16, 4608, 3584), (torch.float8_e4m3fn, 4608, 3584)):
        ptx = gemv.compile_ahead(torch.bfloat16, weight_dtype, rows, k, gemv.GemvConfig(16, 4, 3), bias=True,
                                 rope_head_dim=128).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == (mode != "off"), (mode, weight_dtype)
        assert ("griddepcontrol.launch_dependents" in ptx) == (mode != "off"), (mode, weight_dtype)
        if mode == "early":  # the next launch is allowed before this kernel's wait
            assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait"), weight_dtype


def _decode_chain(x, weights, cache, pos, start):
    """One layer's worth of decode kernels in their order: qkv GEMV (bias, RoPE epilogue), split-KV
    attention (the KV write fused), o GEMV (FP8 split-K), the W8A8 quantizer and a W8A8 gate/up
    GEMV with SwiGLU, the down GEMV (residual); every output kept."""
    from stage_ar import gemv
    from stage_ar.decode_attention import decode_attention

    config = gemv.GemvConfig(16, 4, 3)
    (w_qkv, b_qkv), (w_o, s_o), (w_gu, s_gu), w_down = weights
    cos, sin = cache["rope"]
    qkv = gemv.gemv(x, w_qkv, bias=b_qkv, cos=cos, sin=sin, rope_columns=(28 + 4) * 128, config=config)
    q = qkv[:, : 28 * 128].view(-1, 28, 128)
    k = qkv[:, 28 * 128 : 32 * 128].view(-1, 4, 128)
    v = qkv[:, 32 * 128 :].view(-1, 4, 128)
    attn = decode_attention(q, k, v, cache["k"], cache["v"], pos, start, 512, 128**-0.5)
    o = gemv.gemv(attn, w_o, weight_scale=s_o, config=config)
    gu = gemv.gemv(o, w_gu, weight_scale=s_gu, swiglu=True, fp8_compute="fp8", config=config)
    down = gemv.gemv(gu, w_down, residual=o, config=config)
    return qkv, attn, o, gu, down


@needs_hopper
@pytest.mark.parametrize("overlap_mode", ["pdl", "early"])
def test_a_chain_launched_with_pdl_gives_the_bits_of_serial_launches(monkeypatch, overlap_mode):
    from stage_ar.fp8 import quantize_fp8_per_channel

    g = torch.Generator(device="cuda").manual_seed(3)
    hidden, inter = 3584, 2048
    dev, bf = "cuda", torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf)

    weights = (
        (rand(4608, hidden, scale=hidden**-0.5), rand(4608)),
        quantize_fp8_per_channel(rand(hidden, 28 * 128, scale=hidden**-0.5)),
        quantize_fp8_per_channel(rand(2 * inter, hidden, scale=hidden**-0.5)),
        rand(hidden, inter, scale=inter**-0.5),
    )
    rows = 4
    pos = torch.tensor([5, 130, 300, 511], device=dev)
    start = torch.zeros(rows, dtype=torch.long, device=dev)
    angles = pos[:, None].float() * torch.linspace(0.01, 1.0, 64, device=dev)[None]
    rope = (torch.cat([angles.cos()] * 2, 1).to(bf), torch.cat([angles.sin()] * 2, 1).to(bf))

    def fresh_cache():
        c = torch.Generator(device="cuda").manual_seed(9)
        kv = torch.randn(2, rows, 4, 512, 128, generator=c, device=dev).to(bf)
        return {"k": kv[0].clone(), "v": kv[1].clone(), "rope": rope}

    def run(mode, x):
        monkeypatch.setattr(launch_overlap, "MODE", mode)
        cache = fresh_cache()
        outs = _decode_chain(x, weights, cache, pos, start)
        return [t.clone() for t in outs] + [cache["k"].clone(), cache["v"].clone()]

    xs = [rand(rows, hidden) for _ in range(3)]
    for x in xs:
        serial = run("off", x)
        for mode in ("pdl", "early"):
            overlapped = run(mode, x)
            for i, (a, b) in enumerate(zip(serial, overlapped)):
                assert torch.equal(a, b), (mode, i)

    # replayed from a CUDA graph: the launches become programmatic edges
    monkeypatch.setattr(launch_overlap, "MODE", overlap_mode)
    static_x = xs[0].clone()
    cache = fresh_cache()
    _decode_chain(static_x, weights, cache, pos, start)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _decode_chain(static_x, weights, cache, pos, start)
    for x in xs:
        static_x.copy_(x)
        reset = fresh_cache()
        cache["k"].copy_(reset["k"])
        cache["v"].copy_(reset["v"])
        graph.replay()
        serial = run("off", x)
        for i, (a, b) in enumerate(zip(serial, list(outs) + [cache["k"], cache["v"]])):
            assert torch.equal(a, b), ("graph", i)


@pytest.mark.parametrize("fp8_compute", [None, "float16", "fp8"], ids=["w16", "fp8_f16", "w8a8"])
@pytest.mark.parametrize("variant", ["norm_bias", "residual", "norm_swiglu", "bias_rope"])
def test_the_preloaded_first_weight_tile_keeps_every_bit(monkeypatch, variant, fp8_compute):
    """``"early"`` loads each GEMV program's first weight tile before its wait and multiplies it first
    after: the same sums in the same order, so the bits of the loop alone, for a whole K range and for
    split-K ranges, one of them empty (K = 600: three tiles in 4 ranges of one), on the interpreter
    (where only the preload applies) and compiled."""
    from stage_ar import gemv
    from test_gemv import make_inputs

    if fp8_compute is None:
        x, weight, kwargs = make_inputs(variant, torch.float16, seed=12)
    else:
        x, weight, kwargs = make_inputs(variant, torch.float16, True, seed=12)
        kwargs["fp8_compute"] = fp8_compute
    for config in (gemv.GemvConfig(16, 4, 3), gemv.GemvConfig(16, 4, 3, split_k=2),
                   gemv.GemvConfig(16, 4, 3, split_k=4)):
        outs = {}
        for mode in ("off", "early"):
            monkeypatch.setattr(launch_overlap, "MODE", mode)
            assert launch_overlap.preload_tiles() == (1 if mode == "early" else 0)
            outs[mode] = gemv.gemv(x, weight, config=config, **kwargs)
        assert torch.equal(outs["off"], outs["early"]), config


@pytest.mark.parametrize("fp8_compute", [None, "fp8"], ids=["w16", "w8a8"])
@pytest.mark.parametrize("variant", ["norm_bias", "residual", "bias_rope"])
def test_weight_tiles_preloaded_before_the_wait_keep_every_bit(monkeypatch, variant, fp8_compute):
    """`launch_overlap.PRELOAD_TILES` 1 to 3 (under ``"pdl"``, whatever the mode) load a program's first
    tiles before its wait and multiply them first, in order, after it: the bits of 0, for a whole K
    range (K = 600: three tiles, the last partial) and for split-K ranges shorter than the preload
    (2 ranges of 2 and 1 tiles; 4 ranges of one, the last empty), where a tile past the range must
    be neither added nor read past K. On the interpreter and compiled."""
    from stage_ar import gemv
    from test_gemv import make_inputs

    if fp8_compute is None:
        x, weight, kwargs = make_inputs(variant, torch.float16, seed=13)
    else:
        x, weight, kwargs = make_inputs(variant, torch.float16, True, seed=13)
        kwargs["fp8_compute"] = fp8_compute
    monkeypatch.setattr(launch_overlap, "MODE", "pdl")
    for config in (gemv.GemvConfig(16, 4, 3), gemv.GemvConfig(16, 4, 3, split_k=2),
                   gemv.GemvConfig(16, 4, 3, split_k=4)):
        outs = {}
        for tiles in range(launch_overlap.MAX_PRELOAD_TILES + 1):
            monkeypatch.setattr(launch_overlap, "PRELOAD_TILES", tiles)
            assert launch_overlap.preload_tiles() == tiles
            outs[tiles] = gemv.gemv(x, weight, config=config, **kwargs)
        for tiles in range(1, launch_overlap.MAX_PRELOAD_TILES + 1):
            assert torch.equal(outs[0], outs[tiles]), (config, tiles)


def test_preload_tiles_outside_the_range_are_refused(monkeypatch):
    monkeypatch.setattr(launch_overlap, "PRELOAD_TILES", launch_overlap.MAX_PRELOAD_TILES + 1)
    with pytest.raises(ValueError, match="PRELOAD_TILES must be 0 to 3"):
        launch_overlap.preload_tiles()
    done = subprocess.run([sys.executable, "-c", "import stage_ar.launch_overlap"], capture_output=True, text=True,
                          env=os.environ | {launch_overlap.PRELOAD_ENV: "7"},
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode != 0
    assert "MAMMOTH_AR_PRELOAD_TILES must be 0 to 3, got 7" in done.stderr
