"""Run a benchmark script and report the process's peak GPU memory, whatever the script records.

    python benchmarks/peak_memory.py SCRIPT [ARGS...]

Runs ``SCRIPT`` as ``__main__`` with ``ARGS`` (so an older checkout's benchmark, which does not
record memory itself, is measured the same way as the current one), then prints one JSON line
``{"script": ..., "peak_allocated_gib": ..., "peak_reserved_gib": ...}`` (PyTorch's caching
allocator, device 0 as the script sees it) and exits with the script's status.
"""

from __future__ import annotations

import json
import runpy
import sys


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    import torch

    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    print(json.dumps({
        "script": script,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }), flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
