"""Selective loading: build a model from a packed folder, reading only the selected neurons.

The model skeleton is built on the meta device (no full-size FFN is ever allocated), the
non-FFN tensors are read straight into their final tensors, and each layer's selected neuron
records are read in coalesced runs through a small bounce buffer into compact slot buffers.
Every byte read is counted.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..format.architectures import activation_name, architecture_for
from ..format.int8 import Int8Embedding, Int8Linear, kernel_status, tile_int8_layers, tiles_pay
from ..format import q4
from ..format.q4 import Q4Embedding, Q4Linear, interleave_q4_layers
from ..options import COMPUTE_MODES, SELECTIONS, check_ratios
from ..format.pack import (FFN_FILE, HIGH_FILE, OTHER_FILE, Manifest, check_ffn_file, checksum_error,
                           high_sum_key, int8_record_bytes, int8_record_parts, neuron_key,
                           read_checksums, read_manifest, tensor_sum, word_sums)
from .profiles import (ProfileCatalog, Selection, neuron_count, select_published, select_random,
                       select_sensitivity, select_shared_sensitivity)
from ..format.progress import progress
from ..format.safetensors_io import CountingReader, FormatError, read_header
from ..format.tokenizer import load_tokenizer
from . import token_rule
from .selective_mlp import SelectionState, SelectiveMLP, Slots, TieredMLP

BOUNCE_BYTES = 8 << 20  # bounce buffer for coalesced neuron reads


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return names[dtype]


def activation_dtype(dtype: str | torch.dtype | None, manifest: Manifest,
                     device: str | torch.device) -> torch.dtype:
    """The dtype a selective model computes in: ``dtype`` when given, else float32 on the CPU
    for a pack whose attention, neurons and output layer are all int8 or 4-bit (the decode
    kernel's step runs on float32 activations, and what stays float is only norms and tables),
    else the packed dtype."""
    if dtype not in (None, "", "auto"):
        return resolve_dtype(dtype, manifest.dtype)
    if torch.device(device).type == "cpu" and manifest.int8_other:
        return torch.float32
    return manifest.dtype


def build_skeleton(path: Path, dtype: torch.dtype):
    """The transformers model of a packed folder on the meta device, and its config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path)
    architecture_for(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, config


def _int8_modules(model: nn.Module, tensors: dict, dtype: torch.dtype) -> None:
    """Swap the linear layers (and the token embedding) whose weights the packed file holds as
    int8 (4-bit: uint8 nibbles) for int8 (4-bit) modules; a tied output layer shares the
    embedding's rows. A layer with a bias (Qwen2's q/k/v projections: ``<path>.bias`` in the
    file, float) keeps one, under the same name."""
    for name, info in tensors.items():
        if info.dtype not in (torch.int8, torch.uint8) or not name.endswith(".weight"):
            continue
        four = info.dtype == torch.uint8
        path = name.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        n, k = info.shape[0], info.shape[1] * (2 if four else 1)
        if isinstance(old, nn.Embedding):
            scale = getattr(old, "scalar_embed_scale", None)
            emb = (Q4Embedding if four else Int8Embedding)(n, k, old.padding_idx, scale)
            emb.dtype = dtype
            setattr(parent, attr, emb)
        else:
            bias = f"{path}.bias" in tensors or getattr(old, "bias", None) is not None
            setattr(parent, attr, (Q4Linear if four else Int8Linear)(n, k, bias=bias))


def _load_other(model: nn.Module, config, path: Path, dtype: torch.dtype,
                device: torch.device, reader: CountingReader, manifest: Manifest,
                sums: dict[str, torch.Tensor]) -> None:
    """Read every non-FFN tensor into the skeleton (each checked against its checksum), tie
    embeddings, rebuild computed buffers. int8 tensors and their scales keep their dtype."""
    tensors, meta, _ = read_header(path / OTHER_FILE)
    if meta.get("fingerprint") != manifest.fingerprint:
        raise FormatError(f"{path / OTHER_FILE}: fingerprint {meta.get('fingerprint')!r} does not "
                          f"match manifest {manifest.fingerprint!r} (file from another model)")
    if manifest.int8_other:
        _int8_modules(model, tensors, dtype)
    state = {}
    expected = {k: v for k, v in model.state_dict().items()}
    for name, info in tensors.items():
        if name not in expected:
            raise FormatError(f"{path / OTHER_FILE}: unexpected tensor {name!r} for {config.model_type}")
        if tuple(expected[name].shape) != info.shape:
            raise FormatError(f"{path / OTHER_FILE}: {name} has shape {info.shape}, model needs "
                              f"{tuple(expected[name].shape)}")
        t = reader.read_tensor(info)
        if name not in sums or not torch.equal(tensor_sum(t), sums[name]):
            raise checksum_error(path / OTHER_FILE, f"tensor {name}")
        keep = info.dtype in (torch.int8, torch.uint8) or (
            name.endswith(".scale") and expected[name].dtype == info.dtype)
        state[name] = t.to(device=device) if keep else t.to(device=device, dtype=dtype)
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        emb = model.get_input_embeddings()
        if isinstance(emb, (Int8Embedding, Q4Embedding)):
            model.lm_head = emb.as_linear()
            missing = [m for m in missing if m not in ("lm_head.weight", "lm_head.scale")]
        else:
            model.lm_head.weight = emb.weight
            missing = [m for m in missing if m != "lm_head.weight"]
    missing = [m for m in missing if ".mlp." not in m]
    if missing:
        raise FormatError(f"{path / OTHER_FILE}: missing tensors {missing[:5]}")
    _rebuild_computed_buffers(model, config, device)
    tile_int8_layers(model)
    interleave_q4_layers(model)


def _rebuild_computed_buffers(model: nn.Module, config, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies, embedding scale) are not in any file."""
    for name, module in list(model.named_modules()):
        if "RotaryEmbedding" in type(module).__name__:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            with torch.device("cpu"):
                fresh = type(module)(config=config)
            setattr(parent, name.rsplit(".", 1)[-1], fresh.to(device))
        elif hasattr(module, "scalar_embed_scale"):
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers not materialised: {left[:5]}")


def _read_neurons(reader: CountingReader, start: int, record_bytes: int, ids: torch.Tensor,
                  sink: Callable[[torch.Tensor, torch.Tensor], None], sums: torch.Tensor,
                  what: str) -> int:
    """Read the records ``ids`` (any order) in coalesced runs of consecutive ids, several runs
    per bounce-buffer fill; each fill is checked against the record checksums ``sums`` ``[I]``
    in one pass, then ``sink(positions, records)`` receives positions into ``ids`` and the
    records' bytes ``[n, record_bytes]``. Returns records read."""
    if ids.numel() == 0:
        return 0
    order = torch.argsort(ids)
    sorted_ids = ids[order]
    idx = sorted_ids.tolist()
    per_chunk = max(1, BOUNCE_BYTES // record_bytes)
    bounce = torch.empty(min(per_chunk, len(idx)) * record_bytes, dtype=torch.uint8)
    i = 0
    while i < len(idx):
        end = min(len(idx), i + per_chunk)  # one fill: records idx[i:end], run by run
        j = i
        while j < end:
            k = j + 1
            while k < end and idx[k] == idx[k - 1] + 1:
                k += 1
            reader.read_into(start + idx[j] * record_bytes,
                             bounce[(j - i) * record_bytes:(k - i) * record_bytes])
            j = k
        n = end - i
        buf = bounce[: n * record_bytes]
        bad = word_sums(buf.view(n, record_bytes)) != sums.index_select(0, sorted_ids[i:end])
        if bool(bad.any()):
            first = idx[i + int(torch.nonzero(bad)[0])]
            raise checksum_error(reader.path, f"{what}, neuron record {first}")
        sink(order[i:end], buf.view(n, record_bytes))
        i = end
    return len(idx)


class SwitchCanceled(Exception):
    """A task switch stopped before it changed anything."""


@dataclass
class SwitchReport:
    task: str
    seconds: float
    bytes_read: int
    neurons_read: int
    neurons_dropped: int
    neurons_retiered: int = 0  # of those read: resident before, in the other tier (promoted or
    # demoted, read again from that tier's records)


@dataclass(frozen=True)
class RecordSource:
    """A file of neuron records: the pack's own (``ffn.safetensors``) or, the high tier of a
    4-bit pack, its int8 records (``ffn-high.safetensors``)."""

    path: Path
    tensors: dict  # the header's tensor infos, by neuron_key
    record_bytes: int
    high: bool

    @classmethod
    def of(cls, m: Manifest, high: bool = False) -> "RecordSource":
        return cls(m.path / (HIGH_FILE if high else FFN_FILE), check_ffn_file(m, high),
                   int8_record_bytes(m.hidden_size) if high else m.record_bytes, high)

    def sum_key(self, layer: int) -> str:
        return high_sum_key(layer) if self.high else neuron_key(layer)

    def decode(self, raw: torch.Tensor, m: Manifest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Records' bytes -> what the slots take (see :meth:`Manifest.decode_records`)."""
        return int8_record_parts(raw, m.hidden_size) if self.high else m.decode_records(raw)


def check_int8_ratio(int8_ratio: float, load_ratio: float, m: Manifest) -> float:
    """``int8_ratio`` as loaded (0 <= it <= load_ratio, > 0 only for a pack with a high tier),
    else ValueError with the reason."""
    if not 0.0 <= int8_ratio <= 1.0:
        raise ValueError(f"int8_ratio must be in [0, 1], got {int8_ratio}")
    if int8_ratio > load_ratio:
        raise ValueError(f"int8_ratio {int8_ratio} exceeds load_ratio {load_ratio}: the int8 tier "
                         f"is a share of the resident neurons")
    if int8_ratio > 0 and m.high != "int8":
        raise ValueError(f"int8_ratio {int8_ratio} needs 4-bit records with an int8 high tier "
                         f"(weights q4, q4-out8 or q4-all, packed by this version); {m.path} holds "
                         f"{m.weights} records")
    return int8_ratio


class SelectiveModel:
    """A transformers causal LM whose FFNs hold only the selected neurons of a packed model."""

    def __init__(self, packed_dir: str | Path, profiles_dir: str | Path | None = None,
                 task: str | None = None, *, load_ratio: float = 1.0,
                 static_ratio: float | None = None, compute_ratio: float | None = None,
                 alpha: float = 0.2, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 dense_layers: int = 0, selection: str = "auto", compute_mode: str = "prompt",
                 int8_ratio: float = 0.0, log: Callable[[str], None] = lambda s: None):
        """Load ``packed_dir`` with ``load_ratio`` of each layer's neurons for ``task`` (the
        catalogue's general profile when None). ``static_ratio``/``compute_ratio`` None = ``load_ratio``;
        the serving path resolves all three once (:class:`~..options.Ratios`) and passes them.
        ``compute_mode``: ``prompt`` (the prompt chooses one set for every decode token, as
        published) or ``token`` (each decode token chooses, :mod:`.token_rule`; thresholds from
        the task's profile). ``int8_ratio`` > 0 (a 4-bit pack): tiered records, the first
        ``int8_ratio`` of the neurons per layer in the selection's order (the task's base
        neurons, then the secondary ones) resident as int8 records, the rest as 4-bit ones."""
        t0 = time.perf_counter()
        self.path = Path(packed_dir)
        self.manifest = read_manifest(self.path)
        self.sums = read_checksums(self.manifest)
        self.device = torch.device(device)
        self.dtype = activation_dtype(dtype, self.manifest, self.device)
        self.dense_layers = dense_layers
        self.log = log
        self.catalog = ProfileCatalog(profiles_dir, self.manifest) if profiles_dir else None
        if selection == "auto":  # shared per-layer budgets when the profiles carry the measurement:
            # cross-task secondary neurons hold up best on prompts phrased unlike the profiling set
            has = self.catalog is not None and all("sensitivity" in p.extra
                                                   for p in self.catalog.profiles.values())
            selection = "shared-sensitivity" if has else "published"
        if selection not in SELECTIONS:
            raise ValueError(f"unknown selection strategy {selection!r}; choose from {', '.join(SELECTIONS)}")
        self.selection_strategy = selection
        if compute_mode not in COMPUTE_MODES:
            raise ValueError(f"unknown compute_mode {compute_mode!r}; choose from {', '.join(COMPUTE_MODES)}")
        self.compute_mode = compute_mode
        static_ratio = load_ratio if static_ratio is None else static_ratio
        compute_ratio = load_ratio if compute_ratio is None else compute_ratio
        check_ratios(load_ratio, static_ratio, compute_ratio)
        if load_ratio < 1.0 and self.catalog is None and selection != "random":
            raise ValueError("load_ratio < 1 needs a profiles folder to choose neurons")
        self.load_ratio, self.static_ratio, self.compute_ratio = load_ratio, static_ratio, compute_ratio
        self.int8_ratio = check_int8_ratio(int8_ratio, load_ratio, self.manifest)
        self.sources = {"main": RecordSource.of(self.manifest)}
        if self.int8_ratio > 0:
            self.sources["high"] = RecordSource.of(self.manifest, high=True)
        self.task = task if task else (self.catalog.default_task if self.catalog else "")
        if self.catalog is not None:
            self.catalog.get(self.task)

        self.model, self.config = build_skeleton(self.path, self.dtype)
        self.state = SelectionState()
        self.state.alpha = alpha
        self.state.per_token = compute_mode == "token"
        self.state.kept = torch.zeros(self.manifest.num_layers, dtype=torch.int64)
        self.state.candidates = torch.zeros(self.manifest.num_layers, dtype=torch.int64)
        self.token_tables = self._token_tables(self.task) if self.state.per_token else None
        act = activation_name(self.config)
        self.mlps: list[SelectiveMLP | TieredMLP] = []
        for layer, block in enumerate(self.model.model.layers):
            stores = [SelectiveMLP(self.manifest.hidden_size, act, self.state, layer, self.dtype,
                                   self.device) for _ in self.sources]
            for store, source in zip(stores, ("main", "high")):
                store.source = source
            block.mlp = stores[0] if len(stores) == 1 else TieredMLP(hi=stores[1], lo=stores[0])
            self.mlps.append(block.mlp)
        with CountingReader(self.path / OTHER_FILE) as r:
            _load_other(self.model, self.config, self.path, self.dtype, self.device, r, self.manifest,
                        self.sums)
            self.bytes_read = r.bytes_read
        sel = self._selection(self.task)
        readers = self._readers()
        try:
            for layer in progress(range(self.manifest.num_layers), desc="load FFN neurons"):
                for store, ids, n_static in self._tiers(layer, sel):
                    self._load_layer(readers[store.source], store, layer, ids, n_static)
        finally:
            self.bytes_read += sum(r.bytes_read for r in readers.values())
            for r in readers.values():
                r.close()
        self.model.eval()
        self.set_compute_ratio(compute_ratio)
        if self.manifest.quantized_ffn:  # compiles the kernel now (once per machine), not at a goal
            how = (kernel_status() if self.device.type == "cpu"
                   else f"rows dequantized for float products on {self.device}")
            what = "int8" if not self.manifest.q4_ffn else (
                f"tiered (int8 {self.int8_ratio:g}, 4-bit the rest)" if self.int8_ratio else "4-bit")
            log(f"[load] {what} weights: {how}; {str(self.dtype).removeprefix('torch.')} "
                f"activations")
        self.load_seconds = time.perf_counter() - t0
        log(f"[load] {self.manifest.model_id} task={self.task or '-'} gamma={load_ratio} "
            f"phi={compute_ratio}: {self.bytes_read / 2**20:.1f} MiB read in {self.load_seconds:.2f} s")

    # -- selection -------------------------------------------------------------------------
    def _selection(self, task: str) -> Selection:
        m = self.manifest
        if self.selection_strategy == "random":
            sel = select_random(m.num_layers, m.intermediate_size, self.load_ratio, self.static_ratio)
        elif self.catalog is None:
            ids = torch.arange(m.intermediate_size)
            sel = Selection([ids] * m.num_layers, [neuron_count(self.static_ratio, m.intermediate_size)]
                            * m.num_layers)
        elif self.selection_strategy == "published":
            sel = select_published(self.catalog.get(task).scores, self.catalog.secondary_scores(),
                                   self.load_ratio, self.static_ratio)
        elif self.selection_strategy == "sensitivity":
            sel = select_sensitivity(self.catalog.get(task), self.load_ratio, self.static_ratio)
        elif self.selection_strategy == "shared-sensitivity":
            sel = select_shared_sensitivity(self.catalog.get(task), list(self.catalog.profiles.values()),
                                            self.load_ratio, self.static_ratio)
        else:
            raise ValueError(f"unknown selection strategy {self.selection_strategy!r}; "
                             f"choose from {', '.join(SELECTIONS)}")
        return self._with_dense_layers(sel)

    def _with_dense_layers(self, sel: Selection) -> Selection:
        """The first and last ``dense_layers`` layers keep every neuron (loaded and computed)."""
        L, I, d = self.manifest.num_layers, self.manifest.intermediate_size, self.dense_layers
        neurons, n_static = list(sel.neurons), list(sel.n_static)
        for layer in range(L):
            if layer < d or layer >= L - d:
                rest = torch.ones(I, dtype=torch.bool)
                rest[neurons[layer]] = False
                neurons[layer] = torch.cat([neurons[layer], torch.nonzero(rest).flatten()])
        return Selection(neurons, n_static)

    # -- loading ---------------------------------------------------------------------------
    def _readers(self) -> dict[str, CountingReader]:
        """An open reader per record file (close them)."""
        return {name: CountingReader(src.path) for name, src in self.sources.items()}

    def _tiers(self, layer: int, sel: Selection) -> list[tuple[SelectiveMLP, torch.Tensor, int]]:
        """Layer ``layer``'s stores with their neurons of ``sel`` (slot order) and static counts:
        the one store, or (tiered) the high tier's, the first ``int8_ratio`` of the neurons in the
        selection's order, and the low tier's, the rest."""
        ids, n_static = sel.neurons[layer], sel.n_static[layer]
        mlp = self.mlps[layer]
        if not isinstance(mlp, TieredMLP):
            return [(mlp, ids, n_static)]
        n = min(ids.numel(), neuron_count(self.int8_ratio, self.manifest.intermediate_size))
        return [(mlp.hi, ids[:n], min(n_static, n)), (mlp.lo, ids[n:], max(0, n_static - n))]

    def _empty_slots(self, k: int, source: str = "main") -> Slots:
        m = self.manifest
        int8_slots = m.int8_ffn or source == "high"
        records = m.q4_ffn and source == "main"
        return Slots.empty(k, m.hidden_size, self.dtype, int8_slots, self.device,
                           m.record_bytes if records else 0,
                           token_layout=self.state.per_token,
                           tiled=int8_slots and not self.state.per_token and tiles_pay(self.device),
                           grouped=records and not self.state.per_token and q4.groups_pay(self.device))

    def _load_layer(self, reader: CountingReader, mlp: SelectiveMLP, layer: int, ids: torch.Tensor,
                    n_static: int) -> int:
        """Fill store ``mlp`` of layer ``layer`` with neurons ``ids`` (slot order) read from disk.
        Returns records read."""
        slots = self._empty_slots(ids.numel(), mlp.source)
        got = self._read_into(reader, layer, ids, torch.arange(ids.numel()), slots, mlp.source)
        mlp.dense = layer < self.dense_layers or layer >= self.manifest.num_layers - self.dense_layers
        mlp.set_slots(slots, ids.to(self.device), n_static)
        return got

    def _read_into(self, reader: CountingReader, layer: int, ids: torch.Tensor, where: torch.Tensor,
                   slots: Slots, source: str = "main") -> int:
        """Read neuron records ``ids`` of ``source`` into slots ``where`` of ``slots``. Returns
        records read."""
        src = self.sources[source]

        def sink(positions: torch.Tensor, raw: torch.Tensor) -> None:  # raw [n, record_bytes]
            vals, scales = src.decode(raw, self.manifest)
            slots.put(where[positions].to(self.device), vals.to(self.device),
                      None if scales is None else scales.to(self.device))

        info = src.tensors[neuron_key(layer)]
        return _read_neurons(reader, info.start, src.record_bytes, ids, sink,
                             self.sums[src.sum_key(layer)], f"layer {layer}")

    def _stage_layer(self, reader: CountingReader, mlp: SelectiveMLP, layer: int, ids: torch.Tensor
                     ) -> tuple[torch.Tensor, Slots]:
        """Read the neurons of ``ids`` that are not resident in store ``mlp`` of layer ``layer``:
        (their ids in ``ids`` order, their records as slots ``0..n-1``). Changes nothing in the
        model."""
        resident = torch.zeros(self.manifest.intermediate_size, dtype=torch.bool)
        resident[mlp.slot_ids.cpu()] = True
        incoming = ids[~resident[ids]]
        staged = self._empty_slots(incoming.numel(), mlp.source)
        self._read_into(reader, layer, incoming, torch.arange(incoming.numel()), staged, mlp.source)
        return incoming, staged

    def _apply_layer(self, mlp: SelectiveMLP, ids: torch.Tensor, n_static: int,
                     incoming: torch.Tensor, staged: Slots) -> None:
        """Make store ``mlp`` hold ``ids`` in their order, as a fresh load does (base neurons
        ``ids[:n_static]`` the static prefix), from its resident neurons and the staged records
        of ``incoming``; no I/O."""
        inter = self.manifest.intermediate_size
        dev = self.device
        every = torch.arange(incoming.numel(), device=dev)
        where = torch.full((inter,), -1, dtype=torch.long)
        where[mlp.slot_ids.cpu()] = torch.arange(mlp.n_loaded)
        if mlp.n_loaded != ids.numel():  # per-layer budgets differ between tasks: new buffers
            old = where[ids]
            hit = old >= 0
            slots = self._empty_slots(ids.numel(), mlp.source)
            slots.copy(torch.nonzero(hit).flatten().to(dev), mlp.slots, old[hit].to(dev))
            miss = torch.nonzero(~hit).flatten().to(dev)  # ids[~hit] == incoming, same order
            slots.copy(miss, staged, every)
            mlp.set_slots(slots, ids.to(dev), n_static)
            return
        wanted = torch.zeros(inter, dtype=torch.bool)
        wanted[ids] = True
        free = torch.nonzero(~wanted[mlp.slot_ids.cpu()]).flatten().to(dev)  # dropped neurons' slots
        mlp.slots.copy(free, staged, every)
        mlp.slot_ids.index_copy_(0, free, incoming.to(dev))
        where[mlp.slot_ids.cpu()] = torch.arange(mlp.n_loaded)
        # in the task's own order, a fresh load's: the quantized products' blocks of 32 slots
        # then hold the same neurons, so the model computes exactly as a fresh load of the task
        mlp.slots.copy(torch.arange(ids.numel(), device=dev), mlp.slots, where[ids].to(dev))
        mlp.slot_ids.copy_(ids.to(dev))
        mlp.n_static = n_static
        mlp.state.residency += 1

    def switch_task(self, task: str, cancel: Callable[[], bool] | None = None) -> SwitchReport:
        """Load another task's base neurons in place, atomically: first every neuron not resident
        is read (and checked) for all layers, then, with no I/O left to fail, the layers take them
        into the slots of the dropped ones and move the new base neurons into the static prefix.
        A read error, or ``cancel()`` turning true while reading (polled between layers; raises
        :class:`SwitchCanceled`), leaves the model and its task as they were."""
        if self.catalog is None:
            raise ValueError("no profiles folder: cannot switch task")
        t0 = time.perf_counter()
        self.catalog.reload(task)
        tables = self._token_tables(task) if self.state.per_token else None  # refused before any read
        sel = self._selection(task)
        readers = self._readers()
        staged = []  # (store, ids, n_static, incoming, staged slots) of every layer and tier
        try:
            for layer in range(self.manifest.num_layers):
                if cancel is not None and cancel():
                    raise SwitchCanceled(f"switch to {task[:64]!r} canceled; {self.task!r} "
                                         f"stays active")
                for store, ids, n_static in self._tiers(layer, sel):
                    staged.append((store, ids, n_static,
                                   *self._stage_layer(readers[store.source], store, layer, ids)))
            nbytes = sum(r.bytes_read for r in readers.values())
        finally:
            for r in readers.values():
                r.close()
        # a neuron dropped leaves the layer; one that changes tier is read again, not dropped
        dropped = sum(int((~torch.isin(m.slot_ids.cpu(), sel.neurons[layer])).sum())
                      for layer, m in enumerate(self.mlps))
        moved = sum(int(inc.numel()) for _, _, _, inc, _ in staged) - sum(
            int((~torch.isin(sel.neurons[layer], m.slot_ids.cpu())).sum())
            for layer, m in enumerate(self.mlps))
        for store, ids, n_static, incoming, rec in staged:
            self._apply_layer(store, ids, n_static, incoming, rec)
        self.token_tables = tables
        self.task = task
        self.state.residency += 1
        self.set_compute_ratio(self.compute_ratio)
        read = sum(inc.numel() for _, _, _, inc, _ in staged)
        return SwitchReport(task, time.perf_counter() - t0, nbytes, read, dropped, moved)

    # -- runtime knobs -----------------------------------------------------------------------
    def set_compute_ratio(self, phi: float) -> None:
        """Neurons computed per decode step: phi * I per layer, or, where layers hold different
        numbers of neurons (per-layer budgets), the same share phi / gamma of each layer's."""
        check_ratios(self.load_ratio, self.static_ratio, phi)
        self.compute_ratio = phi
        if self.token_tables is not None:  # every loaded neuron may be computed: thresholds decide
            gate, act = token_rule.thresholds(*self.token_tables, phi)
            for mlp in self.mlps:
                for p in mlp.parts:
                    p.set_active(p.n_loaded)
                mlp.set_thresholds(*((0.0, 0.0) if mlp.dense else (gate[mlp.layer], act[mlp.layer])))
            return
        uniform = len({m.n_loaded for m in self.mlps}) == 1
        for mlp in self.mlps:
            if uniform and not isinstance(mlp, TieredMLP):
                mlp.set_active(neuron_count(phi, self.manifest.intermediate_size))
            else:  # per-layer budgets, or tiers: the same share phi / gamma of each store's
                for p in mlp.parts:
                    p.set_active(int(p.n_loaded * phi / self.load_ratio + 0.5))

    def _token_tables(self, task: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The task profile's per-token thresholds (refused, said why, when it has none)."""
        if self.catalog is None:
            raise ValueError("compute_mode 'token' needs a profiles folder (its thresholds)")
        prof = self.catalog.get(task)
        if token_rule.GATE_KEY not in prof.extra or token_rule.ACT_KEY not in prof.extra:
            raise ValueError(f"profile {task!r} has no per-token thresholds; run `selectinfer "
                             f"profile --calibrate-only` for it (or compute_mode 'prompt')")
        return prof.extra[token_rule.GATE_KEY].float(), prof.extra[token_rule.ACT_KEY].float()

    def counts(self) -> tuple[int, int, int]:
        """(decode tokens, neurons computed, candidates) so far, summed over layers (token mode;
        cumulative: :meth:`read_shares` takes the difference from an earlier reading)."""
        st = self.state
        return st.decoded, int(st.kept.sum()), int(st.candidates.sum())

    def read_shares(self, since: tuple[int, int, int] = (0, 0, 0),
                    until: tuple[int, int, int] | None = None) -> dict[str, float]:
        """Per decode token, as shares of all MLP neurons: ``computed_share`` (up and down read),
        ``candidate_share`` (up read) and ``read_share`` (the neuron rows read: gate, up and down
        count a third each). Prompt mode: the active prefix (phi). Token mode: measured from
        ``since`` to ``until`` (:meth:`counts` readings; ``until`` None: now; the torch path
        and the decode kernel count both), every loaded gate row read."""
        m = self.manifest
        if not self.state.per_token:
            phi = sum(x.n_active for x in self.mlps) / (m.num_layers * m.intermediate_size)
            return {"computed_share": phi, "candidate_share": phi, "read_share": phi}
        tokens, kept, cand = (a - b for a, b in zip(until or self.counts(), since))
        total = max(1, tokens) * m.num_layers * m.intermediate_size
        kept, cand = kept / total, cand / total
        loaded = sum(x.n_loaded for x in self.mlps) / (m.num_layers * m.intermediate_size)
        return {"computed_share": kept, "candidate_share": cand,
                "read_share": (loaded + cand + kept) / 3}

    def share_rows(self, rows: int) -> None:
        """Room for the masks of ``rows`` KV slots whose requests decode together, each computing
        its own neurons of one shared prefix (:meth:`SelectiveMLP.place`)."""
        for m in self.mlps:
            m.share_rows(rows)

    def release_row(self, row: int) -> None:
        """The request of KV slot ``row`` left its batch (:meth:`SelectiveMLP.release_row`)."""
        for m in self.mlps:
            m.release_row(row)

    @property
    def stores(self) -> list[SelectiveMLP]:
        """Every layer's neuron stores in order: the layer's one, or its tiers (high, low)."""
        return [p for m in self.mlps for p in m.parts]

    def residency_key(self) -> str:
        """A digest of the resident neurons of every layer (what a prompt's keys and values depend
        on besides its tokens and the weights): equal keys, equal prefill arithmetic."""
        version = self.state.residency
        cached = getattr(self, "_residency", None)
        if cached is None or cached[0] != version:
            h = hashlib.sha1(str(self.path.resolve()).encode())
            for m in self.stores:  # a tier's neurons apart: their precision is in the arithmetic
                h.update(torch.sort(m.slot_ids.cpu())[0].numpy().tobytes())
                h.update(b"|" + m.source.encode() + b"|")
            cached = self._residency = (version, h.hexdigest())
        return cached[1]

    def active_neuron_ids(self) -> list[torch.Tensor]:
        """Per layer, the neuron ids computed in decode (after the last prefill's selection)."""
        return [torch.cat([p.slot_ids[: p.n_active].cpu() for p in m.parts]) for m in self.mlps]

    def loaded_neuron_ids(self) -> list[torch.Tensor]:
        return [m.slot_ids.cpu() for m in self.mlps]

    def high_neuron_ids(self) -> list[torch.Tensor]:
        """Per layer, the neurons resident in the high tier (int8 records; none untiered)."""
        return [m.hi.slot_ids.cpu() if isinstance(m, TieredMLP) else torch.zeros(0, dtype=torch.long)
                for m in self.mlps]

    def weight_bytes(self) -> dict[str, int]:
        ffn = sum(m.weight_bytes() for m in self.mlps)
        seen, other = set(), 0
        int8 = [t for mod in self.model.modules()
                if isinstance(mod, (Int8Linear, Int8Embedding, Q4Linear, Q4Embedding))
                for t in mod.buffers()]
        for t in list(self.model.parameters()) + int8:
            if id(t) not in seen:
                seen.add(id(t))
                other += t.numel() * t.element_size()
        return {"ffn": ffn, "other": other, "total": ffn + other}

    @property
    def tokenizer(self):
        """The packed folder's tokenizer (loaded on first use; a caller may set one it holds)."""
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        self._tokenizer = tok


def dense_layer_count(num_layers: int, dense_layers: int) -> int:
    """Layers kept dense by ``dense_layers`` (the first and the last that many)."""
    return sum(1 for layer in range(num_layers)
               if layer < dense_layers or layer >= num_layers - dense_layers)


def other_bytes_estimate(m: Manifest, dtype: torch.dtype) -> int:
    """Resident bytes of the non-FFN tensors of a packed model in ``dtype`` (int8 and 4-bit rows
    and their scales as stored, also in the CPU's interleaved layout)."""
    tensors, _, _ = read_header(m.path / OTHER_FILE)

    def resident(name: str, t) -> int:
        if t.dtype in (torch.int8, torch.uint8) or name.endswith(".scale"):
            return t.nbytes
        return t.nbytes // t.dtype.itemsize * dtype.itemsize
    return sum(resident(name, t) for name, t in tensors.items())


def neuron_bytes(m: Manifest, dtype: torch.dtype) -> int:
    """Resident bytes of one neuron of one layer (int8 rows and scales, 4-bit records, also in the
    CPU's groups, or three rows in ``dtype``)."""
    return m.record_bytes if m.quantized_ffn else 3 * m.hidden_size * dtype.itemsize


def load_ratio_for_budget(m: Manifest, dtype: torch.dtype, budget: int, dense_layers: int = 0) -> float:
    """The largest load_ratio whose resident weights fit ``budget`` bytes, counting the layers
    that ``dense_layers`` keeps whole (the ratio applies to the other layers)."""
    other = other_bytes_estimate(m, dtype)
    neuron = neuron_bytes(m, dtype)
    dense = dense_layer_count(m.num_layers, dense_layers)
    fixed = other + dense * m.intermediate_size * neuron
    sparse = m.num_layers - dense
    if sparse == 0:
        if fixed > budget:
            raise ValueError(f"memory budget {budget / 2**30:.3f} GiB is below the dense model's "
                             f"{fixed / 2**30:.3f} GiB (dense_layers={dense_layers} keeps every layer)")
        return 1.0
    n = min(m.intermediate_size, max(0, (budget - fixed) // (sparse * neuron)))
    if n < 0.05 * m.intermediate_size:
        raise ValueError(f"memory budget {budget / 2**30:.3f} GiB leaves no room for the FFN: non-FFN "
                         f"weights{' and dense layers' if dense else ''} alone take "
                         f"{fixed / 2**30:.3f} GiB")
    return n / m.intermediate_size



def load_dense(packed_dir: str | Path, dtype: str | torch.dtype | None = None,
               device: str = "cpu") -> tuple[nn.Module, int]:
    """The unmodified transformers model rebuilt from a packed folder: (model, bytes read)."""
    path = Path(packed_dir)
    m = read_manifest(path)
    tensors = check_ffn_file(m)
    dt = resolve_dtype(dtype, m.dtype)
    dev = torch.device(device)
    model, config = build_skeleton(path, dt)
    arch = architecture_for(config)
    sums = read_checksums(m)
    with CountingReader(path / OTHER_FILE) as r:
        _load_other(model, config, path, dt, dev, r, m, sums)
        nbytes = r.bytes_read
    with CountingReader(path / FFN_FILE) as r:
        for layer, block in enumerate(progress(model.model.layers, desc="load dense FFN")):
            raw = r.read_tensor(tensors[neuron_key(layer)])
            if not torch.equal(word_sums(raw.view(torch.uint8).view(m.intermediate_size, -1)),
                               sums[neuron_key(layer)]):
                raise checksum_error(path / FFN_FILE, f"layer {layer}")
            raw = raw.view(torch.uint8).view(m.intermediate_size, -1)
            rec = (m.dequantize_records(raw) if m.quantized_ffn else m.decode_records(raw)[0]
                   ).to(device=dev, dtype=dt)  # [I, 3, H]
            del raw
            block.mlp.gate_proj.weight = nn.Parameter(rec[:, 0].contiguous(), requires_grad=False)
            block.mlp.up_proj.weight = nn.Parameter(rec[:, 1].contiguous(), requires_grad=False)
            block.mlp.down_proj.weight = nn.Parameter(rec[:, 2].t().contiguous(), requires_grad=False)
            del rec
        nbytes += r.bytes_read
    assert arch is not None
    model.eval()
    return model, nbytes
