"""Reading a small file a user names (a token file, a settings file, a GEMV picks file) bounded and
without hanging.

``open()`` of a FIFO blocks until a writer comes, and a blocked read in the main thread is one Ctrl-C
cannot end; a folder raises ``IsADirectoryError`` far from the setting that named it; a huge file named
by mistake is read whole into memory. `read_small_file` opens with ``O_NONBLOCK`` and reads at most
``limit`` bytes: a regular file at once; a pipe or FIFO (``--config <(envsubst < mammoth.yaml)``, a
named FIFO a process writes) until its writer closes it, for at most ``wait_s`` seconds; anything else
(a folder, a socket, a device) is refused. Every refusal is a ``ValueError`` naming the path and why.
A pipe's bytes are kept per pipe (device and inode) for the process, so a setting read twice (the
config's unknown-key check, then its values; a token for serving, then for calling) gets them twice.
"""

from __future__ import annotations

import os
import select
import stat
import time

#: How long `read_small_file` waits for a pipe's or FIFO's writer to finish, in seconds.
PIPE_WAIT_S = 10.0
#: What each pipe / FIFO gave, kept for the process: a pipe can be read once, and settings read
#: their files more than once (the unknown-key check, then the values; a token for serving and calling).
_PIPE_READS: dict[tuple[int, int], bytes] = {}


def read_small_file(path: str | os.PathLike, limit: int, what: str, wait_s: float | None = None) -> bytes:
    """The bytes of the file at ``path``, of at most ``limit`` bytes.

    Args:
        path: a regular file, or a pipe / FIFO (links followed).
        limit: the largest size accepted, in bytes.
        what: what the file is, for the error (``"a token file"``).
        wait_s: how long a pipe or FIFO may take to deliver everything (its writer closing it), in
            seconds (None: `PIPE_WAIT_S`).

    Raises:
        ValueError: naming ``path``: neither a regular file nor a pipe / FIFO, larger than ``limit``
            (also when it grows past it while being read), or a pipe / FIFO not finished within ``wait_s``.
        OSError: the file cannot be opened or read (missing, no permission).
    """
    name = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if stat.S_ISFIFO(info.st_mode):
            pipe = (info.st_dev, info.st_ino)  # the pipe itself (an fd path like /dev/fd/63 is reused)
            if pipe in _PIPE_READS:  # read once already: a second read would find it empty
                return _PIPE_READS[pipe]
            raw = _read_pipe(fd, name, limit, what, PIPE_WAIT_S if wait_s is None else wait_s)
            if len(raw) <= limit:
                _PIPE_READS[pipe] = raw
        elif not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{name}: not a regular file (nor a pipe)")
        elif info.st_size > limit:
            raise ValueError(f"{name}: {info.st_size} bytes, larger than the {limit} bytes {what} may have")
        else:
            raw = b""
            while len(raw) <= limit and (chunk := os.read(fd, limit + 1 - len(raw))):
                raw += chunk
        if len(raw) > limit:
            raise ValueError(f"{name}: larger than the {limit} bytes {what} may have")
    finally:
        os.close(fd)
    return raw


def _read_pipe(fd: int, name: str, limit: int, what: str, wait_s: float) -> bytes:
    """Read a non-blocking pipe / FIFO until its writer closes it (or ``limit + 1`` bytes), waiting at most
    ``wait_s`` seconds in all (a FIFO no process writes shows no event: it times out)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    deadline = time.monotonic() + wait_s
    raw = b""
    while len(raw) <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            raise ValueError(f"{name}: a pipe or FIFO whose writer did not finish within {wait_s:g} s "
                             f"(nothing writes to it?)")
        try:
            chunk = os.read(fd, limit + 1 - len(raw))
        except BlockingIOError:
            continue
        if not chunk:  # the writer closed it
            break
        raw += chunk
    return raw
