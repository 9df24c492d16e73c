"""The launches of one W8A8 decoder layer at batch 1, each timed on its own (issue 17): which of the
folds of 2026-12-03 (add + norm inside the quantizer; the MLP's and o_proj's quantization in the
consumer GEMV's prologue) pays.

    PYTHONPATH=. python3 benchmarks/w8a8_parts.py "$OUT/w8a8_parts.json" [off,pdl] [part,part,...]

Preview shapes (hidden 3,584, intermediate 18,944, qkv 4,608), random weights, M = 1. Every part is
captured ``copies`` times into one CUDA graph over distinct weights (more than 4 x L2 of weight bytes
where the part streams weights) and reported as us per call, under `stage_ar.launch_overlap` ``off``
(each kernel's own time) and ``pdl``. Parts:

- ``norm``: `stage_ar.row_norm.rms_norm_rows`; ``quantize``: `quantize_rows` of normalised rows;
  ``quantize_wide``: of a SwiGLU output row (18,944 columns: down_proj's input, 19 programs that each
  load the whole row for its amax);
  ``quantize_norm``: the norm inside the quantizer; ``quantize_add_norm``: residual add, norm and
  quantization in one launch (the served form since 2026-12-03).
- ``o_codes`` / ``down_codes``: the W8A8 GEMV on rows quantized apart (`QuantizedRows`, + residual);
  ``o_prologue`` / ``down_prologue``: on `RowsWithAmax` (quantized in the GEMV's prologue).
- ``gate_up`` / ``gate_up_amax``: the SwiGLU GEMV without and with the output rows' amax gathered.
- ``qkv``: bias + RoPE on `QuantizedRows`.
- delayed activation scales (`stage_ar.fp8_activations.DelayedOut`, an experiment of issue 17: each
  producer writes its consumer's codes with the scale the row's amax had one step earlier, so no
  quantizer launch runs): ``o_delayed`` (+ residual, writes gate_up's codes of the normalised sum and
  the norm's sums of squares), ``gate_up_delayed`` (reads them, SwiGLU, writes down's codes),
  ``down_delayed`` (+ residual, writes the next qkv's codes), ``qkv_delayed`` (reads them, bias + RoPE,
  rolls the layer's state).
- chained as a layer runs them after its attention (each launch reads what the one before wrote; µs
  per layer, o's input as the attention leaves it): ``layer_served``, today's eight launches
  (``quantize``, o, ``quantize_add_norm``, gate_up, ``quantize_wide``, down, ``quantize_add_norm``,
  qkv); ``layer_delayed``, the four delayed ones (o's codes as the attention's combine would write
  them: not built); ``layer_codes``, the four GEMVs on codes made before the capture, with no
  quantization at all (the floor of any activation-scale scheme).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.getcwd(), "benchmarks"), os.getcwd()]

import gemv as B  # noqa: E402 - benchmarks/gemv.py: graph timing
from gpu_state import snapshot  # noqa: E402
from stage_ar import gemv as G  # noqa: E402
from stage_ar import launch_overlap  # noqa: E402
from stage_ar.fp8_activations import (  # noqa: E402
    DelayedOut, DelayedRows, QuantizedRows, RowsWithAmax, amax_buffers, delayed_state, quantize_rows,
)
from stage_ar.row_norm import rms_norm_rows  # noqa: E402

H, I, QKV, HEAD_DIM = 3584, 18944, 4608, 128


def _weights(rows: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(E4M3 weight, per-row scale) copies of a ``(rows, k)`` weight, more than 4 x L2 of FP8 bytes."""
    shape = dict(rows=rows, K=k)
    return [(ws["w8"], ws["scale"]) for ws in B.make_weights(shape, B.weight_copies(shape, weight_bytes=1), seed=rows)]


