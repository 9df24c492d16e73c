"""The GEMV epilogue fusions off vs on, side by side in one run: `stage_ar.linear.GemvLinear`'s
``fuse_epilogues`` (RoPE in the qkv launch, SwiGLU in the gate/up launch; `stage_ar.gemv`).

Run on the GPU machine from the source tree (random bf16 weights at MammothModa2-Preview
dimensions, no checkpoint; estimated at about 4 minutes on the H200, most of it the four engines'
graph capture; not yet run there):

    PYTHONPATH=. python3 benchmarks/ar_fusion.py --out "$OUT"

and on the CPU, to check this script's logic (toy shapes, the tiny fixture model, Triton's interpreter):

    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/ar_fusion.py --smoke --out /tmp/ar_fusion

Sections (``ar_fusion.json`` in --out, rewritten after each; a failing section records its error and
the others go on):
1. kernels, per decoder layer at M = 1 and 8: the qkv GEMV then the compiled ``rope_qkv`` vs the one
   RoPE-epilogue launch; the gate/up GEMV then the compiled ``silu_and_mul`` vs the one
   SwiGLU-epilogue launch. One weight copy per layer (28 at Preview size: nothing is served from L2),
   all of a path's calls in one CUDA graph, replayed: us per layer. Also fused vs unfused: max |diff|
   and the share of equal outputs (the eager ops round as the epilogue does; the compiled ones may
   keep float32 between steps), and a row alone vs the same row inside M = 8, bit for bit (fused);
2. numerics: the same teacher-forced ids (a prompt, then random visual codes) decoded one token per
   forward through the model with fusion off and on: relative error of the hidden rows, and the
   argmax agreement of the visual-code logits;
3. decode (CUDA only): `benchmarks/ar_decode.py`'s ``time_variant`` (the AR stage's engine with CUDA
   graphs, compiled pointwise ops, fused attention) for each of `VARIANTS` (none fused, RoPE only,
   SwiGLU only, both): ms/step at batch 1 (image start and mid-image) and batch 8, against the HBM
   floor (`ar_decode.floor_bytes`), in one table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from sections import run_sections  # noqa: E402 - benchmarks/sections.py
import gemv as bench_gemv  # noqa: E402 - benchmarks/gemv.py: graph_ms_per_call and its DEVICE

from stage_ar import gemv as G  # noqa: E402
from stage_ar.layers import EAGER_OPS, compiled_ops  # noqa: E402
from stage_ar.linear import GemvLinear, set_linear_backend  # noqa: E402

#: Preview attention shape: 28 query heads, 4 key/value heads of 128; hidden 3584; MLP 18944.
PREVIEW = dict(heads=28, kv_heads=4, head_dim=128, hidden=3584, inter=18944, layers=28)
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, hidden=272, inter=200, layers=2)
#: decode variants: label -> `GemvLinear`'s ``fuse_epilogues``
VARIANTS = {"unfused": False, "rope": ("rope",), "swiglu": ("swiglu",), "fused": True}


def _inputs(dims: dict, m: int, device: str, dtype: torch.dtype, seed: int = 0):
    """Activations ``(m, hidden)``, RoPE tables ``(m, head_dim)`` (positions 100, 107, ...)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, dims["hidden"], device=device, generator=g).to(dtype)
    d = dims["head_dim"]
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, device=device).float() / d)
    angles = (100 + 7 * torch.arange(m, device=device).float())[:, None] * inv
    emb = torch.cat([angles, angles], dim=-1)
    return x, emb.cos().to(dtype), emb.sin().to(dtype)


