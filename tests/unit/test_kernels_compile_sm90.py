"""The decode step's Triton kernels compile for the H200's architecture (sm_90) on this CPU machine.

Triton's interpreter (every other CPU kernel test) runs a kernel's Python semantics, not its
compilation: a construct the compiler rejects, or an instruction ptxas refuses, shows up only on the
GPU. Here each form the served decode launches goes through Triton's whole pipeline for
``GPUTarget("cuda", 90, 32)`` (including ptxas, which Triton's NVIDIA backend ships), with the launch
option it is served with (programmatic dependent launch, `stage_ar.launch_overlap`). The test session
runs Triton's interpreter, under which ``@triton.jit`` gives interpreted functions, so the compiles
run in a child process without it (this file run as a script prints one JSON line per form).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

GEMV_BASE = dict(BLOCK_N=16, BLOCK_K=256, LOG2_BLOCK_K=8, EVEN_K=True, EVEN_N=True, NORM=False, FP8=False,
                 HAS_BIAS=False, SWIGLU=False, RESIDUAL=False, IEEE=False, FP8_MODE=0, ROPE=False, HEAD_DIM=0,
                 SPLIT_K=1, PDL=True, PRELOAD=0, AMAX_OUT=False)
_FP8_IN = {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
_W8A8_IN = _FP8_IN | {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32"}
_SPLIT = {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}
_AMAX = {"amax_ptr": "*i32", "amax_cnt_ptr": "*i32"}  # W8A8's RowsWithAmax (producer and consumer)
#: delayed activation scales (`stage_ar.fp8_activations.DelayedRows` / `DelayedOut`, opt-in experiment)
_DELAYED = {"amax_ptr": "*i32", "dq_ptr": "*fp8e4nv", "ds_ptr": "*i32", "dpo_ptr": "*fp32", "dpi_ptr": "*fp32",
            "roll_ptr": "*i32"}
#: name -> (pointer dtypes other than bf16, constexprs over GEMV_BASE): the served forms
GEMV_FORMS = {
    "bf16_qkv_rope": ({}, dict(HAS_BIAS=True, ROPE=True, HEAD_DIM=128)),
    "bf16_gate_up_swiglu": ({}, dict(SWIGLU=True)),
    "bf16_down": ({}, {}),
    "bf16_gate_up_swiglu_early": ({}, dict(SWIGLU=True, PDL=2, PRELOAD=1)),  # `launch_overlap`'s "early"
    "w8a8_qkv_split_rope_early": (_W8A8_IN | _SPLIT, dict(FP8=True, FP8_MODE=3, SPLIT_K=7, HAS_BIAS=True, ROPE=True,
                                                          HEAD_DIM=128, PDL=2, PRELOAD=1)),
    "bf16_head_block64": ({}, dict(BLOCK_N=64)),
    "w8a16_o_split": (_FP8_IN | _SPLIT, dict(FP8=True, FP8_MODE=1, SPLIT_K=7)),
    "w8a8_gate_up_swiglu": (_W8A8_IN, dict(FP8=True, FP8_MODE=3, SWIGLU=True, BLOCK_N=64)),  # W8A8_TUNED_CONFIGS
    "w8a8_down_split_block128": (_W8A8_IN | _SPLIT, dict(FP8=True, FP8_MODE=3, SPLIT_K=4, RESIDUAL=True, BLOCK_N=128)),
    "w8a8_gate_up_swiglu_amax_out": (_W8A8_IN | _AMAX, dict(FP8=True, FP8_MODE=3, SWIGLU=True, BLOCK_N=64,
                                                             AMAX_OUT=True)),
    "w8a8_down_quantizing_split_block64": (_FP8_IN | _SPLIT | _AMAX, dict(FP8=True, FP8_MODE=4, SPLIT_K=4,
                                                                          RESIDUAL=True, BLOCK_N=64)),
    "w8a8_qkv_split_rope": (_W8A8_IN | _SPLIT, dict(FP8=True, FP8_MODE=3, SPLIT_K=7, HAS_BIAS=True, ROPE=True,
                                                    HEAD_DIM=128, BLOCK_N=64)),
    # `stage_ar.launch_overlap.PRELOAD_TILES` (opt-in): three weight tiles before the wait under "pdl"
    "w8a8_o_preload3": (_W8A8_IN, dict(FP8=True, FP8_MODE=3, RESIDUAL=True, BLOCK_N=64, PRELOAD=3)),
    "w8a8_qkv_split_rope_preload2": (_W8A8_IN | _SPLIT, dict(FP8=True, FP8_MODE=3, SPLIT_K=7, HAS_BIAS=True,
                                                             ROPE=True, HEAD_DIM=128, BLOCK_N=64, PRELOAD=2)),
    "bf16_down_preload3": ({}, dict(RESIDUAL=True, PRELOAD=3)),
    # delayed scales: o_proj (+ residual) writing gate_up's codes and the norm's sums of squares, the
    # SwiGLU GEMV reading them and writing down's codes, qkv reading them and rolling the layer's state
    "w8a8_o_delayed_quantizing": (_W8A8_IN | _DELAYED, dict(FP8=True, FP8_MODE=5, RESIDUAL=True, BLOCK_N=64,
                                                            QUANT_OUT=2)),
    "w8a8_gate_up_delayed_quantizing": (_W8A8_IN | _DELAYED, dict(FP8=True, FP8_MODE=5, SWIGLU=True, BLOCK_N=64,
                                                                  X_NORM=True, LOG2_PARTS=7, QUANT_OUT=1)),
    "w8a8_qkv_delayed_rope_roll": (_W8A8_IN | _DELAYED, dict(FP8=True, FP8_MODE=5, HAS_BIAS=True, ROPE=True,
                                                             HEAD_DIM=128, BLOCK_N=64, X_NORM=True, LOG2_PARTS=7,
                                                             ROLL=True)),
}
ATTENTION_TYPES = {"q_ptr": "*bf16", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "k_cache_ptr": "*bf16",
                   "v_cache_ptr": "*bf16", "pos_ptr": "*i64", "start_ptr": "*i64", "live_ptr": "*i1",
                   "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "scale": "fp32",
                   "amax_ptr": "*i32", "codes_ptr": "*fp8e4nv", "min_scale": "fp32"}


#: ``(NORM, RESIDUAL)`` of the W8A8 quantizer's forms: alone (o and down inputs), with the first
#: layer's norm, with a layer's residual add and norm (`stage_ar.linear.GemvLinear.norm_input`).
QUANTIZER_FORMS = ((False, False), (True, False), (True, True))


def _compile(fn, types: dict[str, str], constexprs: dict) -> str:
    """PTX of ``fn`` for sm_90, served with PDL; ``types`` of the runtime arguments (the rest ``i32``),
    ``constexprs`` over the kernel's defaults."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # a constexpr the form leaves out takes its default, as at a launch that does not pass it
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3, "launch_pdl": True})
    return compiled.asm["ptx"]


