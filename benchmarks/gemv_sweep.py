"""Fixed-config sweep of the plain GEMV (no norm, no epilogue but the FP8 scale) at every Preview AR
shape: which FP8 widening, K tile and launch streams fastest, and which bf16 launches beat the tuned
ones. One GPU call; everything it measures goes to ``gemv_sweep.json``.

Candidates (``mode/bk/bn-warps-stages``):
- FP8 ``float16`` (hardware E4M3 -> float16 conversion) and ``float16_bits`` (integer bit widening,
  `stage_ar.gemv._f16_bits`) with K tiles of 256, 512 and 1024 columns and column blocks 16 to 64
  (64 lowers to Hopper's ``wgmma``); ``activation`` (bf16 widening, the old default) at two launches;
- bf16 weights: the autotuned launch (``tuned``) and fixed launches of 1 to 8 warps.

Per candidate, at M = 1 and M = 16: µs per call inside one CUDA graph over weight copies (> 4 x L2,
`benchmarks/gemv.graph_ms_per_call`), TB/s of its own weight bytes; ``batch_invariant``: row 0
computed alone equals row 0 inside M = 16 bit for bit; ``same_bits_as``: the first candidate of its
mode whose output is bit-identical; ``rel_err``: relative L2 error of the M = 16 output against a
float32 product with the same (dequantised) weights.

Command (GPU): ``PYTHONPATH=. python3 benchmarks/gemv_sweep.py --out $OUT --budget-s 200``;
``--smoke``: toy shapes under ``TRITON_INTERPRET=1`` on the CPU (checks this script's logic).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
import traceback

import torch

import gemv as B  # benchmarks/gemv.py: shapes, weights, graph timing, copy bandwidth
from stage_ar import gemv as G

FP8_LAUNCHES = ((16, 4, 4), (16, 2, 4), (16, 4, 6), (32, 4, 2), (32, 4, 3), (32, 4, 4), (32, 8, 4), (64, 4, 2),
                (64, 4, 3), (64, 4, 4))
BF16_LAUNCHES = ((16, 1, 4), (16, 2, 4), (16, 2, 6), (16, 4, 3), (16, 4, 4), (16, 4, 6), (32, 2, 4), (32, 4, 4),
                 (64, 4, 4))


#: W8A8 launches (``fp8_compute="fp8"``, `--families w8a8`): the ``mma.sync`` blocks autotuning has, and
#: 64/128-column blocks (Hopper ``wgmma``, the weights as the 64-row operand) that the float16 set cannot
#: take (other bits than its 16/32-column launches); each with K tiles of 256 and 512 and split counts
#: `W8A8_SPLITS` (None: `stage_ar.gemv_configs.split_k_for`'s rule; 7-8 on the narrow shapes).
W8A8_LAUNCHES = ((16, 4, 4), (32, 4, 4), (64, 4, 3), (64, 4, 4), (64, 8, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4))
W8A8_SPLITS = (None, 1, 4)
FAMILIES = ("fp8_f16", "bf16", "w8a8")


def w8a8_candidates(smoke: bool) -> list[tuple[str, str, G.GemvConfig]]:
    """The W8A8 family (activations pre-quantized once per M: the timings are the GEMV kernel's alone)."""
    launches = W8A8_LAUNCHES[:2] if smoke else W8A8_LAUNCHES
    out = []
    for bk in (256, 512):
        for bn, w, st in launches:
            for split in W8A8_SPLITS:
                c = G.GemvConfig(bn, w, 1 if smoke else st, bk, split)
                if G.fits_shared_memory(c, G.FP8_DTYPE, G.FP8_DTYPE):
                    out.append((f"fp8/{bk}/{bn}-{w}-{st}/s{split or 'rule'}", "fp8", c))
    return out


def candidates(smoke: bool, families: tuple[str, ...] = FAMILIES[:2]) -> list[tuple[str, str, G.GemvConfig | None]]:
    """(label, fp8_compute or "bf16", config) in the order they are timed (most valuable first), for the
    ``families`` asked for (`FAMILIES`; by default the float16-products and bf16 sets)."""
    if families == ("w8a8",):
        return w8a8_candidates(smoke)
    fp8_launches = FP8_LAUNCHES[:2] if smoke else FP8_LAUNCHES

    def fp8(mode, tiles):
        return [(f"{mode}/{bk}/{bn}-{w}-{st}", mode, c) for bk in tiles for bn, w, st in fp8_launches
                if G.fits_shared_memory(c := G.GemvConfig(bn, w, 1 if smoke else st, bk), torch.bfloat16,
                                        G.FP8_DTYPE)]

    bf16 = [("bf16/tuned", "bf16", None)] + [
        (f"bf16/256/{bn}-{w}-{st}", "bf16", G.GemvConfig(bn, w, 1 if smoke else st, 256))
        for bn, w, st in (BF16_LAUNCHES[:2] if smoke else BF16_LAUNCHES)]
    act = [(f"activation/256/{bn}-{w}-{st}", "activation", G.GemvConfig(bn, w, 1 if smoke else st, 256))
           for bn, w, st in ((16, 4, 4), (32, 4, 4))]
    tiles = (256, 512) if smoke else (512, 256)
    out = []
    if "fp8_f16" in families:
        out += fp8("float16", tiles)
    if "bf16" in families:
        out += bf16
    if "fp8_f16" in families:
        out += fp8("float16_bits", tiles) + fp8("float16", (1024,)) + fp8("float16_bits", (1024,)) + act
    if "w8a8" in families:
        out += w8a8_candidates(smoke)
    return out


def _compile(job):
    label, mode, rows, k, c = job
    t = time.time()
    try:
        G.compile_ahead(torch.bfloat16, torch.bfloat16 if mode == "bf16" else G.FP8_DTYPE, rows, k, c,
                        fp8_compute="activation" if mode == "bf16" else mode)
        return label, time.time() - t, None
    except Exception as exc:  # noqa: BLE001 - timing will compile (or fail) it again
        return label, time.time() - t, f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(table: dict, cands: list, workers: int) -> dict:
    """Compile every fixed candidate of every shape in a process pool."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(f"{name}/{label}", mode, s["rows"], s["K"], c) for name, s in table.items()
            for label, mode, c in cands if c is not None and (mode == "bf16" or name != "head")]
    t = time.time()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(_compile, jobs))
    return {"jobs": len(jobs), "s": time.time() - t, "errors": {k: e for k, _, e in done if e}}


def _call(mode: str, ws: dict, x: torch.Tensor, c):
    if mode == "bf16":
        return lambda: G.gemv(x, ws["w"], config=c)
    if mode == "fp8":  # W8A8: the rows quantized once here, so the call is the GEMV kernel alone
        from stage_ar.fp8_activations import quantize_rows

        xq, xs = quantize_rows(x)
        out = torch.empty(x.shape[0], ws["w8"].shape[0], dtype=x.dtype, device=x.device)

        def launch():
            G._launch(xq, ws["w8"], ws["scale"], None, None, 1e-6, None, False, c, "fp8", out, None, xs)
            return out.clone() if x.device.type != "cuda" or not torch.cuda.is_current_stream_capturing() else out
        return launch
    return lambda: G.gemv(x, ws["w8"], weight_scale=ws["scale"], fp8_compute=mode, config=c)


def _refs(name: str, shape: dict, ws0: dict) -> dict:
    """Shape ``name``'s 16-row activations and the float32 products of both weight forms."""
    x16 = torch.randn(16, shape["K"], device=B.DEVICE).to(ws0["w"].dtype)
    return dict(x16=x16, ref8=x16.float() @ (ws0["w8"].float() * ws0["scale"][:, None]).T,
                ref16=x16.float() @ ws0["w"].float().T, firsts={}, float16_out={})


def measure(name: str, shape: dict, sets: list, refs: dict, label: str, mode: str, c) -> dict:
    """One candidate on one shape at M = 1 and 16 (see the module doc for the fields)."""
    x16, ws0 = refs["x16"], sets[0]
    out16 = _call(mode, ws0, x16, c)()
    out1 = _call(mode, ws0, x16[:1].contiguous(), c)()
    ref = refs["ref16"] if mode == "bf16" else refs["ref8"]
    row = dict(batch_invariant=bool(torch.equal(out1[0], out16[0])),
               rel_err=float((out16.float() - ref).norm() / ref.norm()))
    firsts = refs["firsts"].setdefault(mode, [])
    match = next((lab for lab, o in firsts if torch.equal(o, out16)), None)
    row["same_bits_as"] = match or label
    if match is None:
        firsts.append((label, out16))
    if mode == "float16":
        refs["float16_out"][label] = out16
    if mode == "float16_bits":  # the same launch with the hardware float16 conversion: bit-identical?
        twin = refs["float16_out"].get(label.replace("float16_bits/", "float16/"))
        row["equals_float16_twin"] = None if twin is None else bool(torch.equal(twin, out16))
    nbytes = shape["rows"] * shape["K"] * (2 if mode == "bf16" else 1)
    for m in (1, 16):
        x = x16[:m].contiguous()
        ms, _ = B.graph_ms_per_call([_call(mode, ws, x, c) for ws in sets])
        row[f"M{m}_us"] = ms * 1e3
        row[f"M{m}_TBps"] = nbytes / (ms / 1e3) / 1e12
    if c is None:
        row["tuned"] = str(G.last_tuned_config())
    print(f"{name:8s} {label:28s} M1 {row['M1_us']:7.1f}us {row['M1_TBps']:.2f}TB/s  M16 "
          f"{row['M16_us']:7.1f}us  inv={row['batch_invariant']} bits={row['same_bits_as']} "
          f"err={row['rel_err']:.4f}", flush=True)
    return row


def sweep(table: dict, sets: dict, cands: list, deadline: float, save, res: dict) -> dict:
    """Every candidate on every shape into ``res`` (candidate-major, so the budget cuts the last candidates)."""
    res |= {name: {} for name in table}
    refs = {name: _refs(name, shape, sets[name][0]) for name, shape in table.items()}
    for label, mode, c in cands:
        for name, shape in table.items():
            if mode != "bf16" and name == "head":
                continue  # the head stays bf16
            if time.time() > deadline:
                res[name][label] = "skipped: time budget"
                continue
            try:
                res[name][label] = measure(name, shape, sets[name], refs[name], label, mode, c)
            except Exception as exc:  # noqa: BLE001 - one failing candidate must not end the sweep
                res[name][label] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
        save()
    return res


def summary(table: dict, res: dict, cands: list) -> dict:
    """Per mode: µs per visual token at M = 1 with the best invariant candidate per shape, and with
    the best single candidate for all shapes."""
    out = {}
    for mode in ("float16", "float16_bits", "activation", "bf16", "fp8"):
        names = [n for n in table if not (mode != "bf16" and n == "head")]
        best, per_label = 0.0, {}
        for n in names:
            rows = {lab: r for lab, r in res[n].items() if isinstance(r, dict) and lab.startswith(
                mode + "/") and r["batch_invariant"]}
            if not rows:
                best = None
                break
            lab = min(rows, key=lambda lab_: rows[lab_]["M1_us"])
            best += rows[lab]["M1_us"] * table[n]["per_token"]
            out[f"{mode}/best/{n}"] = lab
            for lab_, r in rows.items():
                per_label.setdefault(lab_, {})[n] = r["M1_us"] * table[n]["per_token"]
        out[f"{mode}/best_per_shape_us"] = best
        full = {lab: sum(v.values()) for lab, v in per_label.items() if len(v) == len(names)}
        if full:
            lab = min(full, key=full.get)
            out[f"{mode}/best_single"] = (lab, full[lab])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no new candidate after this")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--families", default="fp8_f16,bf16", help=f"comma-separated of {FAMILIES}")
    parser.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    args = parser.parse_args()
    t0 = time.time()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        B.DEVICE, table = "cpu", {k: v for k, v in B.smoke_shapes().items() if k in ("o", "down")}
    else:
        from mammoth_app.make_checkpoint import preview_config
        from stage_ar.configuration_mammoth_ar import MammothARConfig
        table = B.shapes(MammothARConfig.from_dict(preview_config()[0]["llm_config"]))
    cands = candidates(args.smoke, tuple(args.families.split(",")))
    res = {"command": "PYTHONPATH=. python3 benchmarks/gemv_sweep.py --out $OUT", "shapes": table,
           "candidates": [lab for lab, _, _ in cands]}

    def save():
        res["elapsed_s"] = time.time() - t0
        (out_dir / "gemv_sweep.json").write_text(json.dumps(res, indent=1, default=str))

    if B.DEVICE == "cuda":
        import triton
        res |= {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        res["precompile"] = precompile(table, cands, args.workers)
        print("precompile", json.dumps(res["precompile"])[:800], flush=True)
        res["copy_bandwidth_Bps"] = B.copy_bandwidth()
        print(f"copy bandwidth {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s", flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if B.DEVICE == "cuda" else 2**16
    sets = {name: B.make_weights(shape, max(2, math.ceil(4 * l2 / (shape["rows"] * shape["K"] * 2))), seed=i)
            for i, (name, shape) in enumerate(table.items())}
    sweep(table, sets, cands, t0 + args.budget_s, save, res.setdefault("sweep", {}))
    res["summary"] = summary(table, res["sweep"], cands)
    print(json.dumps(res["summary"], indent=1), flush=True)
    save()


if __name__ == "__main__":
    sys.exit(main())
