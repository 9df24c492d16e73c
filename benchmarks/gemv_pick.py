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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--ckpt-dir", default="/tmp/mammoth-preview-ckpt")
    parser.add_argument("--weights-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()
    os.environ.pop("MAMMOTH_GEMV_PICKS", None)  # time everything

    import torch

    from ar_served import preview_checkpoint
    from mammoth_core.settings import ARSettings
    from stage_ar import gemv
    from stage_ar.loader import load_ar
    from stage_ar.server import new_engine

    checkpoint = args.checkpoint or preview_checkpoint(pathlib.Path(args.ckpt_dir))
    settings = ARSettings(checkpoint=checkpoint, weights_dtype=args.weights_dtype)
    bundle = load_ar(checkpoint, settings.cache_dir, "cuda", settings.resolved_dtype(),
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
        del engine
        torch.cuda.empty_cache()
    picks = {}
    for key in rounds[0]["picks"]:
        votes = collections.Counter(tuple(rd["picks"][key]) for rd in rounds if key in rd["picks"])
        top = max(votes.values())
        picks[key] = next(list(rd["picks"][key]) for rd in rounds if votes[tuple(rd["picks"][key])] == top)
    unstable = {k: [rd["picks"].get(k) for rd in rounds] for k in picks
                if len({tuple(rd["picks"].get(k) or ()) for rd in rounds}) > 1}
    res = {"version": 1, "device": torch.cuda.get_device_name(), "weights_dtype": args.weights_dtype,
           "command": "benchmarks/gemv_pick.py", "tuning_ms": gemv.TUNING_MS, "picks": picks,
           "unstable": unstable, "rounds": rounds}
    pathlib.Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{len(picks)} picks, {len(unstable)} differed between rounds -> {args.out}")
    for key, seen in unstable.items():
        print(f"  {key}: {seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
