"""Packed model format: a Hugging Face checkpoint rewritten neuron-major.

A packed model folder holds:

- ``manifest.json``: format version, architecture, shapes, dtype, source checksum, fingerprint;
- ``config.json`` and the tokenizer files, copied from the source;
- ``model.safetensors``: every non-FFN tensor under its Hugging Face name;
- ``ffn.safetensors``: per layer ``layers.<l>.neurons`` of shape ``[I, 3, H]``; record ``n`` is
  (gate row n, up row n, down column n), so a neuron is ``3 * H * itemsize`` contiguous bytes and
  loading a subset of neurons reads only those records. With int8 weights (``pack --weights
  int8``) a record is ``uint8 [3 * H + 12]``: the three rows as int8, then their three float32
  scales, so a neuron is still one contiguous read. With 4-bit weights (``pack --weights q4``,
  super-blocks of 256 with 6-bit sub-block scales and offsets, llama.cpp's Q4_K values,
  :mod:`.q4`) a record is ``uint8 [3 * (H / 2 + 16 * ceil(H / 256))]``: the nibbles of the gate
  row, the up row and the down column (``H / 2`` bytes each, along H), then their heads;
- int8 weights also store the attention projections and the output layer / token embedding as
  int8 ``<name>.weight`` with a float32 per-row ``<name>.scale`` (``--weights int8-ffn``: only the
  neuron records are int8); ``q4`` keeps them int8 (4-bit attention and output rows cost too
  much agreement on the embedded model), ``q4-out8`` stores all but the output layer as 4-bit
  rows (the output layer of Qwen2.5 1.5B as 4-bit rows cost 0.009 of agreement for 98 MiB),
  ``q4-all`` stores them as 4-bit rows too: uint8
  nibbles ``<name>.weight`` ``[N, K / 2]`` and uint8 heads ``<name>.scale``
  ``[N, 16 * ceil(K / 256)]``;
  ``int8-q4emb`` keeps int8 neuron records and attention and stores only the token embedding /
  output layer as 4-bit rows (the bytes of a small model with a large vocabulary);
- ``ffn-high.safetensors`` (4-bit packs): every neuron again as an int8 record, the high tier
  of tiered records (``int8_ratio``: the most valued resident neurons are read from here, the
  rest from ``ffn.safetensors``; a neuron is resident in one tier only);
- ``checksums.safetensors``: int64 word sums of every neuron record (``layers.<l>.neurons``
  ``[I]``) and of every non-FFN tensor (its name, ``[1]``). The loader checks the records and
  tensors it reads; ``selectinfer verify`` checks everything.

Standard tools read both safetensors files. Packing goes layer by layer (peak memory: one layer).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from .architectures import architecture_for
from .filelock import publish_dir, temp_dir_beside
from .progress import progress
from .safetensors_io import CountingReader, FormatError, StreamWriter, read_header
from .weights import INT8_WEIGHTS, QUANTIZED_OTHER, Q4_WEIGHTS, WEIGHTS

FORMAT = "selectinfer-packed"
FORMAT_VERSION = 3  # 3: 4-bit rows as super-blocks (Q4_K values), was Q4_0
MANIFEST = "manifest.json"
FFN_FILE = "ffn.safetensors"
HIGH_FILE = "ffn-high.safetensors"  # 4-bit packs: every neuron again as an int8 record (tiers)
OTHER_FILE = "model.safetensors"
CHECKSUM_FILE = "checksums.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json",
                   "vocab.json", "merges.txt")


def neuron_key(layer: int) -> str:
    return f"layers.{layer}.neurons"


def high_sum_key(layer: int) -> str:
    """The checksum name of layer ``layer``'s records in HIGH_FILE."""
    return f"high.{neuron_key(layer)}"


def int8_record_bytes(hidden: int) -> int:
    """Bytes of an int8 neuron record: three int8 rows of H, their three float32 scales."""
    return 3 * hidden + 3 * 4