def main(out: str, modes: tuple[str, ...] = ("off", "pdl"), only: tuple[str, ...] | None = None) -> None:
    """Time every part (or the parts named in ``only``) under each launch mode; write ``out``."""
    torch.manual_seed(0)
    x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    r = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    xi = torch.randn(1, I, device="cuda").to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    cos = torch.randn(1, HEAD_DIM, device="cuda").to(torch.bfloat16)
    sin = torch.randn(1, HEAD_DIM, device="cuda").to(torch.bfloat16)
    o_w, down_w, gu_w, qkv_w = _weights(H, H), _weights(H, I), _weights(2 * I, H), _weights(QKV, H)
    qkv_bias = torch.zeros(QKV, device="cuda", dtype=torch.bfloat16)
    codes_h = QuantizedRows(*quantize_rows(x), torch.bfloat16, x.shape)
    codes_i = QuantizedRows(*quantize_rows(xi), torch.bfloat16, xi.shape)

    def with_amax(values, weight):
        amax, counter = amax_buffers(weight)
        return RowsWithAmax(values, amax, counter)

    rope = dict(bias=qkv_bias, cos=cos, sin=sin, rope_columns=(28 + 4) * HEAD_DIM)
    state = delayed_state(o_w[0][0])
    state.view(torch.float32).view(4, 2, 16)[:, 0] = 4.0  # a plausible amax for the first step's scales
    o_codes = DelayedRows(codes_h.codes, state, 0, None, 1e-6, torch.bfloat16, x)
    _, gu_rows = G.gemv(o_codes, o_w[0][0], weight_scale=o_w[0][1], residual=r, delayed_out=DelayedOut(state, 1, nw))
    _, down_rows = G.gemv(gu_rows, gu_w[0][0], weight_scale=gu_w[0][1], swiglu=True, delayed_out=DelayedOut(state, 2))
    _, qkv_rows = G.gemv(down_rows, down_w[0][0], weight_scale=down_w[0][1], residual=r,
                         delayed_out=DelayedOut(state, 3, nw))

    def layer_served(i):
        """A W8A8 layer's launches after the attention, as the decoder runs them today (8 launches)."""
        o = G.gemv(QuantizedRows(*quantize_rows(x), torch.bfloat16, x.shape), o_w[i % len(o_w)][0],
                   weight_scale=o_w[i % len(o_w)][1])
        codes, scales, summed = quantize_rows(o, nw, 1e-6, residual=r)
        mid = G.gemv(QuantizedRows(codes, scales, torch.bfloat16, o.shape), gu_w[i % len(gu_w)][0],
                     weight_scale=gu_w[i % len(gu_w)][1], swiglu=True)
        down = G.gemv(QuantizedRows(*quantize_rows(mid), torch.bfloat16, mid.shape), down_w[i % len(down_w)][0],
                      weight_scale=down_w[i % len(down_w)][1])
        codes, scales, _ = quantize_rows(down, nw, 1e-6, residual=summed)
        return G.gemv(QuantizedRows(codes, scales, torch.bfloat16, down.shape), qkv_w[i % len(qkv_w)][0],
                      weight_scale=qkv_w[i % len(qkv_w)][1], **rope)

    def layer_delayed(i):
        """The same with delayed scales: four launches, no quantizer."""
        o, gu, dn, qkv = o_w[i % len(o_w)], gu_w[i % len(gu_w)], down_w[i % len(down_w)], qkv_w[i % len(qkv_w)]
        summed, rows = G.gemv(o_codes, o[0], weight_scale=o[1], residual=r, delayed_out=DelayedOut(state, 1, nw))
        _, rows = G.gemv(rows, gu[0], weight_scale=gu[1], swiglu=True, delayed_out=DelayedOut(state, 2))
        _, rows = G.gemv(rows, dn[0], weight_scale=dn[1], residual=summed, delayed_out=DelayedOut(state, 3, nw))
        return G.gemv(rows, qkv[0], weight_scale=qkv[1], roll=state, **rope)

    def layer_codes(i):
        """The four GEMVs on codes quantized before the capture: no quantization anywhere."""
        o, gu, dn, qkv = o_w[i % len(o_w)], gu_w[i % len(gu_w)], down_w[i % len(down_w)], qkv_w[i % len(qkv_w)]
        summed = G.gemv(codes_h, o[0], weight_scale=o[1], residual=r)
        G.gemv(codes_h, gu[0], weight_scale=gu[1], swiglu=True)
        G.gemv(codes_i, dn[0], weight_scale=dn[1], residual=summed)
        return G.gemv(codes_h, qkv[0], weight_scale=qkv[1], **rope)

    parts = {
        "norm": [lambda: rms_norm_rows(x, nw, 1e-6)] * 16,
        "quantize": [lambda: quantize_rows(x)] * 16,
        "quantize_wide": [lambda: quantize_rows(xi)] * 16,
        "quantize_norm": [lambda: quantize_rows(x, nw, 1e-6)] * 16,
        "quantize_add_norm": [lambda: quantize_rows(x, nw, 1e-6, residual=r)] * 16,
        "o_codes": [lambda w=w: G.gemv(codes_h, w[0], weight_scale=w[1], residual=r) for w in o_w],
        "o_prologue": [lambda w=w: G.gemv(with_amax(x, w[0]), w[0], weight_scale=w[1], residual=r) for w in o_w],
        "down_codes": [lambda w=w: G.gemv(codes_i, w[0], weight_scale=w[1], residual=r) for w in down_w],
        "down_prologue": [lambda w=w: G.gemv(with_amax(xi, w[0]), w[0], weight_scale=w[1], residual=r)
                          for w in down_w],
        "gate_up": [lambda w=w: G.gemv(codes_h, w[0], weight_scale=w[1], swiglu=True) for w in gu_w],
        "gate_up_amax": [lambda w=w: G.gemv(codes_h, w[0], weight_scale=w[1], swiglu=True,
                                            amax_out=amax_buffers(down_w[0][0])[0]) for w in gu_w],
        "qkv": [lambda w=w: G.gemv(codes_h, w[0], weight_scale=w[1], bias=qkv_bias, cos=cos, sin=sin,
                                   rope_columns=(28 + 4) * HEAD_DIM) for w in qkv_w],
        "o_delayed": [lambda w=w: G.gemv(o_codes, w[0], weight_scale=w[1], residual=r,
                                         delayed_out=DelayedOut(state, 1, nw)) for w in o_w],
        "gate_up_delayed": [lambda w=w: G.gemv(gu_rows, w[0], weight_scale=w[1], swiglu=True,
                                               delayed_out=DelayedOut(state, 2)) for w in gu_w],
        "down_delayed": [lambda w=w: G.gemv(down_rows, w[0], weight_scale=w[1], residual=r,
                                            delayed_out=DelayedOut(state, 3, nw)) for w in down_w],
        "qkv_delayed": [lambda w=w: G.gemv(qkv_rows, w[0], weight_scale=w[1], roll=state, **rope) for w in qkv_w],
        # a layer after its attention, chained (each launch reads what the one before wrote), per layer
        "layer_served": [lambda i=i: layer_served(i) for i in range(8)],
        "layer_delayed": [lambda i=i: layer_delayed(i) for i in range(8)],
        "layer_codes": [lambda i=i: layer_codes(i) for i in range(8)],
    }
    res: dict = {"command": "benchmarks/w8a8_parts.py", "gpu_state": snapshot(), "us_per_call": {}}
    for mode in modes:
        launch_overlap.MODE = mode
        row = res["us_per_call"][mode] = {}
        for name, calls in parts.items():
            if only and name not in only:
                continue
            try:
                ms, how = B.graph_ms_per_call(calls)
                row[name] = round(ms * 1e3, 2)
                if name.endswith(("codes", "prologue", "gate_up", "gate_up_amax", "qkv", "delayed")):
                    row[name + "_config"] = str(G.last_tuned_config())
            except Exception as e:  # noqa: BLE001 - record and go on to the next part
                row[name] = f"error: {type(e).__name__}: {e}"[:300]
            print(mode, name, row[name], flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=2)
    res["gpu_state_after"] = snapshot()
    with open(out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "w8a8_parts.json",
         tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("off", "pdl"),
         tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)
