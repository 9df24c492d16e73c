"""Reading a small file a user names (a token file, a settings file, a GEMV picks file) bounded and
without blocking.

``open()`` of a FIFO blocks until a writer comes, and a blocked read in the main thread is one Ctrl-C
cannot end; a folder raises ``IsADirectoryError`` far from the setting that named it; a huge file named
by mistake is read whole into memory. `read_small_file` opens with ``O_NONBLOCK``, reads only a regular
file, at most ``limit`` bytes, and says which path and why in a ``ValueError``.
"""

from __future__ import annotations

import os
import stat


def read_small_file(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``, of at most ``limit`` bytes.

    Args:
        path: the file (a link to one is followed).
        limit: the largest size accepted, in bytes.
        what: what the file is, for the error (``"a token file"``).

    Raises:
        ValueError: naming ``path``: not a regular file (a FIFO, a folder, a device), or larger than
            ``limit`` (also when it grows past it while being read).
        OSError: the file cannot be opened or read (missing, no permission).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{os.fspath(path)}: not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{os.fspath(path)}: {info.st_size} bytes, larger than the {limit} {what} may have")
        raw = b""
        while len(raw) <= limit and (chunk := os.read(fd, limit + 1 - len(raw))):
            raw += chunk
        if len(raw) > limit:
            raise ValueError(f"{os.fspath(path)}: larger than the {limit} bytes {what} may have")
    finally:
        os.close(fd)
    return raw