def layer_calls(dims: dict, weights: list[dict], m: int, ops, device: str, dtype: torch.dtype) -> dict:
    """name -> (a function per layer copy, for the CUDA graph; one call's ``(M, N)`` output for the
    checks)."""
    heads, kvh, d = dims["heads"], dims["kv_heads"], dims["head_dim"]
    x, cos, sin = _inputs(dims, m, device, dtype)
    rope_cols = (heads + kvh) * d

    def qkv_unfused(w):  # (q, k, v) as the forward gets them
        y = G.gemv(x, w["qkv"], bias=w["bias"])
        return ops.rope_qkv(y[:, None], cos[:, None], sin[:, None], heads, kvh)

    def qkv_fused(w):
        return G.gemv(x, w["qkv"], bias=w["bias"], cos=cos, sin=sin, rope_columns=rope_cols)

    def gate_up_unfused(w):
        return ops.silu_and_mul(G.gemv(x, w["gate_up"]))

    def gate_up_fused(w):
        return G.gemv(x, w["gate_up"], swiglu=True)

    paths = {"qkv_unfused": qkv_unfused, "qkv_fused": qkv_fused,
             "gate_up_unfused": gate_up_unfused, "gate_up_fused": gate_up_fused}
    return {name: ([lambda w=w, f=f: f(w) for w in weights], _block(f(weights[0]))) for name, f in paths.items()}


def _block(out) -> torch.Tensor:
    """One ``(M, N)`` output: q, k, v concatenated back (checks only, outside the timed calls)."""
    return torch.cat([t.flatten(2) for t in out], -1)[:, 0] if isinstance(out, tuple) else out


def kernels(res: dict, dims: dict, device: str, dtype: torch.dtype, save) -> None:
    """Section 1."""
    ops = compiled_ops() if device == "cuda" else EAGER_OPS
    qkv_rows = (dims["heads"] + 2 * dims["kv_heads"]) * dims["head_dim"]
    g = torch.Generator(device=device).manual_seed(1)
    weights = [{
        "qkv": (torch.randn(qkv_rows, dims["hidden"], device=device, generator=g) / dims["hidden"] ** 0.5).to(dtype),
        "bias": (0.1 * torch.randn(qkv_rows, device=device, generator=g)).to(dtype),
        "gate_up": (torch.randn(2 * dims["inter"], dims["hidden"], device=device, generator=g)
                    / dims["hidden"] ** 0.5).to(dtype),
    } for _ in range(dims["layers"])]
    out = res.setdefault("kernels", {})
    for m in (1, 8):
        calls = layer_calls(dims, weights, m, ops, device, dtype)
        for name, (fns, _) in calls.items():
            ms, how = bench_gemv.graph_ms_per_call(fns)
            out[f"{name}_M{m}_us"] = ms * 1e3
            out.setdefault("timed_as", how)
        for proj in ("qkv", "gate_up"):
            a, b = calls[f"{proj}_unfused"][1].float(), calls[f"{proj}_fused"][1].float()
            out[f"{proj}_M{m}_fused_vs_unfused"] = {"max_abs": float((a - b).abs().max()),
                                                   "equal_share": float((a == b).float().mean())}
            out[f"{proj}_M{m}_saved_us"] = out[f"{proj}_unfused_M{m}_us"] - out[f"{proj}_fused_M{m}_us"]
        save()
    alone = layer_calls(dims, weights, 1, ops, device, dtype)
    batch = layer_calls(dims, weights, 8, ops, device, dtype)
    out["fused_row_alone_equals_row_in_batch"] = all(
        torch.equal(alone[name][1][0], batch[name][1][0]) for name in ("qkv_fused", "gate_up_fused"))
    print("kernels:", json.dumps(out, indent=1), flush=True)


def numerics(res: dict, model, steps: int, save) -> None:
    """Section 2."""
    import ar_decode  # its teacher-forced `decode_rows`

    cfg = model.config
    device = model.lm_head.weight.device
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (24,), generator=g)
    codes = torch.randint(cfg.gen_vocab_start_index, cfg.full_vocab_size, (steps,), generator=g)
    ids = torch.cat([prompt, codes])[None].to(device)
    got = {}
    for label in ("unfused", "fused"):
        set_linear_backend(model, GemvLinear(fuse_epilogues=VARIANTS[label]))
        got[label] = ar_decode.decode_rows(model, ids, prompt.numel())
    (h0, a0), (h1, a1) = got["unfused"], got["fused"]
    res["numerics"] = {
        "steps": steps, "rel_hidden_error": float((h1 - h0).norm() / h0.norm()),
        "max_abs_hidden_error": float((h1 - h0).abs().max()), "rows_bit_identical": bool(torch.equal(h0, h1)),
        "argmax_agreement": float((a0 == a1).float().mean()),
    }
    print("numerics (fused vs unfused, teacher-forced):", res["numerics"], flush=True)
    save()


