"""One loaded model ready to serve: selective (or dense) model + engine + counters.

The CLI and the ROS nodes both go through :class:`Runtime`; it holds no ROS types.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import torch

from ..execution.chat import Chat
from ..execution.engine import ChoiceResult, Engine, GenerationConfig, GenerationResult
from ..execution.metrics import (RunningStats, cuda_allocated_bytes, peak_rss_bytes,
                                 process_rss_bytes, system_available_bytes)
from ..format.pack import read_manifest
from ..format.paths import default_profiles_dir
from ..format.tokenizer import load_tokenizer
from ..options import ModelOptions, Ratios
from ..selection.loader import (SelectiveModel, SwitchReport, load_dense, load_ratio_for_budget,
                                resolve_dtype)
from ..selection.profiles import LoadRatioChoice, ProfileCatalog
from .choice import choose_point
from .measured import MeasuredFrontier

CHOICE_WEIGHTS = ("int8", "int8-q4emb", "float")  # the embedded model's records a budget may choose


def weights_for(opts: ModelOptions) -> str:
    """The records of a model by name (or the embedded one) when ``opts`` do not choose them:
    ``weights``, else int8 on a CPU (the int8 decode kernel) and float on CUDA (int8 rows would
    be dequantized per product there: smaller, not faster)."""
    from ..format.default_model import DEFAULT_WEIGHTS
    return opts.weights or (DEFAULT_WEIGHTS if opts.device == "cpu" else "float")


def model_path(opts: ModelOptions, log: Callable[[str], None] = lambda s: None,
               weights: str | None = None) -> str:
    """The packed model folder of ``opts``: a folder as given; the embedded model (``model``
    empty) or a model by name with ``weights`` records or :func:`weights_for`, fetched and
    packed once on first use."""
    from ..format.models import resolve
    return str(resolve(opts.model, weights or weights_for(opts), log))


def candidate_packs(opts: ModelOptions, log: Callable[[str], None]) -> dict[str, str]:
    """Weights format -> packed folder among which memory_budget_mb / min_agreement choose: the
    int8, int8-q4emb (4-bit output layer) and float records of the embedded model or a model by
    name when ``weights`` is empty on a CPU (each packed once, on first use), else the one."""
    from ..format.models import is_model_name
    by_name = not opts.model or is_model_name(opts.model)
    if not by_name or opts.weights or opts.device != "cpu":
        return {"": model_path(opts, log)}
    return {w: model_path(opts, log, w) for w in CHOICE_WEIGHTS}


def tiered_packs(opts: ModelOptions, packs: dict[str, str], measured: MeasuredFrontier | None,
                 log: Callable[[str], None]) -> dict[str, str]:
    """``packs`` and, when they are candidate_packs' choice of formats, the 4-bit formats whose
    int8 tiers the model's measured frontier holds (packed once, on first use)."""
    if measured is None or set(packs) != set(CHOICE_WEIGHTS):
        return packs
    from ..format.weights import Q4_WEIGHTS
    return {**packs, **{w: model_path(opts, log, w) for w in Q4_WEIGHTS if measured.tiers(w)}}


