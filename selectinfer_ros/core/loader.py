"""Selective loading: build a model from a packed folder, reading only the selected neurons.

The model skeleton is built on the meta device (no full-size FFN is ever allocated), the
non-FFN tensors are read straight into their final tensors, and each layer's selected neuron
records are read in coalesced runs through a small bounce buffer into compact slot buffers.
Every byte read is counted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .architectures import activation_name, architecture_for
from .pack import FFN_FILE, OTHER_FILE, Manifest, check_ffn_file, neuron_key, read_manifest
from .profiles import (ProfileCatalog, Selection, neuron_count, select_published, select_random,
                       select_sensitivity, select_shared_sensitivity)
from .progress import progress
from .safetensors_io import CountingReader, FormatError, read_header
from .tokenizer import load_tokenizer
from .selective_mlp import SelectionState, SelectiveMLP

BOUNCE_BYTES = 8 << 20  # bounce buffer for coalesced neuron reads
SELECTIONS = ("auto", "published", "sensitivity", "shared-sensitivity", "random")


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


def build_skeleton(path: Path, dtype: torch.dtype):
    """The transformers model of a packed folder on the meta device, and its config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path)
    architecture_for(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, config


def _load_other(model: nn.Module, config, path: Path, dtype: torch.dtype,
                device: torch.device, reader: CountingReader, manifest: Manifest) -> None:
    """Read every non-FFN tensor into the skeleton, tie embeddings, rebuild computed buffers."""
    tensors, meta, _ = read_header(path / OTHER_FILE)
    if meta.get("fingerprint") != manifest.fingerprint:
        raise FormatError(f"{path / OTHER_FILE}: fingerprint {meta.get('fingerprint')!r} does not "
                          f"match manifest {manifest.fingerprint!r} (file from another model)")
    state = {}
    expected = {k: v for k, v in model.state_dict().items()}
    for name, info in tensors.items():
        if name not in expected:
            raise FormatError(f"{path / OTHER_FILE}: unexpected tensor {name!r} for {config.model_type}")
        if tuple(expected[name].shape) != info.shape:
            raise FormatError(f"{path / OTHER_FILE}: {name} has shape {info.shape}, model needs "
                              f"{tuple(expected[name].shape)}")
        t = reader.read_tensor(info)
        state[name] = t.to(device=device, dtype=dtype)
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        model.lm_head.weight = model.get_input_embeddings().weight
        missing = [m for m in missing if m != "lm_head.weight"]
    missing = [m for m in missing if ".mlp." not in m]
    if missing:
        raise FormatError(f"{path / OTHER_FILE}: missing tensors {missing[:5]}")
    _rebuild_computed_buffers(model, config, device)


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
                  sink: Callable[[torch.Tensor, torch.Tensor], None], src_dtype: torch.dtype,
                  hidden: int) -> int:
    """Read the records ``ids`` (any order) in coalesced runs; ``sink(positions, records)``
    receives positions into ``ids`` and the records ``[n, 3, H]``. Returns records read."""
    if ids.numel() == 0:
        return 0
    order = torch.argsort(ids)
    sorted_ids = ids[order].tolist()
    per_chunk = max(1, BOUNCE_BYTES // record_bytes)
    bounce = torch.empty(min(per_chunk, len(sorted_ids)) * record_bytes, dtype=torch.uint8)
    i = 0
    while i < len(sorted_ids):
        j = i + 1
        while j < len(sorted_ids) and j - i < per_chunk and sorted_ids[j] == sorted_ids[j - 1] + 1:
            j += 1
        n = j - i
        buf = bounce[: n * record_bytes]
        reader.read_into(start + sorted_ids[i] * record_bytes, buf)
        sink(order[i:j], buf.view(src_dtype).view(n, 3, hidden))
        i = j
    return len(sorted_ids)


@dataclass
class SwitchReport:
    task: str
    seconds: float
    bytes_read: int
    neurons_read: int
    neurons_dropped: int


class SelectiveModel:
    """A transformers causal LM whose FFNs hold only the selected neurons of a packed model."""

    def __init__(self, packed_dir: str | Path, profiles_dir: str | Path | None = None,
                 task: str | None = None, load_ratio: float = 1.0, static_ratio: float | None = None,
                 compute_ratio: float | None = None, alpha: float = 0.2,
                 device: str = "cpu", dtype: str | torch.dtype | None = None,
                 dense_layers: int = 0, selection: str = "auto",
                 memory_budget_bytes: int | None = None, log: Callable[[str], None] = lambda s: None):
        t0 = time.perf_counter()
        self.path = Path(packed_dir)
        self.manifest = read_manifest(self.path)
        self.ffn_tensors = check_ffn_file(self.manifest)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.manifest.dtype)
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
        if memory_budget_bytes is not None:
            load_ratio = self.load_ratio_for_budget(memory_budget_bytes)
            log(f"[load] memory budget {memory_budget_bytes / 2**30:.2f} GiB -> load_ratio {load_ratio:.3f}")
        static_ratio = load_ratio if static_ratio is None else static_ratio
        compute_ratio = load_ratio if compute_ratio is None else compute_ratio
        check_ratios(load_ratio, static_ratio, compute_ratio)
        if load_ratio < 1.0 and self.catalog is None and selection != "random":
            raise ValueError("load_ratio < 1 needs a profiles folder to choose neurons")
        self.load_ratio, self.static_ratio, self.compute_ratio = load_ratio, static_ratio, compute_ratio
        self.task = task if task else (self.catalog.tasks[0] if self.catalog else "")
        if self.catalog is not None:
            self.catalog.get(self.task)

        self.model, self.config = build_skeleton(self.path, self.dtype)
        self.state = SelectionState()
        self.state.alpha = alpha
        act = activation_name(self.config)
        self.mlps: list[SelectiveMLP] = []
        for layer, block in enumerate(self.model.model.layers):
            block.mlp = SelectiveMLP(self.manifest.hidden_size, act, self.state, layer,
                                     self.dtype, self.device)
            self.mlps.append(block.mlp)
        with CountingReader(self.path / OTHER_FILE) as r:
            _load_other(self.model, self.config, self.path, self.dtype, self.device, r, self.manifest)
            self.bytes_read = r.bytes_read
        sel = self._selection(self.task)
        with CountingReader(self.path / FFN_FILE) as r:
            for layer in progress(range(self.manifest.num_layers), desc="load FFN neurons"):
                self._load_layer(r, layer, sel.neurons[layer], sel.n_static[layer])
            self.bytes_read += r.bytes_read
        self.model.eval()
        self.set_compute_ratio(compute_ratio)
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
    def _load_layer(self, reader: CountingReader, layer: int, ids: torch.Tensor, n_static: int) -> int:
        """Fill layer ``layer`` with neurons ``ids`` (slot order) read from disk. Returns records read."""
        H, k = self.manifest.hidden_size, ids.numel()
        gu = torch.empty(k, 2, H, dtype=self.dtype, device=self.device)
        down = torch.empty(H, k, dtype=self.dtype, device=self.device)
        got = self._read_into(reader, layer, ids, torch.arange(k), gu, down)
        mlp = self.mlps[layer]
        mlp.dense = layer < self.dense_layers or layer >= self.manifest.num_layers - self.dense_layers
        mlp.set_slots(gu, down, ids.to(self.device), n_static)
        return got

    def _read_into(self, reader: CountingReader, layer: int, ids: torch.Tensor, slots: torch.Tensor,
                   gu: torch.Tensor, down: torch.Tensor) -> int:
        """Read neuron records ``ids`` into slots ``slots`` of ``gu`` ``[k, 2, H]`` / ``down`` ``[H, k]``."""
        def sink(positions: torch.Tensor, rec: torch.Tensor) -> None:  # rec [n, 3, H]
            dst = slots[positions].to(self.device)
            rec = rec.to(device=self.device, dtype=self.dtype)
            gu.index_copy_(0, dst, rec[:, :2])
            down.index_copy_(1, dst, rec[:, 2].t())

        info = self.ffn_tensors[neuron_key(layer)]
        return _read_neurons(reader, info.start, self.manifest.record_bytes, ids, sink,
                             self.manifest.dtype, self.manifest.hidden_size)

    def _switch_layer(self, reader: CountingReader, layer: int, ids: torch.Tensor, n_static: int) -> int:
        """In place: read the neurons of ``ids`` not resident into the slots of those no longer
        selected, then swap the base neurons (``ids[:n_static]``) into the static prefix."""
        mlp = self.mlps[layer]
        if mlp.n_loaded != ids.numel():  # per-layer budgets differ between tasks: resize
            return self._resize_layer(reader, layer, ids, n_static)
        inter = self.manifest.intermediate_size
        current = mlp.slot_ids.cpu()
        wanted = torch.zeros(inter, dtype=torch.bool)
        wanted[ids] = True
        resident = torch.zeros(inter, dtype=torch.bool)
        resident[current] = True
        free = torch.nonzero(~wanted[current]).flatten()  # slots whose neuron is dropped
        incoming = ids[~resident[ids]]  # neurons to read, as many as free slots
        got = self._read_into(reader, layer, incoming, free, mlp.gu, mlp.down)
        mlp.slot_ids.index_copy_(0, free.to(self.device), incoming.to(self.device))
        where = torch.full((inter,), -1, dtype=torch.long)
        where[mlp.slot_ids.cpu()] = torch.arange(mlp.n_loaded)
        mlp.n_static = n_static
        mlp._swap_in(where[ids[:n_static]].to(self.device), 0, n_static)
        return got

    def _resize_layer(self, reader: CountingReader, layer: int, ids: torch.Tensor, n_static: int) -> int:
        """New buffers of ``len(ids)`` slots: resident neurons copied, the others read (the old
        buffers go once this returns, so the transient extra memory is one layer)."""
        mlp = self.mlps[layer]
        H, k = self.manifest.hidden_size, ids.numel()
        where = torch.full((self.manifest.intermediate_size,), -1, dtype=torch.long)
        where[mlp.slot_ids.cpu()] = torch.arange(mlp.n_loaded)
        old = where[ids]
        hit = old >= 0
        gu = torch.empty(k, 2, H, dtype=self.dtype, device=self.device)
        down = torch.empty(H, k, dtype=self.dtype, device=self.device)
        pos, src = torch.nonzero(hit).flatten().to(self.device), old[hit].to(self.device)
        gu.index_copy_(0, pos, mlp.gu.index_select(0, src))
        down.index_copy_(1, pos, mlp.down.index_select(1, src))
        todo = torch.nonzero(~hit).flatten()
        got = self._read_into(reader, layer, ids[todo], todo, gu, down)
        mlp.set_slots(gu, down, ids.to(self.device), n_static)
        return got

    def switch_task(self, task: str) -> SwitchReport:
        """Load another task's base neurons in place: read only neurons not resident (into the slots
        of the dropped ones), then move the new base neurons into the static prefix."""
        if self.catalog is None:
            raise ValueError("no profiles folder: cannot switch task")
        t0 = time.perf_counter()
        self.catalog.reload(task)
        sel = self._selection(task)
        read = dropped = 0
        with CountingReader(self.path / FFN_FILE) as r:
            for layer in range(self.manifest.num_layers):
                mlp = self.mlps[layer]
                dropped += int((~torch.isin(mlp.slot_ids.cpu(), sel.neurons[layer])).sum())
                read += self._switch_layer(r, layer, sel.neurons[layer], sel.n_static[layer])
            nbytes = r.bytes_read
        self.task = task
        self.set_compute_ratio(self.compute_ratio)
        return SwitchReport(task, time.perf_counter() - t0, nbytes, read, dropped)

    # -- runtime knobs -----------------------------------------------------------------------
    def set_compute_ratio(self, phi: float) -> None:
        """Neurons computed per decode step: phi * I per layer, or, where layers hold different
        numbers of neurons (per-layer budgets), the same share phi / gamma of each layer's."""
        check_ratios(self.load_ratio, self.static_ratio, phi)
        self.compute_ratio = phi
        uniform = len({m.n_loaded for m in self.mlps}) == 1
        for mlp in self.mlps:
            if uniform:
                mlp.set_active(neuron_count(phi, self.manifest.intermediate_size))
            else:
                mlp.set_active(int(mlp.n_loaded * phi / self.load_ratio + 0.5))

    def active_neuron_ids(self) -> list[torch.Tensor]:
        """Per layer, the neuron ids computed in decode (after the last prefill's selection)."""
        return [m.slot_ids[: m.n_active].cpu() for m in self.mlps]

    def loaded_neuron_ids(self) -> list[torch.Tensor]:
        return [m.slot_ids.cpu() for m in self.mlps]

    def weight_bytes(self) -> dict[str, int]:
        ffn = sum(m.weight_bytes() for m in self.mlps)
        seen, other = set(), 0
        for p in list(self.model.parameters()):
            if id(p) not in seen:
                seen.add(id(p))
                other += p.numel() * p.element_size()
        return {"ffn": ffn, "other": other, "total": ffn + other}

    def other_bytes_estimate(self) -> int:
        tensors, _, _ = read_header(self.path / OTHER_FILE)
        itemsize = self.dtype.itemsize
        return sum(t.nbytes // t.dtype.itemsize * itemsize for t in tensors.values())

    def load_ratio_for_budget(self, budget: int) -> float:
        """The largest load_ratio whose resident weights fit ``budget`` bytes."""
        m = self.manifest
        other = self.other_bytes_estimate()
        per_neuron = m.num_layers * 3 * m.hidden_size * self.dtype.itemsize  # one neuron, all layers
        n = min(m.intermediate_size, max(0, (budget - other) // per_neuron))
        if n < 0.05 * m.intermediate_size:
            raise ValueError(f"memory budget {budget / 2**30:.2f} GiB leaves no room for the FFN: "
                             f"non-FFN weights alone take {other / 2**30:.2f} GiB")
        return n / m.intermediate_size

    @property
    def tokenizer(self):
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer


def check_ratios(load_ratio: float, static_ratio: float, compute_ratio: float) -> None:
    """Refuse ratios outside 0 <= delta <= phi <= gamma <= 1 with the reason."""
    if not 0.0 < load_ratio <= 1.0:
        raise ValueError(f"load_ratio must be in (0, 1], got {load_ratio}")
    if not 0.0 <= static_ratio <= load_ratio:
        raise ValueError(f"static_ratio must be in [0, load_ratio={load_ratio}], got {static_ratio}")
    if not static_ratio <= compute_ratio <= load_ratio:
        raise ValueError(f"compute_ratio must be in [static_ratio={static_ratio}, "
                         f"load_ratio={load_ratio}], got {compute_ratio}")


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
    with CountingReader(path / OTHER_FILE) as r:
        _load_other(model, config, path, dt, dev, r, m)
        nbytes = r.bytes_read
    with CountingReader(path / FFN_FILE) as r:
        for layer, block in enumerate(progress(model.model.layers, desc="load dense FFN")):
            rec = r.read_tensor(tensors[neuron_key(layer)]).to(device=dev, dtype=dt)  # [I, 3, H]
            block.mlp.gate_proj.weight = nn.Parameter(rec[:, 0].contiguous(), requires_grad=False)
            block.mlp.up_proj.weight = nn.Parameter(rec[:, 1].contiguous(), requires_grad=False)
            block.mlp.down_proj.weight = nn.Parameter(rec[:, 2].t().contiguous(), requires_grad=False)
            del rec
        nbytes += r.bytes_read
    assert arch is not None
    model.eval()
    return model, nbytes
