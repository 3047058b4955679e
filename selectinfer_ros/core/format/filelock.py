"""Inter-process preparation of files: an exclusive lock, a unique temp folder, an atomic rename.

Several processes (two nodes of one launch, a CLI run beside them) may prepare the same model at
once: one does the work, the others wait on the lock and then find the result.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


@contextmanager
def exclusive_lock(path: str | Path, log: Callable[[str], None] = lambda s: None,
                   what: str = "") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing); logs once while waiting."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.monotonic()
            log(f"waiting for another process preparing {what or path.parent} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
            log(f"... done after {time.monotonic() - t0:.1f} s")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def temp_dir_beside(final: Path) -> Path:
    """A new, unique folder next to ``final`` (same file system, so a rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))


def publish_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final`` (replacing an incomplete one)."""
    if final.exists():
        old = temp_dir_beside(final)
        os.rename(final, old / final.name)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
