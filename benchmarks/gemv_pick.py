"""Choose the GEMV picks to pin for this GPU (`stage_ar.gemv.pinned_picks`) and write a picks file.

A served AR process times every GEMV variant's candidates once, at its warm-up, with short timings
(`stage_ar.gemv.TUNING_MS`), and each process may choose differently where candidates are within a
few per cent of each other. This script runs the served engine's own warm-up in-process (the
checkpoint loaded as ``mammoth ar`` loads it, `stage_ar.server.new_engine` with the default settings:
padded mode, the served pool) ``--rounds`` times, each time forgetting the picks and timing every
candidate again with longer timings (``--rep-ms``), and pins, per variant, the candidate chosen most
often (ties: the earliest round's). Writes ``{"version": 1, "device": ..., "picks": {...},
"rounds": [...]}`` (`stage_ar.gemv_configs.load_picks`); ship it as
``stage_ar/gemv_picks/<GPU name>.json`` or point ``MAMMOTH_GEMV_PICKS`` at it.

    PYTHONPATH=. python3 benchmarks/gemv_pick.py OUT.json [--checkpoint DIR] [--weights-dtype fp8]

Without ``--checkpoint``: the Preview-size random checkpoint of `benchmarks/ar_served.py` (same
shapes as the real one). CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from mammoth_core.settings import AR_WEIGHTS_DTYPES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--ckpt-dir", default="/tmp/mammoth-preview-ckpt")
    parser.add_argument("--weights-dtype", default="auto", choices=AR_WEIGHTS_DTYPES)
    parser.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run of this script, nothing to pick)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--time-grid", type=int, default=0,
                        help="then decode one request of this AR grid in-process with the last round's engine "
                             "and picks, and report its ms/token (the served engine without the process)")
    args = parser.parse_args()
    os.environ.pop("MAMMOTH_GEMV_PICKS", None)  # time everything

    import torch

    from ar_served import preview_checkpoint
    from mammoth_core.settings import ARSettings
    from stage_ar import gemv
    from stage_ar.loader import load_ar
    from stage_ar.server import new_engine

    checkpoint = args.checkpoint or preview_checkpoint(pathlib.Path(args.ckpt_dir))
    settings = ARSettings(checkpoint=checkpoint, weights_dtype=args.weights_dtype, device=args.device)
    bundle = load_ar(checkpoint, settings.cache_dir, args.device, settings.resolved_dtype(),
                     weights_dtype=args.weights_dtype)
    gemv.TUNING_MS[:] = [25, args.rep_ms]
    rounds = []
    for r in range(args.rounds):
        gemv.forget_tuning()
        t0 = time.perf_counter()
        engine = new_engine(bundle, settings, warm_up=True)
        engine.run_until_idle()  # capture + warm-up: every variant a served request launches
        rounds.append({"picks": gemv.tuned_picks(), "seconds": time.perf_counter() - t0})
        print(f"round {r}: {len(rounds[-1]['picks'])} variants in {rounds[-1]['seconds']:.1f} s", flush=True)
        if r < args.rounds - 1:
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
    inprocess = _time_request(engine, bundle, args.time_grid) if args.time_grid else None
    picks = {}
    for key in rounds[0]["picks"]:
        votes = collections.Counter(tuple(rd["picks"][key]) for rd in rounds if key in rd["picks"])
        top = max(votes.values())
        picks[key] = next(list(rd["picks"][key]) for rd in rounds if votes[tuple(rd["picks"][key])] == top)
    unstable = {k: [rd["picks"].get(k) for rd in rounds] for k in picks
                if len({tuple(rd["picks"].get(k) or ()) for rd in rounds}) > 1}
    res = {"version": 1, "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "weights_dtype": args.weights_dtype,
           "command": "benchmarks/gemv_pick.py", "tuning_ms": gemv.TUNING_MS, "picks": picks,
           "unstable": unstable, "rounds": rounds, "inprocess_request": inprocess}
    pathlib.Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{len(picks)} picks, {len(unstable)} differed between rounds -> {args.out}")
    for key, seen in unstable.items():
        print(f"  {key}: {seen}")
    return 0


def _time_request(engine, bundle, grid: int) -> dict:
    """Decode one request of a ``grid`` x ``grid`` AR grid through ``engine`` in this thread (prompt as
    `benchmarks/ar_served.py` sends it, rows into a `CollectingSink`); its `JobStats` and ms/token."""
    from stage_ar.engine import CollectingSink, DecodeJob

    stats = []
    prompt = bundle.tokenizer.encode_t2i_prompt("a photo of a red house number 1", grid, grid)
    job = DecodeJob(request_id="inprocess", epoch=0, prompt_ids=prompt, negative_ids=None, ar_width=grid,
                    ar_height=grid, seed=1, temperature=0, top_k=0, top_p=0, ar_guidance_scale=0,
                    sink=CollectingSink(), on_progress=lambda a, b: None,
                    on_done=lambda exc, st: stats.append((exc, st)))
    engine.run_job(job)
    st = stats[0][1]
    res = {"prompt_tokens": st.prompt_tokens, "generated_tokens": st.generated_tokens, "prefill_ms": st.prefill_ms,
           "decode_ms": st.decode_ms, "ms_per_token": st.decode_ms / max(1, st.generated_tokens)}
    print(f"in-process request: {res}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