def int8_record_parts(raw: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 records ``raw`` (uint8 ``[n, 3 H + 12]``) -> values int8 ``[n, 3, H]``, scales
    float32 ``[n, 3]``."""
    n, H = raw.shape[0], hidden
    vals = raw[:, :3 * H].view(torch.int8).view(n, 3, H)
    return vals, raw[:, 3 * H:].contiguous().view(torch.float32).view(n, 3)


@dataclass(frozen=True)
class Manifest:
    """What a packed folder says about itself (``manifest.json``)."""

    model_id: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    source_sha256: str
    fingerprint: str
    path: Path
    weights: str = "float"  # one of WEIGHTS; ``dtype`` is then the dtype of everything not int8
    high: str = ""  # records of HIGH_FILE (``int8``: a 4-bit pack's high tier), "" = none

    @property
    def int8_ffn(self) -> bool:
        """The neuron records are int8 rows."""
        return self.weights in INT8_WEIGHTS

    @property
    def q4_ffn(self) -> bool:
        """The neuron records are 4-bit rows (:func:`q4_records`)."""
        return self.weights in Q4_WEIGHTS

    @property
    def quantized_ffn(self) -> bool:
        return self.weights != "float"

    @property
    def int8_other(self) -> bool:
        """Attention projections and output layer / embedding are quantized too (int8, or
        4-bit rows where :func:`is_q4_other` says)."""
        return self.weights in QUANTIZED_OTHER

    @property
    def record_bytes(self) -> int:
        """Bytes of one neuron record (gate row + up row + down column, and their scales)."""
        if self.q4_ffn:
            return q4_record_bytes(self.hidden_size)
        if self.int8_ffn:
            return int8_record_bytes(self.hidden_size)
        return 3 * self.hidden_size * self.dtype.itemsize

    def decode_records(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Neuron records from their bytes ``raw`` (uint8 ``[n, record_bytes]``): values
        ``[n, 3, H]`` (int8, or the packed float dtype) and int8 scales ``[n, 3]`` (else None).
        4-bit records stay as they are (``raw``, None): their slots hold the records whole."""
        n, H = raw.shape[0], self.hidden_size
        if self.q4_ffn:
            return raw, None
        if not self.int8_ffn:
            return raw.view(self.dtype).view(n, 3, H), None
        return int8_record_parts(raw, H)

    def dequantize_records(self, raw: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``[n, 3, H]`` (gate, up, down column) of records ``raw``."""
        if self.q4_ffn:
            return q4_record_rows(raw, self.hidden_size)
        vals, scales = self.decode_records(raw)
        return vals.float() * scales[..., None] if scales is not None else vals.float()

    @property
    def ffn_bytes(self) -> int:
        return self.num_layers * self.intermediate_size * self.record_bytes


def fingerprint(model_type: str, num_layers: int, hidden: int, inter: int, source_sha256: str) -> str:
    """Short identity of a model's weights; profiles carry it and are refused on a mismatch."""
    raw = f"{model_type}:{num_layers}:{hidden}:{inter}:{source_sha256}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def is_packed(path: str | Path) -> bool:
    """A complete packed folder of this build's format version."""
    path = Path(path)
    if not all((path / f).exists() for f in (MANIFEST, FFN_FILE, OTHER_FILE, CHECKSUM_FILE,
                                             "config.json")):
        return False
    try:
        raw = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return raw.get("version") == FORMAT_VERSION and (not raw.get("high") or
                                                     (path / HIGH_FILE).exists())


def word_sums(raw: torch.Tensor) -> torch.Tensor:
    """Checksums of the rows of ``raw`` (uint8 ``[n, B]``): the wrapping int64 sum of each row's
    words. Any change of a row's bytes that does not cancel out in the sum is caught; at ~10 GB/s
    on one core it is cheap enough to check every record the loader reads."""
    n, nbytes = raw.shape
    if nbytes % 8 == 0:
        return raw.view(torch.int64).sum(dim=1)
    if nbytes % 4 == 0:
        return raw.view(torch.int32).sum(dim=1, dtype=torch.int64)
    return raw.sum(dim=1, dtype=torch.int64)


def tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """The ``[1]`` checksum of one whole tensor (its bytes as one row)."""
    return word_sums(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).view(1, -1))


def read_checksums(m: "Manifest") -> dict[str, torch.Tensor]:
    """The packed folder's checksums (int64 tensors by name)."""
    path = m.path / CHECKSUM_FILE
    tensors, meta, _ = read_header(path)
    if meta.get("fingerprint") != m.fingerprint:
        raise FormatError(f"{path}: fingerprint {meta.get('fingerprint')!r} does not match "
                          f"manifest {m.fingerprint!r} (file from another model)")
    with CountingReader(path) as r:
        return {k: r.read_tensor(v) for k, v in tensors.items()}


def checksum_error(path: Path, what: str) -> FormatError:
    return FormatError(f"{path}: checksum mismatch in {what}: the file is corrupt; run "
                       f"`selectinfer verify --model {path.parent}` and re-pack the model")


def verify(path: str | Path, log: Callable[[str], None] = print) -> list[str]:
    """Check every neuron record and every tensor of a packed folder against its checksums.
    Returns the problems found (empty: the folder is intact)."""
    m = read_manifest(path)
    sums = read_checksums(m)
    problems: list[str] = []
    for high in (False, True) if m.high else (False,):
        ffn, name = check_ffn_file(m, high), HIGH_FILE if high else FFN_FILE
        with CountingReader(m.path / name) as r:
            for layer in progress(range(m.num_layers), desc=f"verify {name} layers"):
                raw = r.read_tensor(ffn[neuron_key(layer)]).view(torch.uint8).view(
                    m.intermediate_size, -1)
                sum_key = high_sum_key(layer) if high else neuron_key(layer)
                bad = torch.nonzero(word_sums(raw) != sums[sum_key]).flatten().tolist()
                if bad:
                    problems.append(f"{name}: layer {layer}: {len(bad)} corrupt neuron "
                                    f"record(s) (first: {bad[:5]})")
    tensors, _, _ = read_header(m.path / OTHER_FILE)
    with CountingReader(m.path / OTHER_FILE) as r:
        for name, info in progress(list(tensors.items()), desc="verify other tensors"):
            if name not in sums:
                problems.append(f"{OTHER_FILE}: {name}: no checksum")
            elif not torch.equal(tensor_sum(r.read_tensor(info)), sums[name]):
                problems.append(f"{OTHER_FILE}: {name}: checksum mismatch")
    log(f"[verify] {m.path}: {m.num_layers} FFN layers, {len(tensors)} other tensors: "
        + ("intact" if not problems else f"{len(problems)} problem(s)"))
    return problems


def read_manifest(path: str | Path) -> Manifest:
    """Read and check ``manifest.json`` of a packed folder; refuses unknown or corrupt ones."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.exists():
        raise FileNotFoundError(f"{path} is not a packed model (no {MANIFEST}); "
                                f"create one with `selectinfer pack HF_DIR {path}`")
    try:
        raw = json.loads(mf.read_text())
        if raw.get("format") != FORMAT:
            raise FormatError(f"{mf}: format {raw.get('format')!r}, expected {FORMAT!r}")
        if raw.get("version") != FORMAT_VERSION:
            raise FormatError(f"{mf}: format version {raw.get('version')}, this build reads "
                              f"{FORMAT_VERSION}; re-pack the model")
        m = Manifest(raw["model_id"], raw["model_type"], int(raw["num_layers"]),
                     int(raw["hidden_size"]), int(raw["intermediate_size"]),
                     getattr(torch, raw["dtype"]), raw["source_sha256"], raw["fingerprint"], path,
                     raw.get("weights", "float"), raw.get("high", ""))
        if m.weights not in WEIGHTS:
            raise FormatError(f"{mf}: weights {m.weights!r}, expected one of {', '.join(WEIGHTS)}")
        if m.high not in ("", "int8"):
            raise FormatError(f"{mf}: high tier {m.high!r}, expected int8 or none")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{mf}: corrupt manifest ({e})") from e
    if m.fingerprint != fingerprint(m.model_type, m.num_layers, m.hidden_size,
                                    m.intermediate_size, m.source_sha256):
        raise FormatError(f"{mf}: fingerprint does not match the manifest's own fields")
    return m


def check_ffn_file(m: Manifest, high: bool = False) -> dict:
    """Header of ``ffn.safetensors`` (``high``: of HIGH_FILE, the int8 records of a 4-bit
    pack's high tier), checked against the manifest (shape, dtype, size)."""
    if high and m.high != "int8":
        raise FormatError(f"{m.path}: no high tier of int8 records (a 4-bit pack of this build "
                          f"has one: `selectinfer pack --weights q4`)")
    path = m.path / (HIGH_FILE if high else FFN_FILE)
    tensors, meta, _ = read_header(path)
    if meta.get("fingerprint") != m.fingerprint:
        raise FormatError(f"{path}: fingerprint {meta.get('fingerprint')!r} does not match "
                          f"manifest {m.fingerprint!r} (file from another model)")
    if high:
        want, want_dtype = (m.intermediate_size, int8_record_bytes(m.hidden_size)), torch.uint8
    elif m.quantized_ffn:
        want, want_dtype = (m.intermediate_size, m.record_bytes), torch.uint8
    else:
        want, want_dtype = (m.intermediate_size, 3, m.hidden_size), m.dtype
    for layer in range(m.num_layers):
        info = tensors.get(neuron_key(layer))
        if info is None:
            raise FormatError(f"{path}: missing tensor {neuron_key(layer)}")
        if info.shape != want or info.dtype != want_dtype:
            raise FormatError(f"{path}: {neuron_key(layer)} is {info.dtype} {info.shape}, manifest "
                              f"says {want_dtype} {want}")
    return tensors


def source_checksum(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        with open(f, "rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)
    return h.hexdigest()


def is_int8_other(name: str, shape: tuple[int, ...]) -> bool:
    """A non-FFN tensor that ``--weights int8`` stores as int8 rows: attention projections, the
    token embedding and a separate output layer (norms and biases stay float)."""
    return len(shape) == 2 and (name.endswith("_proj.weight") or name.endswith(
        "embed_tokens.weight") or name == "lm_head.weight")


def int8_records(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Neuron records with int8 rows: uint8 ``[I, 3 * H + 12]`` from gate, up ``[I, H]`` and down
    ``[H, I]`` (each row of each neuron quantized with its own scale)."""
    from .int8 import quantize_rows
    rows = torch.stack([gate, up, down.t()], dim=1)  # [I, 3, H]
    q, scale = quantize_rows(rows)  # [I, 3, H] int8, [I, 3] float32
    I = rows.shape[0]
    return torch.cat([q.view(torch.uint8).view(I, -1), scale.contiguous().view(torch.uint8).view(I, -1)],
                     dim=1)


def q4_record_bytes(hidden: int) -> int:
    """Bytes of a 4-bit neuron record: three rows of ``H / 2`` nibble bytes and ``ceil(H / 256)``
    16-byte heads (:mod:`.q4`)."""
    from .q4 import row_bytes
    return 3 * sum(row_bytes(hidden))


def q4_records(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               importance: torch.Tensor | None = None) -> torch.Tensor:
    """Neuron records with 4-bit rows: uint8 ``[I, q4_record_bytes(H)]`` from gate, up ``[I, H]``
    and down ``[H, I]``: the nibbles of gate row, up row and down column (along H), then their
    heads (layout of :func:`.q4.quantize`); ``importance`` ``[H]`` weighs the gate and up rows'
    columns (the mean square of the MLP's input), when known."""
    from .q4 import check_width, quantize
    I, H = gate.shape
    check_width(H)
    nib_gu, head_gu = quantize(torch.cat([gate, up]), importance)  # [2I, H / 2], [2I, hb]
    nib_d, head_d = quantize(down.t().contiguous())
    return torch.cat([nib_gu[:I], nib_gu[I:], nib_d, head_gu[:I], head_gu[I:], head_d], dim=1)


def q4_record_rows(raw: torch.Tensor, hidden: int) -> torch.Tensor:
    """The float32 rows ``[n, 3, H]`` (gate, up, down column) that 4-bit records ``raw`` hold."""
    from .q4 import dequantize, record_parts
    return torch.stack([dequantize(*record_parts(raw, hidden, r)) for r in range(3)], dim=1)


def is_q4_other(name: str, shape: tuple[int, ...], weights: str, tied: bool = False) -> bool:
    """A non-FFN tensor that ``weights`` stores as 4-bit rows: with ``q4-all`` the ones
    :func:`is_int8_other` names, with ``q4-out8`` those but the output layer (a separate
    ``lm_head``, or the token embedding that a ``tied`` output layer shares), with ``int8-q4emb``
    the token embedding and output layer (others: none; rows whose length is not a multiple of 64
    stay int8)."""
    if not is_int8_other(name, shape) or shape[1] % 64:
        return False
    if weights == "q4-out8":
        return name != "lm_head.weight" and not (tied and name.endswith("embed_tokens.weight"))
    return weights == "q4-all" or (weights == "int8-q4emb" and not name.endswith("_proj.weight"))


def pack(src: str | Path, out: str | Path, model_id: str | None = None,
         dtype: torch.dtype | None = None, weights: str = "float",
         log: Callable[[str], None] = print) -> Manifest:
    """Convert a Hugging Face checkpoint folder into a packed folder (layer by layer);
    ``weights`` int8 / int8-ffn / int8-q4emb stores int8 rows with per-row scales, q4 / q4-all
    4-bit rows (see the module doc)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    from transformers import AutoConfig

    src, out = Path(src), Path(out)
    config = AutoConfig.from_pretrained(src)
    if getattr(config, "text_config", None) is not None and config.model_type not in ("gemma3_text",):
        raise ValueError(f"{src}: {config.model_type} is a multimodal wrapper; pack its text model")
    arch = architecture_for(config)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors files (convert .bin checkpoints first)")
    t0 = time.perf_counter()
    log(f"[pack] checksumming {len(files)} source file(s) ...")
    sha = source_checksum(files)
    L, H, I = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    probe = where[arch.ffn_key(0, "gate")].get_slice(arch.ffn_key(0, "gate"))
    src_dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[probe.get_dtype()])
    dtype = dtype or src_dtype
    fp = fingerprint(config.model_type, L, H, I, sha)
    model_id = model_id or src.name
    tmp = temp_dir_beside(out)
    sums: dict[str, torch.Tensor] = {}

    meta = {"fingerprint": fp, "format": FORMAT, "version": str(FORMAT_VERSION)}
    int8_ffn, q4_ffn = weights in INT8_WEIGHTS, weights in Q4_WEIGHTS
    if q4_ffn and H % 64:
        raise ValueError(f"--weights {weights}: 4-bit records need a hidden size that is a "
                         f"multiple of 64, {src} has {H}")
    rec_spec = ((torch.uint8, (I, q4_record_bytes(H))) if q4_ffn else
                (torch.uint8, (I, 3 * H + 12)) if int8_ffn else (dtype, (I, 3, H)))
    ffn = StreamWriter(tmp / FFN_FILE, {neuron_key(l): rec_spec for l in range(L)}, meta)
    high = StreamWriter(tmp / HIGH_FILE, {neuron_key(l): (torch.uint8, (I, int8_record_bytes(H)))
                                          for l in range(L)}, meta) if q4_ffn else None
    for layer in progress(range(L), desc="pack FFN layers", total=L):
        gate = where[arch.ffn_key(layer, "gate")].get_tensor(arch.ffn_key(layer, "gate"))  # [I, H]
        up = where[arch.ffn_key(layer, "up")].get_tensor(arch.ffn_key(layer, "up"))  # [I, H]
        down = where[arch.ffn_key(layer, "down")].get_tensor(arch.ffn_key(layer, "down"))  # [H, I]
        if gate.shape != (I, H) or up.shape != (I, H) or down.shape != (H, I):
            raise FormatError(f"{src}: layer {layer} FFN shapes {tuple(gate.shape)}, "
                              f"{tuple(up.shape)}, {tuple(down.shape)} do not match the config")
        if q4_ffn:
            rec = q4_records(gate, up, down)
        elif int8_ffn:
            rec = int8_records(gate, up, down)
        else:
            rec = torch.stack([gate, up, down.t()], dim=1).to(dtype).contiguous()  # [I, 3, H]
        sums[neuron_key(layer)] = word_sums(rec.view(torch.uint8).view(I, -1))
        ffn.write(neuron_key(layer), rec)
        if high is not None:  # the high tier: every neuron as an int8 record too
            rec8 = int8_records(gate, up, down)
            sums[high_sum_key(layer)] = word_sums(rec8)
            high.write(neuron_key(layer), rec8)
    ffn.close()
    if high is not None:
        high.close()

    others = sorted(k for k in where if not arch.is_ffn_key(k))
    specs = {}
    for k in others:
        shape = tuple(where[k].get_slice(k).get_shape())
        if is_q4_other(k, shape, weights, tied="lm_head.weight" not in where):
            from .q4 import row_bytes
            nib, head = row_bytes(shape[1])
            specs[k] = (torch.uint8, (shape[0], nib))
            specs[k.removesuffix(".weight") + ".scale"] = (torch.uint8, (shape[0], head))
        elif weights in QUANTIZED_OTHER and is_int8_other(k, shape):
            specs[k] = (torch.int8, shape)
            specs[k.removesuffix(".weight") + ".scale"] = (torch.float32, shape[:1])
        else:
            specs[k] = (dtype, shape)
    w = StreamWriter(tmp / OTHER_FILE, specs, meta)
    for k in progress(others, desc="pack other tensors", total=len(others)):
        t = where[k].get_tensor(k)
        if specs[k][0] == torch.uint8:
            from .q4 import quantize
            nib, head = quantize(t)
            parts = {k: nib, k.removesuffix(".weight") + ".scale": head}
        elif specs[k][0] == torch.int8:
            from .int8 import quantize_rows
            q, scale = quantize_rows(t)
            parts = {k: q, k.removesuffix(".weight") + ".scale": scale}
        else:
            parts = {k: t.to(dtype)}
        for name, part in parts.items():
            sums[name] = tensor_sum(part)
            w.write(name, part)
    w.close()
    cw = StreamWriter(tmp / CHECKSUM_FILE, {k: (torch.int64, tuple(v.shape)) for k, v in sums.items()},
                      meta)
    for k, v in sums.items():
        cw.write(k, v)
    cw.close()

    shutil.copy(src / "config.json", tmp / "config.json")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "model_id": model_id,
                "model_type": config.model_type, "num_layers": L, "hidden_size": H,
                "intermediate_size": I, "dtype": str(dtype).removeprefix("torch."), "weights": weights,
                "high": "int8" if q4_ffn else "",
                "source_sha256": sha, "fingerprint": fp, "source": str(src.resolve())}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    publish_dir(tmp, out)
    log(f"[pack] {model_id}: {L} layers x {I} neurons -> {out} in {time.perf_counter() - t0:.1f} s")
    return read_manifest(out)
