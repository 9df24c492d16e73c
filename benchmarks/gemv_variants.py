"""Side by side at every Preview AR shape, M = 1 and 16: one linear (no norm, no epilogue) by each way
this project could compute it, bf16 and FP8 weights. Section 1 of `benchmarks/gemv.py`.

Variants (``name: what``):
- ``cublas_bf16``: ``F.linear`` (cuBLAS), bf16 weights;
- ``gemv_bf16``: `stage_ar.gemv.gemv`, bf16 weights (autotuned);
- ``gemv_fp8``: FP8 E4M3 weights widened to bf16 in registers (the default FP8 path, autotuned);
- ``gemv_fp8_f16``: FP8 widened to float16, activations too (``fp8_compute="float16"``);
- ``gemv_fp8_w8a8``: W8A8 (``fp8_compute="fp8"``): each activation row quantized to E4M3 by
  `stage_ar.fp8_activations.quantize_rows` (its launch included in the time), FP8 x FP8 dots;
- ``gemv_fp8_bk512`` / ``gemv_fp8_f16_bk512``: the same with 512-column K tiles (as many weight
  bytes per tile as bf16's 256), launch otherwise the tuned one's; ``bits_equal`` says whether their
  output equals the 256-column launch's bit for bit;
- ``torch_dequant_fp8``: `stage_ar.linear.TorchLinear`'s FP8 path (widen the whole weight, cuBLAS):
  what prefill above 16 rows does;
- ``scaled_mm_fp8``: ``torch._scaled_mm`` (cuBLASLt FP8 x FP8, activations quantized per row
  beforehand, M padded to 16: the W8A8 way), if this torch has it.

Each is timed as `benchmarks/gemv.graph_ms_per_call` does (all weight copies' calls in one CUDA
graph, copies > 4 x L2). Per visual token: the sum over shapes of ms x calls per token, against the
bf16 and FP8 HBM floors.
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.nn.functional as F

import gemv as B  # benchmarks/gemv.py (its helpers: timing, weights)
from stage_ar import gemv as G
from stage_ar.fp8 import FP8_MAX
from stage_ar.linear import TorchLinear

VARIANTS = ("cublas_bf16", "gemv_bf16", "gemv_fp8", "gemv_fp8_f16", "gemv_fp8_w8a8", "gemv_fp8_bk512", "gemv_fp8_f16_bk512",
            "torch_dequant_fp8", "scaled_mm_fp8")
FP8_VARIANTS = {v for v in VARIANTS if "fp8" in v}


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (M, K)`` as E4M3 with one float32 scale per row, M padded to 16 (``torch._scaled_mm`` needs it)."""
    pad = torch.zeros(16, x.shape[1], dtype=x.dtype, device=x.device)
    pad[: x.shape[0]] = x
    amax = pad.float().abs().amax(1, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    return (pad.float() / scale).to(G.FP8_DTYPE), scale


def _call(variant: str, x: torch.Tensor, ws: dict, config: G.GemvConfig | None):
    """A zero-argument call of ``variant`` on one weight set."""
    w, w8, scale = ws["w"], ws["w8"], ws["scale"]
    f16 = "f16" in variant
    compute = "float16" if f16 else "activation"
    if variant == "cublas_bf16":
        return lambda: F.linear(x, w)
    if variant == "gemv_bf16":
        return lambda: G.gemv(x, w)
    if variant in ("gemv_fp8", "gemv_fp8_f16"):
        return lambda: G.gemv(x, w8, weight_scale=scale, fp8_compute=compute)
    if variant == "gemv_fp8_w8a8":
        return lambda: G.gemv(x, w8, weight_scale=scale, fp8_compute="fp8")
    if variant.endswith("bk512"):
        return lambda: G.gemv(x, w8, weight_scale=scale, fp8_compute=compute, config=config)
    if variant == "torch_dequant_fp8":
        torch_linear = TorchLinear()
        return lambda: torch_linear(x, w8, None, scale)
    if variant == "scaled_mm_fp8":
        xq, xs = _quantized_rows(x)
        ws_row = scale[None, :]
        return lambda: torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)
    raise ValueError(variant)