def _forms():
    """``(name, thunk)`` per form, each thunk returning the PTX."""
    import stage_ar.decode_attention as attention
    import stage_ar.fp8_activations as activations
    import stage_ar.gemv as gemv

    bf16 = {n: "*bf16" for n in gemv._gemv_kernel.arg_names if n.endswith("_ptr")} | {"eps": "fp32", "min_scale": "fp32"}
    for name, (pointers, constexprs) in GEMV_FORMS.items():
        yield f"gemv_{name}", lambda p=pointers, c=constexprs: _compile(gemv._gemv_kernel, bf16 | p, GEMV_BASE | c)
    for live in (True, False):
        yield f"split_kv_live_{live}", lambda live=live: _compile(attention._split_kernel, ATTENTION_TYPES, dict(
            GROUP=7, GROUP_PAD=16, HEAD_DIM=128, BLOCK=64, TILES=2, PDL=True, LIVE=live, EARLY_LOADS=False))
        yield f"combine_live_{live}", lambda live=live: _compile(attention._combine_kernel, ATTENTION_TYPES, dict(
            GROUP=7, GROUP_PAD=16, HEAD_DIM=128, MAX_SPLITS=128, SPLIT_KEYS=128, PDL=True, LIVE=live,
            AMAX_OUT=live, EARLY_LOADS=False))  # the pool (live rows) with W8A8's amax; EARLY_LOADS off
    for tiles in (1, 2):  # `decode_attention.EARLY_LOADS` (on): one tile per split (the default), and two
        yield f"split_kv_early_loads_tiles_{tiles}", lambda tiles=tiles: _compile(
            attention._split_kernel, ATTENTION_TYPES, dict(GROUP=7, GROUP_PAD=16, HEAD_DIM=128, BLOCK=64, TILES=tiles,
                                                           PDL=1, LIVE=True, EARLY_LOADS=True))
    yield "combine_early_loads", lambda: _compile(attention._combine_kernel, ATTENTION_TYPES, dict(
        GROUP=7, GROUP_PAD=16, HEAD_DIM=128, MAX_SPLITS=128, SPLIT_KEYS=64, PDL=1, LIVE=True, AMAX_OUT=True,
        EARLY_LOADS=True))
    # `decode_attention.MERGE_CHUNK` (opt-in): the served pool's 256 split slots merged 16 at a time
    yield "combine_early_loads_merge_chunk_16", lambda: _compile(attention._combine_kernel, ATTENTION_TYPES, dict(
        GROUP=7, GROUP_PAD=16, HEAD_DIM=128, MAX_SPLITS=256, SPLIT_KEYS=64, PDL=1, LIVE=True, AMAX_OUT=True,
        EARLY_LOADS=True, CHUNK=16))
    # delayed activation scales (opt-in experiment): the combine writes o_proj's codes
    yield "combine_early_loads_delayed_quantizing", lambda: _compile(attention._combine_kernel, ATTENTION_TYPES, dict(
        GROUP=7, GROUP_PAD=16, HEAD_DIM=128, MAX_SPLITS=256, SPLIT_KEYS=64, PDL=1, LIVE=True, EARLY_LOADS=True,
        QUANT_OUT=True))
    for norm, residual in QUANTIZER_FORMS:
        yield f"w8a8_quantizer_norm_{norm}_residual_{residual}", lambda norm=norm, residual=residual: _compile(
            activations._quantize_rows_kernel, {
                "x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                "sum_ptr": "*bf16", "min_scale": "fp32", "eps": "fp32"},
            dict(FP8_MAX_=448.0, ROW_BLOCK=4096, CHUNK=1024, NORM=norm, RESIDUAL=residual, NORM_BLOCK_=1024,
                 LOG2_NORM_BLOCK=10, PDL=True, ONE_PASS=norm))  # a hidden-size row: the one-pass form


def _loads_before_wait(ptx: str) -> int:
    """Global loads (``ld.global``, ``cp.async``) the PTX issues before its first ``griddepcontrol.wait``
    (-1 without a wait)."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if wait is None:
        return -1
    return sum(("ld.global" in line or "cp.async" in line) for line in lines[:wait])


def _main() -> None:
    for name, thunk in _forms():
        try:
            ptx = thunk()
            print(json.dumps({"form": name, "ok": True, "pdl": "griddepcontrol.wait" in ptx
                              and "griddepcontrol.launch_dependents" in ptx, "wgmma": "wgmma" in ptx,
                              "e4m3_cvt": "cvt.rn.satfinite.e4m3x2.f32" in ptx,
                              "loads_before_wait": _loads_before_wait(ptx),
                              # `_round_e4m3`'s 1.5 * 2^23 (the interpreter's emulated rounding)
                              "e4m3_emulated": "0f4B400000" in ptx}), flush=True)
        except FileNotFoundError as exc:  # a triton without its NVIDIA toolchain
            print(json.dumps({"form": name, "ok": None, "error": repr(exc)}), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            print(json.dumps({"form": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)


@pytest.fixture(scope="module")
def compiled() -> dict:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    results = {r["form"]: r for r in map(json.loads, done.stdout.splitlines()) if r}
    assert done.returncode == 0 and results, done.stderr[-3000:]
    return results


def _names() -> list[str]:
    names = [f"gemv_{n}" for n in GEMV_FORMS]
    names += [f"{k}_live_{live}" for live in (True, False) for k in ("split_kv", "combine")]
    names += ["split_kv_early_loads_tiles_1", "split_kv_early_loads_tiles_2", "combine_early_loads",
              "combine_early_loads_merge_chunk_16", "combine_early_loads_delayed_quantizing"]
    return names + [f"w8a8_quantizer_norm_{norm}_residual_{residual}" for norm, residual in QUANTIZER_FORMS]


@pytest.mark.parametrize("form", _names())
def test_served_kernel_form_compiles_for_sm90_with_pdl(compiled, form):
    result = compiled[form]
    if result["ok"] is None:
        pytest.skip(f"needs CUDA's ptxas (Triton's NVIDIA backend): {result['error']}")
    assert result["ok"], result["error"]
    assert result["pdl"], "griddepcontrol.wait / launch_dependents missing from the PTX"
    if form.startswith("gemv_w8a8"):  # W8A8_TUNED_CONFIGS: 64/128-column blocks, Hopper's wgmma
        assert result["wgmma"] == (GEMV_FORMS[form[5:]][1].get("BLOCK_N", 16) >= 64), form
    if form.startswith("gemv_"):  # weight loads before the PDL wait exactly where tiles are preloaded
        assert (result["loads_before_wait"] > 0) == (GEMV_FORMS[form[5:]][1].get("PRELOAD", 0) > 0), result
    if form.startswith(("split_kv", "combine")):  # `decode_attention.EARLY_LOADS`: its loads before the wait
        assert (result["loads_before_wait"] > 0) == ("early_loads" in form), result
    quantizes = form.startswith("w8a8_quantizer") or "quantizing" in form
    if quantizes:  # E4M3 codes by the GPU's conversion, not the interpreter's float32 emulation
        assert result["e4m3_cvt"] and not result["e4m3_emulated"], result


if __name__ == "__main__":
    _main()