def decode(res: dict, model, steps: int, save) -> None:
    """Section 3 (CUDA): the engine's ms/step, fusion off then on."""
    import ar_decode
    from full_size import ceilings

    res["ceilings"] = ceilings()
    fb = ar_decode.floor_bytes(model, ar_decode.MID)
    res["floor"] = {**fb, "ms_per_token": fb["total"] / res["ceilings"]["hbm_bytes_per_s"] * 1e3}
    for label, fuse in VARIANTS.items():
        set_linear_backend(model, GemvLinear(fuse_epilogues=fuse))
        ar_decode.time_variant(model, res, label, {}, (1, 8), steps, mid_image=True, save=save)


def print_summary(res: dict) -> None:
    """Markdown: the side-by-side table."""
    k = res.get("kernels", {})
    print("\n| per layer | M | unfused us | fused us | saved us |\n| --- | --- | --- | --- | --- |")
    for proj in ("qkv", "gate_up"):
        for m in (1, 8):
            if f"{proj}_fused_M{m}_us" in k:
                print(f"| {proj} | {m} | {k[f'{proj}_unfused_M{m}_us']:.2f} | {k[f'{proj}_fused_M{m}_us']:.2f} | "
                      f"{k[f'{proj}_M{m}_saved_us']:.2f} |")
    t = res.get("timings", {})
    floor = res.get("floor", {}).get("ms_per_token")
    if t:
        print("\n| decode ms/step (x floor) | " + " | ".join(VARIANTS) + " |\n| --- |" + " --- |" * len(VARIANTS))
        for key in ("B1", "B1_mid", "B8"):
            cells = []
            for label in VARIANTS:
                ms = t.get(f"{label}_{key}", {}).get("ms_per_step")
                cells.append("-" if ms is None else f"{ms:.3f}" + (f" ({ms / floor:.3f} x)" if floor else ""))
            print(f"| {key} | " + " | ".join(cells) + " |")
    if "numerics" in res:
        print(f"\nnumerics: {res['numerics']}")


def _tiny_model():
    """The tiny reference-fixture AR (float32, CPU) for ``--smoke``."""
    from safetensors.torch import load_file

    from stage_ar.modeling_mammoth_ar import MammothARForCausalLM, strip_llm_prefix

    fixture = ROOT / "tests" / "fixtures" / "mammoth-tiny-reference"
    cfg = json.loads((fixture / "tiny_config_save_pretrained.json").read_text())["llm_config"]
    model = MammothARForCausalLM.from_llm_config(cfg)
    model.load_state_dict(strip_llm_prefix(load_file(fixture / "tiny_reference.safetensors")), strict=True)
    return model.eval()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--steps", type=int, default=200, help="timed engine steps per decode run")
    parser.add_argument("--numerics-steps", type=int, default=256, help="teacher-forced single-token steps")
    parser.add_argument("--smoke", action="store_true", help="toy shapes and the tiny model on the CPU "
                        "(TRITON_INTERPRET=1); no decode section")
    args = parser.parse_args()
    if args.smoke and not G.INTERPRETED:
        parser.error("--smoke needs TRITON_INTERPRET=1 in the environment")
    device = "cpu" if args.smoke else "cuda"
    bench_gemv.DEVICE = device
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": device,
                 "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "torch": torch.__version__,
                 "command": "PYTHONPATH=. python3 benchmarks/ar_fusion.py --out $OUT" + (" --smoke" if args.smoke else "")}

    def save() -> None:
        (out / "ar_fusion.json").write_text(json.dumps(res, indent=2, default=str))

    if args.smoke:
        model, dims, dtype = _tiny_model(), SMOKE, torch.float16
    else:
        from full_size import random_preview_modules

        from mammoth_app.make_checkpoint import preview_config

        model, _ = random_preview_modules(preview_config()[0], dit=False)
        model.eval().requires_grad_(False)
        dims, dtype = PREVIEW, torch.bfloat16
    sections = [lambda: kernels(res, dims, device, dtype, save),
                lambda: numerics(res, model, 8 if args.smoke else args.numerics_steps, save)]
    if not args.smoke:
        sections.append(lambda: decode(res, model, args.steps, save))
    run_sections(res, sections, save)
    print_summary(res)
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
