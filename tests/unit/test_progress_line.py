"""`mammoth generate`'s progress display: redrawn in place on a terminal, plain lines in a log."""

from __future__ import annotations

import io
import os
import select
import sys
import time

from mammoth_app.client import ProgressLine


def _feed(progress: ProgressLine, events: int) -> None:
    for i in range(events):
        progress.update({"tokens_generated": i, "total_tokens": events})
    progress.update({"step": 2, "total_steps": 2}, force=True)
    progress.close()


def _read_until_newline(leader: int, timeout_s: float = 10.0) -> str:
    """Everything the terminal received up to the closing newline.

    The kernel hands a pty's writes to the other side asynchronously (a work queue), so one
    `os.read` right after the writes may see only the first of them: read until the newline the
    display's `close` writes, or until the follower's end (EIO) or the time limit.
    """
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while b"\n" not in b"".join(chunks) and time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the follower is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


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
    text = _read_until_newline(leader)
    os.close(leader)
    assert text.startswith("\rAR [") and text.count("\n") == 1 and "2/2 steps" in text, repr(text)
