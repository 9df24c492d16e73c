"""`mammoth_app.supervise.WorkFolder`: a ``mammoth up`` killed with SIGKILL leaves its work folder
(stage tokens) behind; the next one removes it, and only folders whose owner is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from mammoth_app.supervise import WorkFolder

OWNER = """
import sys, time
from mammoth_app.supervise import WorkFolder
work = WorkFolder(sys.argv[1])
(work.path / "tokens").mkdir()
print(work.path, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owners_folder_is_swept_and_live_or_foreign_ones_are_kept(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        dead = owner.stdout.readline().strip()
        live = WorkFolder(tmp_path)  # this process: alive
        assert WorkFolder.sweep_stale(tmp_path) == [], "a folder whose owner is alive was removed"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
    finally:
        if owner.poll() is None:
            owner.kill()
    unlocked = tmp_path / "mammoth-up-old"  # no owner.lock: an older version's, or not ours
    unlocked.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "mammoth-up-link").symlink_to(target)
    assert WorkFolder.sweep_stale(tmp_path) == [], "a folder younger than MIN_AGE_S was removed"
    old = os.stat(dead).st_mtime - WorkFolder.MIN_AGE_S - 1
    for folder in (dead, live.path, unlocked):
        os.utime(folder, (old, old))
    assert [str(p) for p in WorkFolder.sweep_stale(tmp_path)] == [dead]
    assert not os.path.exists(dead)
    assert live.path.is_dir() and unlocked.is_dir() and target.is_dir()
    live.remove()
    assert not live.path.exists()