def _bk512(x: torch.Tensor, ws: dict, f16: bool) -> tuple[G.GemvConfig, bool]:
    """The tuned FP8 launch with 512-column K tiles, and whether its bits equal the tuned one's."""
    compute = "float16" if f16 else "activation"
    base = G.gemv(x, ws["w8"], weight_scale=ws["scale"], fp8_compute=compute)
    tuned = G.last_tuned_config() or G.GemvConfig(16, 4, 3)
    config = G.GemvConfig(tuned.block_n, tuned.num_warps, max(2, tuned.num_stages - 1), 512)
    same = torch.equal(G.gemv(x, ws["w8"], weight_scale=ws["scale"], fp8_compute=compute, config=config), base)
    return config, same


def time_shape(name: str, shape: dict, sets: list[dict], deadline: float) -> dict:
    """ms per call and TB/s (of the variant's own weight bytes) of every variant at M = 1 and 16."""
    out = {}
    x16 = torch.randn(16, shape["K"], device=B.DEVICE).to(sets[0]["w"].dtype)
    for m in (1, 16):
        x, row = x16[:m].contiguous(), {}
        for variant in VARIANTS:
            if time.time() > deadline:
                row[variant] = "skipped: time budget"
                continue
            try:
                config = None
                if variant.endswith("bk512"):
                    config, row[f"{variant}_bits_equal"] = _bk512(x, sets[0], "f16" in variant)
                if variant == "scaled_mm_fp8" and not hasattr(torch, "_scaled_mm"):
                    row[variant] = "not in this torch"
                    continue
                ms, how = B.graph_ms_per_call([_call(variant, x, ws, config) for ws in sets])
                nbytes = shape["rows"] * shape["K"] * (1 if variant in FP8_VARIANTS else 2)
                row[variant] = dict(ms=ms, TBps=nbytes / (ms / 1e3) / 1e12, timing=how)
            except Exception as exc:  # noqa: BLE001 - one failing variant must not end the run
                row[variant] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                traceback.print_exc()
        out[f"M{m}"] = row
        print(f"variants {name:8s} M={m:2d} " + " ".join(
            f"{v}={row[v]['ms'] * 1e3:.0f}us/{row[v]['TBps']:.2f}" if isinstance(row.get(v), dict) else f"{v}=-"
            for v in VARIANTS), flush=True)
    return out


def per_token(timings: dict, table: dict, bandwidth: float) -> dict:
    """Sum over one visual token's calls per variant and M, with the bf16 / FP8 floors (ms)."""
    bytes16 = sum(s["rows"] * s["K"] * 2 * s["per_token"] for s in table.values())
    out = {"floor_bf16_ms": bytes16 / bandwidth * 1e3, "floor_fp8_ms": bytes16 / 2 / bandwidth * 1e3}
    for m in (1, 16):
        for variant in VARIANTS:
            cells = [timings[n][f"M{m}"].get(variant) for n in table]
            ok = all(isinstance(c, dict) for c in cells)
            out[f"M{m}/{variant}"] = sum(c["ms"] * s["per_token"] for c, s in zip(cells, table.values())) if ok else None
    return out


def run(table: dict, sets: dict, bandwidth: float, deadline: float, save) -> dict:
    """The section: every shape, then the per-token table (printed)."""
    res: dict = {"timings": {}}
    for name, shape in table.items():
        res["timings"][name] = time_shape(name, shape, sets[name], deadline)
        save(f"variants {name}")
    res["per_token"] = tok = per_token(res["timings"], table, bandwidth)
    print(f"per visual token (ms), floors bf16 {tok['floor_bf16_ms']:.3f} / fp8 {tok['floor_fp8_ms']:.3f}:")
    print("| variant | M=1 ms | x floor | M=16 ms | x floor |\n| --- | ---: | ---: | ---: | ---: |")
    for variant in VARIANTS:
        floor = tok["floor_fp8_ms"] if variant in FP8_VARIANTS else tok["floor_bf16_ms"]
        cells = [tok[f"M{m}/{variant}"] for m in (1, 16)]
        print(f"| {variant} | " + " | ".join(f"{c:.3f} | {c / floor:.2f}" if c else "- | -" for c in cells) + " |",
              flush=True)
    return res
