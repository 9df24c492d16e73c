"""Run a benchmark script and report the process's peak GPU memory, whatever the script records.

    python benchmarks/peak_memory.py [--per-call FUNC ...] SCRIPT [ARGS...]

Runs ``SCRIPT``'s ``main()`` with ``ARGS`` (so an older checkout's benchmark, which does not record
memory itself, is measured the same way as the current one), then prints one JSON line
``{"script": ..., "peak_allocated_gib": ..., "peak_reserved_gib": ...}`` (PyTorch's caching
allocator, device 0 as the script sees it) and exits with the script's status.

``--per-call FUNC`` (repeatable) wraps the script's module-level function ``FUNC``: each call
starts from a reset peak and prints one JSON line ``{"call": FUNC, "label": <its third positional
argument when a string, e.g. ar_decode's variant label>, "allocated_before_gib", "peak_gib",
"allocated_after_gib"}``: the peak of that call alone (e.g. one engine variant of
``benchmarks/ar_decode.py``'s ``time_variant``, whose own ``peak_gib`` figures are cumulative).
The process peak (allocated) is kept across the resets; the final ``peak_reserved_gib`` is then since the last one.
"""

from __future__ import annotations

import functools
import json
import runpy
import sys


def _wrap(fn, name: str, process_peak: list[int]):
    import torch

    @functools.wraps(fn)
    def measured(*args, **kwargs):
        torch.cuda.synchronize()
        process_peak[0] = max(process_peak[0], torch.cuda.max_memory_allocated())
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            process_peak[0] = max(process_peak[0], peak)
            label = args[2] if len(args) > 2 and isinstance(args[2], str) else None
            print(json.dumps({"call": name, "label": label, "allocated_before_gib": before / 2**30,
                              "peak_gib": peak / 2**30,
                              "allocated_after_gib": torch.cuda.memory_allocated() / 2**30}), flush=True)

    return measured


def main() -> int:
    argv = sys.argv[1:]
    per_call: list[str] = []
    while len(argv) >= 2 and argv[0] == "--per-call":
        per_call.append(argv[1])
        argv = argv[2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, str(__import__("pathlib").Path(script).resolve().parent))
    namespace = runpy.run_path(script, run_name="benchmark")  # not __main__: main() is called below
    module_globals = namespace["main"].__globals__  # the dict the script's functions look names up in
    process_peak = [0]
    for name in per_call:
        module_globals[name] = _wrap(module_globals[name], name, process_peak)
    status = 0
    try:
        result = module_globals["main"]()
        status = result if isinstance(result, int) else 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    print(json.dumps({
        "script": script,
        "peak_allocated_gib": max(process_peak[0], torch.cuda.max_memory_allocated()) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }), flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
