"""A DiT that stops reading stalls only its own request: the others in the AR batch finish, the
stalled one ends at its deadline, and the AR holds nothing afterwards.

The speed side of the rule (other requests' tokens/s within 10%) is measured by
``benchmarks/stalled_consumer.py`` (figures in docs/PERFORMANCE.md), not by a timed test.
"""

from __future__ import annotations

import asyncio
import time

from benchmarks.stalled_consumer import run_scenario


def test_stalled_consumer_does_not_block_the_batch(pipeline):
    ar = pipeline.components["ar"].address
    dit = pipeline.components["dit"].address
    results = asyncio.run(
        run_scenario(ar, dit, n=3, size=256, stalled=True, deadline_s=60.0, stalled_deadline_s=5.0,
                     metadata=pipeline.auth(), stalled_port=pipeline.spare_dit_port)
    )
    stalled, others = results[0], results[1:]
    assert all(r.ok and r.tokens == 16 * 17 for r in others), others
    assert not stalled.ok and stalled.code in ("DEADLINE_EXCEEDED", "CANCELLED"), stalled
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pipeline.metric("ar", "mammoth_ar_running_sequences") != 0:
        time.sleep(0.1)
    assert pipeline.metric("ar", "mammoth_ar_running_sequences") == 0
    assert pipeline.metric("dit", "mammoth_dit_slots_in_use") == 0
