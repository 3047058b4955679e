"""The package's import (selectinfer_ros/__init__.py): the weights' pages."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = """
import selectinfer_ros, torch
t = torch.zeros(64 << 20, dtype=torch.uint8)  # a weight-sized allocation, touched
kb = sum(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages'))
print(kb)
"""


def _huge_kib(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_importing_the_package_puts_large_tensors_in_huge_pages_where_the_kernel_offers_them():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    mode = re.search(r"\[(\w+)\]", THP.read_text()).group(1) if THP.exists() else "never"
    if mode == "never" or not Path("/proc/self/smaps_rollup").exists():
        assert _huge_kib(env) == 0  # nothing to ask for: the import still works
        return
    assert _huge_kib(env) >= 32 << 10  # most of the 64 MiB in 2 MiB pages
    if mode == "madvise":  # only asked-for pages are huge: the user's off switch holds
        assert _huge_kib(dict(env, THP_MEM_ALLOC_ENABLE="0")) == 0
