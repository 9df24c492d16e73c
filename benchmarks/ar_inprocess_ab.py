"""In-process, interleaved A/B of decode-step variants on one model (issue 17): the launch-overlap
modes (`stage_ar.launch_overlap.MODE`, read at each launch) and, under W8A8, the ``amax`` fold
(`stage_ar.linear.GemvLinear`'s ``fuse_epilogues``: o_proj and down_proj quantize in their GEMV's
prologue instead of a quantizer launch; measured slower on the H100 on 2026-12-06 across processes).

Separate processes on one H200 have measured the same tree 3-10 % apart (2026-12-03), more than the
effects in question; here one process builds the model once and times each variant in turn
(interleaved), so drift shows as a difference between a variant and its repeat, not between variants.

    PYTHONPATH=. python3 benchmarks/ar_inprocess_ab.py "$OUT/ab.json" [rounds, default 1] [groups, default bf16,w8a8]

Group ``split`` (not in the default): W8A8 batch 1 under ``pdl`` at each of `W8A8_SPLITS` in turn
(`stage_ar.gemv_configs.W8A8_SPLIT_K` K ranges for launches of at most `W8A8_SPLIT_MAX_COLUMNS` output
columns: 4,096 splits o_proj and down_proj, 8,192 qkv too), ``rounds`` times, then unsplit again. Group
``attn`` (not in the default): bf16, then W8A8, batch 1 at image start and mid-image under ``pdl``
with the split-KV attention's keys per split and per tile (`stage_ar.decode_attention.SPLIT`,
``BLOCK_N``) at each of `ATTENTION_SHAPES` (bf16: the first two), the first again at the end. (Group
``tma``, `stage_ar.gemv.TMA_WEIGHTS`, went with that switch: measured no faster on the H200, 2026-12-06.) Group
``kvload`` (not in the default): bf16, then W8A8, batch 1 at image start and mid-image under ``pdl``
with `stage_ar.decode_attention.EARLY_LOADS` off and on in turn, ``rounds + 1`` times each (the
attention's key range and first cached tile loaded before its PDL wait). Group ``merge`` (not in the
default): `stage_ar.decode_attention.MERGE_CHUNK` 0 and `MERGE_CHUNK` in turn, ``rounds + 1`` times
each: bf16 batch 1, bf16 in the served engine's padded shape (16 slots of the served pool width, the
GEMV tuned again at its M first), then W8A8 batch 1, each at image start and mid-image. Group
``preload`` (not in the default): `stage_ar.launch_overlap.PRELOAD_TILES` (weight tiles each GEMV
program loads before its PDL wait, under ``pdl``) at each of `PRELOAD_TILES` in turn, ``rounds`` times,
then 0 again: bf16 batch 1, then W8A8 batch 1. Group ``launch`` (not in the default): the launch-overlap
modes apart from the weight preload they used to come with: `LAUNCH_VARIANTS` (``pdl``; ``early``
with no tile before the wait, so only the next launch is allowed before the wait; ``early`` as it is,
one tile) in turn, ``rounds`` times, then ``pdl`` again: bf16 batch 1, then W8A8 batch 1. Group
``noquant`` (not in the default; an ablation, its tokens are meaningless): W8A8 batch 1 under ``pdl``
as it is, then with the plain quantizer launches (o_proj's and down_proj's inputs) left out, then with
the add + norm + quantize launches (qkv's and gate_up's inputs) left out too, ``rounds`` times, then as
it is again (`quantizers_left_out`): the most any activation-scale scheme that removes those launches
(a delayed or static scale written by the producer) could save, with the producers costing nothing.
Group ``trimattn`` (not in the default): bf16 batch 1, then bf16 in the served engine's padded shape
(16 slots, one request, trimmed GEMV rows, the batch-1 picks) with the fused attention launched over
all 16 rows and over the live rows' bucket only (`stage_ar.runner.TRIM_ATTENTION` off and on) in
turn, ``rounds + 1`` times each; then the same under W8A8; each at image start and mid-image.
(Group ``cdf``, the sampler's cumulative sum in blocks of 256, went with that form: measured on the H100,
2026-12-07, 12 us slower at batch 1 and 5 us faster in the served shape.)
Group ``delayed`` (not in the default; an experiment, a row's first step saturates): W8A8 batch 1 under
``pdl`` with the default epilogues and with delayed activation scales (`stage_ar.fp8_activations.DelayedOut`:
o_proj, the SwiGLU GEMV and down_proj write their consumer's codes, no add + norm + quantize or SwiGLU
quantizer launch) in turn, ``rounds`` times, then the default again, each at image start and mid-image.
Group ``w8a8served`` (not in the default): W8A8 batch 1, then W8A8 in the served engine's padded shape
(16 slots, one request, trimmed GEMV rows, the GEMV tuned again at its M first) ``rounds + 1`` times,
then batch 1 again, each at image start and mid-image: what splits a `mammoth ar --weights-dtype
fp8-w8a8` process's 1.052 x (H100, 2026-12-07) between the padded shape and the process.
Group ``trim`` (not in the default): bf16 in the served engine's padded shape (16 slots, one request,
the GEMV tuned again at its M first) without and with the runner's ``trim_gemv_rows`` (the GEMV
launches compute only the live rows' bucket; the served default since 2026-12-07), ``rounds + 1`` times
each, at image start and mid-image.

Variants, ``rounds`` times over, each group's first variant once more at its end (the drift): bf16
batch 1 (1024² grid, 100 steps) under ``pdl`` and ``early``; then the model's visual token linears
converted to FP8 and W8A8 batch 1 with the default epilogues and with ``amax`` fused, each under
``pdl`` and ``early``. Last, W8A8 under ``off`` (serial launches, so the profile's kernel times are
each kernel's own) without and with ``amax``, profiled. Writes the JSON after every variant and
prints ``RESULT label ms/step``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

sys.path[:0] = [os.path.join(os.getcwd(), "benchmarks"), os.getcwd()]

import ar_decode as A  # noqa: E402
import torch  # noqa: E402

from stage_ar import decode_attention, gemv, gemv_configs, launch_overlap, linear  # noqa: E402
from stage_ar import runner as runner_module  # noqa: E402
from stage_ar.fp8 import FP8_DTYPE  # noqa: E402

FOLDS = {"default": A.GemvLinear.DEFAULT_EPILOGUES, "amax": ("rope", "swiglu", "amax"),
         "delayed": ("rope", "swiglu", "delayed")}
#: The chunk of the ``merge`` group (`stage_ar.decode_attention.MERGE_CHUNK`), timed against 0.
MERGE_CHUNK = 16
#: The weight tiles preloaded before the wait that the ``preload`` group times (0: none, today's default).
PRELOAD_TILES = (0, 1, 2, 3)
#: (launch-overlap mode, `stage_ar.launch_overlap.PRELOAD_TILES`) the ``launch`` group times: today's first.
LAUNCH_VARIANTS = (("pdl", None), ("early", 0), ("early", None))
#: (W8A8_SPLIT_K, W8A8_SPLIT_MAX_COLUMNS) the ``split`` group times: today's (unsplit) first.
W8A8_SPLITS = ((1, 4096), (2, 4096), (2, 8192), (4, 4096))
#: (SPLIT, BLOCK_N) of the split-KV attention the ``attn`` group times: the default first.
ATTENTION_SHAPES = ((64, 64), (128, 64), (64, 32), (32, 32))


#: What the ``noquant`` group leaves out, per variant: the modules whose `quantize_rows` stops launching
#: (`stage_ar.gemv`'s: the plain quantizer before o_proj and down_proj; `stage_ar.linear`'s: the add +
#: norm + quantize before qkv and gate_up).
LEFT_OUT = {"as_is": (), "plain": (gemv,), "all": (gemv, linear)}


@contextlib.contextmanager
def quantizers_left_out(modules, widths: tuple[int, ...], device: torch.device, max_rows: int = 16):
    """Within it, `quantize_rows` as ``modules`` call it launches nothing: it returns zero codes, unit
    scales (and ``x`` as the residual sum) from buffers made here, before any graph capture, for
    1 to ``max_rows`` rows of each of ``widths`` columns. Timing only: the step's arithmetic is wrong
    (an ablation).

    Raises:
        RuntimeError: (from a call inside) a shape it made no buffers for, while a graph is captured."""
    cache: dict = {}
    if modules:
        for k in widths:
            for m in range(1, max_rows + 1):
                cache[((m, k), device)] = (torch.zeros((m, k), dtype=FP8_DTYPE, device=device),
                                           torch.ones(m, dtype=torch.float32, device=device))

    def stand_in(x, norm_weight=None, norm_eps=1e-6, residual=None):
        key = (tuple(x.shape), x.device)
        if key not in cache:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"quantizers_left_out: no buffers for {key} made before the capture")
            cache[key] = (torch.zeros(x.shape, dtype=FP8_DTYPE, device=x.device),
                          torch.ones(x.shape[0], dtype=torch.float32, device=x.device))
        codes, scales = cache[key]
        return (codes, scales) if residual is None else (codes, scales, x)

    saved = [(m, m.quantize_rows) for m in modules]
    try:
        for m in modules:
            m.quantize_rows = stand_in
        yield
    finally:
        for m, f in saved:
            m.quantize_rows = f


def main(out: str, rounds: int, groups: tuple[str, ...] = ("bf16", "w8a8")) -> None:
    """Time the variants of ``groups`` (``bf16``, ``w8a8``, ``split``, ``attn``, ``kvload``,
    ``merge``, ``preload``, ``launch``, ``noquant``, ``trim``, ``w8a8served``, ``trimattn``, ``delayed``) ``rounds`` times
    over into the
    JSON at ``out``."""
    res: dict = {"ceilings": A.ceilings(), "command": "benchmarks/ar_inprocess_ab.py", "rounds": rounds}

    def save() -> None:
        with open(out, "w") as f:
            json.dump(res, f, indent=2, default=str)

    config, _ = A.preview_config()
    model, _ = A.random_preview_modules(config, dit=False)
    model.eval().requires_grad_(False)
    A.set_linear_backend(model, A.select_backend("auto", "cuda"))

    served = dict(slots=16, capacity=min(A.DEFAULTS.max_sequence_length, model.config.max_position_embeddings))

    def timed(label: str, mode: str, profile: bool = False, mid_image: bool = False, padded: bool = False,
              runner: dict | None = None) -> None:
        launch_overlap.MODE = mode
        opts = ({"pad_to_max_bucket": True} if padded else {}) | (runner or {})
        A.time_variant(model, res, label, opts, (1,), 100, save=save,
                       profile=profile, mid_image=mid_image, **(served if padded else {}))
        mid = res["timings"].get(f"{label}_B1_mid", {}).get("ms_per_step")
        print("RESULT", label, round(res["timings"][f"{label}_B1"]["ms_per_step"], 4),
              *(["mid-image", round(mid, 4)] if mid_image and mid else []), flush=True)

    # each group's first variant runs again at the group's end: the difference is the drift
    def settings(module, names: tuple[str, ...], values: tuple[tuple[int, ...], ...], tag: str,
                 mid_image: bool = False, padded: bool = False) -> None:
        """Batch 1 under ``pdl`` with ``module``'s attributes ``names`` at each tuple of ``values`` in
        turn (labels ``tag`` + the values), then their defaults again. ``padded``: in the served
        engine's shape instead (padded, 16 slots of the served pool width)."""
        defaults = [getattr(module, name) for name in names]
        for i, value in enumerate(values):
            for name, v in zip(names, value):
                setattr(module, name, v)
            timed(f"{tag}{'x'.join(map(str, value))}_{i}", "pdl", mid_image=mid_image, padded=padded)
        for name, v in zip(names, defaults):
            setattr(module, name, v)

    @contextlib.contextmanager
    def served_gemv_picks():
        """The GEMV tuned again at the served shape's M for the variants inside (as the served process
        tunes it), and again after them for what follows at batch 1."""
        A.retune_gemv()
        try:
            yield
        finally:
            A.retune_gemv()

    attention_shape = ("SPLIT", "BLOCK_N")
    if "bf16" in groups:
        for i, (tag, mode) in enumerate([("pdl", "pdl"), ("early", "early")] * rounds + [("pdl", "pdl")]):
            timed(f"bf16_{tag}_{i}", mode)
    if "attn" in groups:
        shapes = ATTENTION_SHAPES[:2] * rounds + ATTENTION_SHAPES[:1]
        settings(decode_attention, attention_shape, shapes, "bf16_attn", mid_image=True)
    off_on = ((False,), (True,)) * (rounds + 1)  # the kvload group
    if "kvload" in groups:
        settings(decode_attention, ("EARLY_LOADS",), off_on, "bf16_kvload", mid_image=True)
    merge = ((0,), (MERGE_CHUNK,)) * (rounds + 1)
    if "merge" in groups:
        settings(decode_attention, ("MERGE_CHUNK",), merge, "bf16_merge", mid_image=True)
        with served_gemv_picks():
            settings(decode_attention, ("MERGE_CHUNK",), merge, "bf16_served_merge", mid_image=True, padded=True)

    def trim_attention(tag: str) -> None:
        """Batch 1, then the served shape with `TRIM_ATTENTION` off and on in turn (``rounds + 1`` times)."""
        timed(f"{tag}_b1", "pdl", mid_image=True)
        saved = runner_module.TRIM_ATTENTION
        try:
            for i, on in enumerate((False, True) * (rounds + 1)):
                runner_module.TRIM_ATTENTION = on
                timed(f"{tag}_served_trimattn{int(on)}_{i}", "pdl", mid_image=True, padded=True,
                      runner={"trim_gemv_rows": True})
        finally:
            runner_module.TRIM_ATTENTION = saved

    if "trimattn" in groups:
        trim_attention("bf16")
    if "trim" in groups:  # the served shape's GEMVs over the live rows' bucket only, or over all 16
        with served_gemv_picks():
            for i, trim in enumerate((False, True) * (rounds + 1)):
                timed(f"bf16_served_trim{int(trim)}_{i}", "pdl", mid_image=True, padded=True,
                      runner={"trim_gemv_rows": trim})

    def launch_modes(tag: str) -> None:
        """Batch 1 at each of `LAUNCH_VARIANTS` in turn, ``rounds`` times, then the first again."""
        for i, (mode, tiles) in enumerate(LAUNCH_VARIANTS * rounds + LAUNCH_VARIANTS[:1]):
            launch_overlap.PRELOAD_TILES = tiles
            timed(f"{tag}_{mode}_preload{'default' if tiles is None else tiles}_{i}", mode)
        launch_overlap.PRELOAD_TILES = None

    if "launch" in groups:
        launch_modes("bf16_launch")
    preload = tuple((t,) for t in PRELOAD_TILES) * rounds + ((0,),)
    if "preload" in groups:  # each value tunes its own GEMV picks (PRELOAD is in the autotuning key)
        settings(launch_overlap, ("PRELOAD_TILES",), preload, "bf16_preload")
    if {"w8a8", "split", "attn", "kvload", "merge", "preload", "launch", "noquant", "w8a8served",
            "trimattn", "delayed"} & set(groups):
        A.quantize_fp8_(model.visual_token_linears())
        A.set_linear_backend(model, A.GemvLinear(fp8_compute="fp8"))
    if "attn" in groups:
        shapes = ATTENTION_SHAPES * rounds + ATTENTION_SHAPES[:1]
        settings(decode_attention, attention_shape, shapes, "w8a8_attn", mid_image=True)
    if "split" in groups:
        settings(gemv_configs, ("W8A8_SPLIT_K", "W8A8_SPLIT_MAX_COLUMNS"), W8A8_SPLITS * rounds + W8A8_SPLITS[:1],
                 "w8a8_split")
    if "kvload" in groups:
        settings(decode_attention, ("EARLY_LOADS",), off_on, "w8a8_kvload", mid_image=True)
    if "merge" in groups:
        settings(decode_attention, ("MERGE_CHUNK",), merge, "w8a8_merge", mid_image=True)
    if "preload" in groups:
        settings(launch_overlap, ("PRELOAD_TILES",), preload, "w8a8_preload")
    if "launch" in groups:
        launch_modes("w8a8_launch")
    if "trimattn" in groups:
        trim_attention("w8a8")
    if "w8a8served" in groups:  # the served W8A8 shape against batch 1, batch 1 again last (the drift)
        timed("w8a8_served_b1_0", "pdl", mid_image=True)
        with served_gemv_picks():
            for i in range(rounds + 1):
                timed(f"w8a8_served_shape_{i}", "pdl", mid_image=True, padded=True, runner={"trim_gemv_rows": True})
        timed("w8a8_served_b1_1", "pdl", mid_image=True)
    if "delayed" in groups:
        for i, folds in enumerate(["default", "delayed"] * rounds + ["default"]):
            A.set_linear_backend(model, A.GemvLinear(fp8_compute="fp8", fuse_epilogues=FOLDS[folds]))
            timed(f"w8a8_{folds}_{i}", "pdl", mid_image=True)
        A.set_linear_backend(model, A.GemvLinear(fp8_compute="fp8"))
    if "noquant" in groups:
        c = model.config
        widths = (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim)
        device = torch.device("cuda", torch.cuda.current_device())  # as the activations' x.device says it
        for i, variant in enumerate([*LEFT_OUT] * rounds + ["as_is"]):
            with quantizers_left_out(LEFT_OUT[variant], widths, device):
                timed(f"w8a8_noquant_{variant}_{i}", "pdl")
    if "w8a8" in groups:
        w8a8 = [("default", "pdl"), ("amax", "pdl"), ("default", "early"), ("amax", "early")] * rounds
        for i, (folds, mode) in enumerate(w8a8 + [("default", "pdl")]):
            A.set_linear_backend(model, A.GemvLinear(fp8_compute="fp8", fuse_epilogues=FOLDS[folds]))
            timed(f"w8a8_{folds}_{mode}_{i}", mode)
        for folds in FOLDS:
            A.set_linear_backend(model, A.GemvLinear(fp8_compute="fp8", fuse_epilogues=FOLDS[folds]))
            timed(f"w8a8_{folds}_off_profiled", "off", profile=True)
    save()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1,
         tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("bf16", "w8a8"))
