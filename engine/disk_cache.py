"""The one folder specserve caches in (converted model metadata, calibrated step costs; the C++ kernels
keep their own sub-folder, kernels/cpu_extension.py), and a write that never leaves half a file.

Everything in it is derived and keyed by what it was derived from: deleting the folder only costs the
next start the time to derive it again.
"""

from __future__ import annotations

import os
import tempfile

CACHE_DIR_ENV = "SPECSERVE_CACHE_DIR"


def cache_root() -> str:
    """SPECSERVE_CACHE_DIR, else ~/.cache/specserve."""
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join("~", ".cache", "specserve")
    return os.path.abspath(os.path.expanduser(root))


def write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename: a reader (another process
    starting at the same time) sees the old file or the whole new one, never a part."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".write-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.chmod(tmp, 0o644)  # NOTE: mkstemp makes it 0600; the cache is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
