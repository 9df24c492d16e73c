"""``mammoth up --detach`` and ``mammoth down``: the local pipeline in the background.

``up --detach`` starts the same ``mammoth up`` as a background process (its own session, no
terminal; output to ``<cache>/run/up-<port>.log``), waits until its instance lock says it is running
(`supervise.InstanceLock`), prints its banner and returns. ``down`` finds the ``mammoth up`` of a
port by that lock (foreground or detached alike), sends it SIGTERM (it stops the gateway, then the
stages, each draining) and waits until the lock is released; after ``--timeout`` seconds it sends
SIGKILL, and the components die with it (`supervise.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Sequence

from mammoth_app.local import cache_dir
from mammoth_app.supervise import InstanceLock


def instance_lock(port: int, env: dict[str, str] | None = None) -> InstanceLock:
    """The instance lock of the ``mammoth up`` on ``port`` (``<cache>/run/up-<port>.lock``)."""
    return InstanceLock(pathlib.Path(cache_dir(dict(os.environ if env is None else env))) / "run", port)


def detach(argv: Sequence[str], port: int, timeout: float = 600.0) -> int:
    """Run ``mammoth up *argv`` (without ``--detach``) in the background; returns an exit code.

    Prints one line at once (where the log goes), then the banner once the pipeline is up, or the
    log's last line when it ended first.
    """
    if not port:
        print("mammoth up: --detach needs a fixed --port (mammoth down finds the pipeline by it)",
              file=sys.stderr)
        return 2
    lock = instance_lock(port)
    if lock.held():
        info = lock.info()
        print(f"mammoth up: another mammoth up (pid {info.get('pid', '?')}) holds port {port}; "
              f"stop it with `mammoth down --port {port}` or choose another port with --port", file=sys.stderr)
        return 1
    log_path = lock.path.with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mammoth_app.cli", "up", *argv], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"mammoth up: starting in the background (log {log_path}); the first start prepares the "
          "checkpoint and can take a minute...", flush=True)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        info = lock.info()
        if info.get("pid") == proc.pid and info.get("state") == "running":
            text = log_path.read_text()
            text = text[text.find("Mammoth pipeline is up"):].split("Press Ctrl-C")[0]
            print(text.replace("Try, in another terminal:", "Try:").rstrip())
            print(f"Running in the background (pid {proc.pid}, log {log_path}); stop it with "
                  f"`mammoth down --port {port}`.")
            return 0
        time.sleep(0.2)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    tail = [line for line in log_path.read_text().splitlines() if line.strip()][-1:]
    print(f"mammoth up: the background pipeline did not start ({tail[0] if tail else 'no output'}); "
          f"log: {log_path}", file=sys.stderr)
    return 1


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux ``/proc``; elsewhere: exists)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return "\nState:\tZ" not in status


def down(port: int, timeout: float = 60.0) -> int:
    """Stop the ``mammoth up`` holding ``port``'s instance lock; returns an exit code."""
    lock = instance_lock(port)
    if not lock.held():
        print(f"mammoth down: no mammoth up is running on port {port}", file=sys.stderr)
        return 1
    pid = int(lock.info().get("pid") or 0)
    if pid <= 0:
        print(f"mammoth down: {lock.path} names no process; is a mammoth up still starting?", file=sys.stderr)
        return 1
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    # The lock is released before the interpreter's teardown ends: "stopped" means the process is
    # gone too, not only its lock (a caller may reuse the port or check for leftovers at once).
    while (lock.held() or _running(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if lock.held() or _running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        print(f"mammoth down: mammoth up (pid {pid}) did not stop within {timeout:.0f} s; killed it "
              "(its components die with it)")
        return 0
    print(f"mammoth down: stopped mammoth up (pid {pid}) on port {port}")
    return 0
