"""Progress bars for long work (profiling, packing, loading) that stay quiet when asked."""
from __future__ import annotations

import os
import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(it: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """Wrap an iterable in a tqdm bar on stderr unless ``SELECTINFER_QUIET=1``."""
    if os.environ.get("SELECTINFER_QUIET") == "1":
        return it
    from tqdm import tqdm
    return tqdm(it, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
