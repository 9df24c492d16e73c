"""`mammoth generate`'s progress display: redrawn in place on a terminal, plain lines in a log."""

from __future__ import annotations

import io
import os
import sys

from mammoth_app.client import ProgressLine


def _feed(progress: ProgressLine, events: int) -> None:
    for i in range(events):
        progress.update({"tokens_generated": i, "total_tokens": events})
    progress.update({"step": 2, "total_steps": 2}, force=True)
    progress.close()


def test_a_log_gets_a_few_whole_lines_not_carriage_return_redraws(monkeypatch):
    err = io.StringIO()  # a file or pipe: not a terminal
    monkeypatch.setattr(sys, "stderr", err)
    _feed(ProgressLine(), 200)
    text = err.getvalue()
    assert "\r" not in text, repr(text[:200])
    lines = text.splitlines()
    assert 1 <= len(lines) <= 2 and text.endswith("\n"), lines
    assert lines[-1].endswith("2/2 steps"), lines


def test_a_terminal_gets_the_line_redrawn_in_place(monkeypatch):
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        _feed(ProgressLine(), 3)
    text = os.read(leader, 65536).decode()
    os.close(leader)
    assert text.startswith("\rAR [") and text.count("\n") == 1 and "2/2 steps" in text, repr(text)
