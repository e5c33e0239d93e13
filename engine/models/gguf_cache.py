"""A GGUF's Hugging Face config and tokenizer files, converted once into a cache folder, never weights.

Converting reads the whole metadata (a 49k-token vocabulary and its merges) and takes seconds;
reading the saved files back takes a fraction of one. A folder's name carries a digest of all
that the conversion reads, the file's header (metadata and tensor table), and transformers'
version, so an edited file or another transformers never meets a stale folder, and a copy of a
file elsewhere shares its original's. A folder only appears by an atomic rename of a finished conversion.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata

from engine.disk_cache import cache_root
from engine.models.gguf_checkpoint import read_gguf_config
from engine.models.gguf_file import GGUFLayout, read_gguf_layout

logger = logging.getLogger(__name__)

TOKENIZER_KEY = "tokenizer.ggml.model"  # present in the metadata of a GGUF that holds a tokenizer


def metadata_cache_dir(gguf: str | GGUFLayout) -> str:
    """Where a GGUF's (a path, or the file walked) config and tokenizer files are cached:
    <name>-<size>-<digest>-meta."""
    layout = read_gguf_layout(gguf) if isinstance(gguf, str) else gguf
    with open(layout.path, "rb") as file:
        header = file.read(layout.data_start)
    # NOTE: the installed version, as transformers.__version__ says, without importing it (seconds)
    digest = hashlib.sha256(header + metadata.version("transformers").encode()).hexdigest()[:16]
    return f"{_float32_cache_dir(layout.path)}-{digest}-meta"


def prepare_metadata_cache(gguf_path: str, layout: GGUFLayout | None = None) -> str:
    """The cache folder of `gguf_path` (config.json, and the tokenizer files where the file holds
    a tokenizer), converted first if missing; `layout`: the file's, if walked already."""
    target = metadata_cache_dir(layout or gguf_path)
    if not _is_complete(target):
        _build_cache(gguf_path, target)
    return target


def write_metadata_folder(gguf_path: str, out_dir: str) -> None:
    """Write a GGUF's Hugging Face config and tokenizer files (no weights) into `out_dir`."""
    read_gguf_config(gguf_path).save_pretrained(out_dir)
    if TOKENIZER_KEY not in read_gguf_layout(gguf_path).metadata:
        return
    import transformers

    folder, name = os.path.split(gguf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file=name, local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)


def _float32_cache_dir(gguf_path: str) -> str:
    """<name>-<size>: where older specserve versions wrote a float32 copy of the embedded model."""
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_root(), f"{name}-{os.path.getsize(gguf_path)}")


def _is_complete(folder: str) -> bool:
    # NOTE: the folder only appears by an atomic rename of a finished conversion, so existence of
    # config.json means complete; the check guards against a folder emptied by hand.
    return os.path.isfile(os.path.join(folder, "config.json"))


def _build_cache(gguf_path: str, target: str) -> None:
    """Convert once under a file lock; temp dir then rename, so a crash leaves no half cache."""
    root = os.path.dirname(target)
    os.makedirs(root, exist_ok=True)
    with _file_lock(target + ".lock"):
        if _is_complete(target):  # another process converted while we waited for the lock
            return
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=root)
        try:
            logger.warning("converting %s's config and tokenizer (a few seconds; this happens "
                           "once, later starts read them from %s)", os.path.basename(gguf_path),
                           target)
            start = time.perf_counter()
            write_metadata_folder(gguf_path, tmp)
            logger.warning("converted %s's config and tokenizer in %.1f s",
                           os.path.basename(gguf_path), time.perf_counter() - start)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(target):
                    raise
                # another process (without the lock, e.g. on NFS) won the race: use theirs
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    old = _float32_cache_dir(gguf_path)
    if os.path.isdir(old):
        logger.warning("%s (a float32 copy of the embedded model written by an older specserve) "
                       "is no longer read: delete it to free ~538 MB", old)


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