class Runtime:
    """A served model: generate, switch task, report memory."""

    def __init__(self, opts: ModelOptions, log: Callable[[str], None] = lambda s: None,
                 dense: bool = False):
        """Load ``opts.model`` (``dense``: the unmodified transformers model, for comparison)."""
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        self.opts = opts
        choosing = not dense and (opts.memory_budget_mb > 0 or opts.min_agreement > 0)
        # the dense model is the float one unless weights are given
        packs = candidate_packs(opts, log) if choosing else {
            "": model_path(opts, log, (opts.weights or "float") if dense else None)}
        path = next(iter(packs.values()))
        manifest = read_manifest(path)
        self.model_id = manifest.model_id
        self.stats = RunningStats()
        self.switches = 0
        self.last_switch: SwitchReport | None = None
        self._lock = threading.Lock()
        context_limit = opts.context_limit or None
        if dense:
            t0 = time.perf_counter()
            model, nbytes = load_dense(path, opts.dtype or None, opts.device)
            self.selective, self.measured = None, None
            self.engine = Engine(model, load_tokenizer(path), context_limit=context_limit)
            self.bytes_read, self.load_seconds = nbytes, time.perf_counter() - t0
            self.task = ""
            self.load_choice = LoadRatioChoice(1.0, "load_ratio", "the dense model")
            self.ratios = Ratios(1.0, 1.0, 1.0)
            return
        profiles = opts.profiles or default_profiles_dir(manifest.model_id)
        if not Path(profiles).is_dir():
            if opts.load_ratio < 1.0 and opts.selection != "random":
                raise FileNotFoundError(f"profiles folder {profiles} does not exist; run "
                                        f"`selectinfer profile` for model {manifest.model_id}")
            profiles = None
        self.load_choice = LoadRatioChoice(opts.load_ratio, "load_ratio",
                                           f"load_ratio {opts.load_ratio:g} as requested")
        if choosing:
            if opts.min_agreement > 0 and profiles is None:
                raise ValueError("min_agreement needs task profiles with a quality curve")
            packs = tiered_packs(opts, packs, MeasuredFrontier.load(profiles, manifest.model_id),
                                 log)
            self.load_choice = choose_point(opts, packs, profiles, log)
            path = self.load_choice.path or path
        compute = opts.compute_ratio
        if compute <= 0 and self.load_choice.compute_share is not None:
            compute = self.load_choice.load_ratio * self.load_choice.compute_share
        try:
            self.ratios = Ratios.resolve(opts.load_ratio, opts.static_ratio, compute,
                                         chosen_load=self.load_choice.load_ratio,
                                         bound=self.load_choice.bound
                                         if compute == opts.compute_ratio else "load_ratio")
        except ValueError as e:
            if self.load_choice.bound == "memory_budget":
                raise ValueError(f"memory_budget_mb {opts.memory_budget_mb:g}: {e}") from None
            raise
        r = self.ratios
        self.selective = SelectiveModel(
            path, profiles, opts.task or None, load_ratio=r.load, static_ratio=r.static,
            compute_ratio=r.compute, alpha=opts.alpha, device=opts.device,
            dtype=opts.dtype or None, dense_layers=opts.dense_layers, selection=opts.selection,
            compute_mode=opts.compute_mode, int8_ratio=self.load_choice.int8_ratio
            if self.load_choice.int8_ratio is not None else opts.int8_ratio,
            log=log)
        # another format's curve stands in for records without their own: the gap between the
        # two on the model's measured frontier corrects it
        self.measured = MeasuredFrontier.load(profiles, self.model_id)
        self.engine = Engine.from_selective(self.selective, context_limit)
        log(f"[runtime] decoding on the {self.engine.decode_path}")
        self.bytes_read, self.load_seconds = self.selective.bytes_read, self.selective.load_seconds
        self.task = self.selective.task

    def ratios_for(self, compute_setting: float) -> Ratios:
        """The served ratios when the ``compute_ratio`` setting is ``compute_setting`` (0 = the
        load; the same rule as at load time); ValueError when it does not fit the loaded model.
        The dense model always computes everything."""
        if self.selective is None or compute_setting <= 0:
            return self.ratios  # 0: the compute ratio resolved (or chosen) at load
        phi = Ratios.resolve(self.opts.load_ratio, self.ratios.static, compute_setting,
                             chosen_load=self.ratios.load, bound=self.load_choice.bound).compute
        return self.ratios.with_compute(phi)

    def expected_agreement(self, compute_ratio: float | None = None) -> float | None:
        """Next-token agreement with the dense model that the active task's stored quality curve
        predicts at the running gamma and ``compute_ratio`` (default: the model's); None when the
        profile has no curve or it was measured with another selection, and in per-token mode
        (the stored curves are the prompt mode's; the frontier file has the per-token rows)."""
        sm = self.selective
        if sm is not None and sm.state.per_token:
            return None
        if sm is None or sm.catalog is None:
            return None
        phi = compute_ratio if compute_ratio is not None else sm.compute_ratio
        p = sm.catalog.expected_agreement(self.task, sm.load_ratio, phi, sm.selection_strategy,
                                          sm.manifest.weights)
        curve = sm.catalog.quality_curve(self.task, sm.manifest.weights)
        if p is None or curve is None or self.measured is None:
            return p
        return p + self.measured.curve_gap(curve.weights, sm.manifest.weights, sm.load_ratio, phi)

    @property
    def tasks(self) -> list[str]:
        sm = self.selective
        return sm.catalog.tasks if sm is not None and sm.catalog is not None else []

    def generate(self, prompt: str | list[int] | Chat, config: GenerationConfig,
                 on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], bool] | None = None, task: str = "") -> GenerationResult:
        """Generate, switching to ``task`` first when it differs from the active one."""
        with self._lock:
            if task and task != self.task:
                self._switch(task)
            result = self.engine.generate(prompt, config, on_text, cancel)
            self.stats.record(result.metrics)
            return result

    def choose(self, prompt: str | list[int] | Chat, choices: list[str], *,
               length_normalize: bool = False,
               compute_ratio: float | None = None, use_chat_template: bool = False,
               cancel: Callable[[], bool] | None = None, task: str = "",
               special_tokens: bool = False) -> ChoiceResult:
        """:meth:`Engine.choose`, switching to ``task`` first when it differs from the active one."""
        with self._lock:
            if task and task != self.task:
                self._switch(task)
            return self.engine.choose(prompt, choices, length_normalize=length_normalize,
                                      compute_ratio=compute_ratio,
                                      use_chat_template=use_chat_template, cancel=cancel,
                                      special_tokens=special_tokens)

    def switch_task(self, task: str, cancel: Callable[[], bool] | None = None) -> SwitchReport:
        """Reload base neurons for ``task`` (waits for a generation in flight); ``cancel`` is
        polled while reading (SwitchCanceled: nothing changed)."""
        with self._lock:
            return self._switch(task, cancel)

    def _switch(self, task: str, cancel: Callable[[], bool] | None = None) -> SwitchReport:
        if self.selective is None:
            raise ValueError("the dense model has no task profiles")
        report = self.selective.switch_task(task, cancel)
        self.engine.prompt_cache.invalidate(self.engine.cache_key())  # other resident neurons
        self.task = task
        self.switches += 1
        self.last_switch = report
        return report

    def memory(self) -> dict[str, float]:
        sm = self.selective
        if sm is not None:
            w = sm.weight_bytes()
            loaded = sum(m.n_loaded for m in sm.mlps)
        else:
            model = self.engine.model
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            ffn = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp." in n)
            w = {"ffn": ffn, "other": total - ffn, "total": total}
            loaded = sum(b.mlp.down_proj.in_features for b in model.model.layers)
        return {"weight_bytes": w["total"], "ffn_weight_bytes": w["ffn"], "other_weight_bytes": w["other"],
                "process_rss_bytes": process_rss_bytes(), "peak_rss_bytes": peak_rss_bytes(),
                "cuda_allocated_bytes": cuda_allocated_bytes(),
                "system_available_bytes": system_available_bytes(), "neurons_loaded": loaded}

    @property
    def load_ratio(self) -> float:
        return self.selective.load_ratio if self.selective is not None else 1.0

    @property
    def compute_ratio(self) -> float:
        return self.selective.compute_ratio if self.selective is not None else 1.0

    @property
    def device(self) -> torch.device:
        return self.engine.device
