"""Process supervision for ``mammoth up``: children that die with it, one instance per port.

- `die_with_parent`: a component started by ``mammoth up`` calls it first thing (hidden flag
  ``--parent-pid``), so it gets SIGKILL the moment ``mammoth up`` ends, whatever ended it (Ctrl-C,
  SIGHUP from a closed terminal, SIGKILL, a crash). On Linux this is ``prctl(PR_SET_PDEATHSIG)``;
  elsewhere a daemon thread polls the parent id every 0.5 s.
- `kill_now`: SIGKILL a component's whole process group (each component is started in its own
  session, so its group id is its pid), for the second Ctrl-C.
- `InstanceLock`: an ``flock`` on ``<cache>/run/up-<port>.lock`` held for the life of one
  ``mammoth up``; the file names the holder (pid, URL, state). The kernel drops the lock when the
  holder dies, so a lock file left behind is never mistaken for a running instance.
- `port_holder`: which process listens on a TCP port (``/proc/net/tcp*``), to name a stale
  component that holds the gateway's port.
- `WorkFolder`: the private ``$TMPDIR/mammoth-up-*`` folder of one ``mammoth up`` (ready files,
  stage tokens), with an ``flock`` on its ``owner.lock`` held for that ``mammoth up``'s life. A
  ``mammoth up`` killed with SIGKILL cannot remove its folder; the next one removes every folder
  of this user whose lock nobody holds (`WorkFolder.sweep_stale`), so stage tokens do not pile up.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import signal
import shutil
import subprocess
import tempfile
import time

from mammoth_core.runtime import die_with_parent  # noqa: F401 - its one home; re-exported


def kill_now(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (its own session: group id = pid) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    proc.wait()


class AlreadyRunning(RuntimeError):
    """Another ``mammoth up`` holds the port's instance lock; the message names it."""


class InstanceLock:
    """The instance lock of one ``mammoth up`` on one gateway port (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, port: int):
        self.path = pathlib.Path(run_dir) / f"up-{port}.lock"
        self.port = port
        self._file = None

    def acquire(self) -> "InstanceLock":
        """Take the lock without waiting.

        Raises:
            AlreadyRunning: another live ``mammoth up`` holds it (the message names its pid, state
                and URL).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise AlreadyRunning(self._describe_holder()) from None
        self._file = f
        self.update(state="starting")
        return self

    def update(self, **info: object) -> None:
        """Rewrite the lock file's description of this instance (pid, start time, ``info``)."""
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps({"pid": os.getpid(), "started": time.time(), **info}))
        self._file.flush()

    def release(self) -> None:
        """Drop the lock and remove the file (idempotent)."""
        if self._file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._file.close()
            self._file = None

    def info(self) -> dict:
        """What the holder wrote (``pid``, ``started``, ``state``, ``url``, ``components``); {} if none."""
        for _ in range(5):  # the holder may be between truncate and write
            try:
                info = json.loads(self.path.read_text() or "{}")
            except FileNotFoundError:
                return {}
            except (OSError, ValueError):
                info = {}
            if info:
                return info
            time.sleep(0.05)
        return {}

    def held(self) -> bool:
        """True while a live process holds the lock (probes with a non-blocking ``flock``)."""
        try:
            with open(self.path) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
                return False
        except FileNotFoundError:
            return False

    def _describe_holder(self) -> str:
        info = self.info()
        pid = info.get("pid", "?")
        where = f" at {info['url']}" if info.get("url") else f" on port {self.port}"
        state = "is starting" if info.get("state") == "starting" else "is running"
        return (f"another mammoth up (pid {pid}) {state}{where}; stop it with `mammoth down --port "
                f"{self.port}` (or Ctrl-C in its terminal) or choose another port with --port")


def port_holder(port: int) -> tuple[int, str] | None:
    """``(pid, command line)`` of a process listening on TCP ``port`` (Linux ``/proc``), else None.

    Only processes this user may inspect are found; None when ``/proc`` is not there.
    """
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in pathlib.Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    return int(proc.name), cmd.strip()
    return None


class WorkFolder:
    """A private work folder (mode 0700, in ``$TMPDIR``) locked by the process that made it.

    Attributes:
        path: the folder.
    """

    PREFIX = "mammoth-up-"
    LOCK = "owner.lock"
    #: Folders younger than this are never swept: between `mkdtemp` and its ``flock`` a live
    #: owner's folder has no held lock yet.
    MIN_AGE_S = 10.0

    def __init__(self, parent: str | os.PathLike | None = None):
        self.path = pathlib.Path(tempfile.mkdtemp(prefix=self.PREFIX, dir=parent))
        self._lock = open(self.path / self.LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it

    def remove(self) -> None:
        """Delete the folder and drop its lock (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if not self._lock.closed:
            self._lock.close()

    @classmethod
    def sweep_stale(cls, parent: str | os.PathLike | None = None) -> list[pathlib.Path]:
        """Remove the work folders in ``parent`` (default ``$TMPDIR``) that belong to this user and
        whose owner is gone (its ``owner.lock`` not held: the kernel drops an ``flock`` when its
        holder dies, SIGKILL included) and that are at least `MIN_AGE_S` old. Folders without a lock file (older versions, other
        programs) and other users' folders are left alone. Returns the folders removed."""
        removed = []
        for folder in pathlib.Path(parent or tempfile.gettempdir()).glob(cls.PREFIX + "*"):
            lock = folder / cls.LOCK
            try:
                info = folder.lstat()
                if folder.is_symlink() or info.st_uid != os.getuid() or time.time() - info.st_mtime < cls.MIN_AGE_S:
                    continue
                with open(lock) as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except (OSError, BlockingIOError):  # no lock file, not ours, or its owner is alive
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        return removed
