"""Pure helpers of the DiT server."""

from __future__ import annotations


def test_preview_steps_spread_evenly_and_never_on_the_last_step():
    from stage_dit.server import preview_steps

    assert preview_steps(0, 8) == {}
    assert preview_steps(2, 8) == {3: 0, 5: 1}
    assert preview_steps(3, 3) == {1: 0, 2: 1}  # capped at steps - 1
    assert max(preview_steps(3, 50)) < 50
