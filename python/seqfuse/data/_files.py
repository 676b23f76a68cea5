"""Writing a file so that an existing one is only ever replaced by a
complete new one (the writers of fasta.py and parquet.py)."""
from __future__ import annotations

import contextlib
import os
import secrets
import stat


@contextlib.contextmanager
def replacing(path, caller: str):
    """Yield a temporary path next to ``path`` to write the new file to; when
    the block ends without an exception, ``os.replace`` it onto ``path``
    (atomic: readers see the old file or the new one, whole); on an exception
    the temporary file is removed and ``path`` is left as it was.

    A symbolic link is written through (its target is replaced, the link
    kept); an existing file's permission bits are kept; a path that exists
    but is not a regular file (a FIFO, /dev/stdout) is written directly,
    there being nothing there to lose."""
    path = os.fspath(path)
    target = os.path.realpath(path) if os.path.islink(path) else path
    if os.path.isdir(target):
        raise IsADirectoryError(f"{caller}: {path} is a directory")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        yield target
        return
    d, base = os.path.split(target)
    # created like open() would (mode 0o666 less the umask), by name, exclusively
    for _ in range(100):
        tmp = os.path.join(d, f".{base}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 100 collisions of 32 random bits
        raise FileExistsError(f"{caller}: could not create a temporary file next to {path}")
    os.close(fd)
    try:
        yield tmp
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
