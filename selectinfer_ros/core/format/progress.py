"""Progress for long work (profiling, packing, loading, conversion) that stays quiet when asked.

On a terminal: a tqdm bar on stderr. Elsewhere (``ros2 launch`` and other pipes read lines, so a
bar's carriage-return frames never show): a plain line every few seconds and at the end.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
LINE_EVERY_S = 5.0  # seconds between progress lines when stderr is not a terminal


def log_line(msg: str) -> None:
    """One line of a command's log on stderr (stdout stays for results)."""
    print(msg, file=sys.stderr, flush=True)


def _quiet() -> bool:
    return os.environ.get("SELECTINFER_QUIET") == "1"


def progress(it: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """Wrap an iterable in progress output on stderr unless ``SELECTINFER_QUIET=1``."""
    if _quiet():
        return it
    if sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(it, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
    return _lines(it, desc, total if total is not None else getattr(it, "__len__", lambda: None)())


def _lines(it: Iterable[T], desc: str, total: int | None) -> Iterator[T]:
    t0 = last = time.perf_counter()
    n = 0
    for n, item in enumerate(it, start=1):
        yield item
        now = time.perf_counter()
        if now - last >= LINE_EVERY_S:
            last = now
            of = f"/{total}" if total else ""
            print(f"[progress] {desc}: {n}{of} ({now - t0:.0f} s)", file=sys.stderr, flush=True)
    if time.perf_counter() - t0 >= LINE_EVERY_S:
        print(f"[progress] {desc}: {n} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)


@contextmanager
def heartbeat(log: Callable[[str], None], what: str, every: float = 15.0) -> Iterator[None]:
    """Log ``what: still running (N s)`` every ``every`` seconds while the block runs (for work
    whose own progress is not ours to report, e.g. a library's conversion)."""
    done = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            log(f"{what}: still running ({time.perf_counter() - t0:.0f} s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
