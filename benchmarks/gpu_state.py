"""What the GPU was running at when a benchmark measured: SM and memory clocks, power, temperature and
the active clock-throttle reasons, from ``nvidia-smi`` (2026-12-03: separate processes of one call on
one H200 measured the same decode step 3-10 % apart, the later processes slower; without the clocks
beside a figure, such a difference cannot be told from a change's effect).

    from gpu_state import snapshot
    res["gpu_state"] = snapshot()   # {} where nvidia-smi is missing or fails
"""

from __future__ import annotations

import subprocess

#: ``nvidia-smi --query-gpu`` fields, in this order, as the snapshot's keys
FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "temperature.gpu",
          "clocks_throttle_reasons.active")


def snapshot(index: int = 0) -> dict:
    """GPU ``index``'s `FIELDS` now (MHz, W, °C; the throttle reasons as nvidia-smi's bit mask), as
    strings; ``{}`` if ``nvidia-smi`` is missing or fails (the figure is still recorded without it)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    return dict(zip(FIELDS, values)) if len(values) == len(FIELDS) else {}
