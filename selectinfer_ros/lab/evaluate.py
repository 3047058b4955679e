"""``selectinfer eval``: accuracy of selection methods against the dense model, through decode.

Generation tasks (QA exact match, translation chrF, summarization ROUGE-L, navigation commands)
are answered with greedy decoding, so the selected neurons are what answers; perplexities and
next-token agreement are teacher-forced through the same decode path (selection on the prefix,
active neurons only on the continuation).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.execution.engine import Engine, GenerationConfig
from ..core.selection.loader import SelectiveModel, load_dense
from ..core.format.paths import DATA_DIR, default_profiles_dir
from ..core.profiling.profiler import agreement_and_kl, agreement_pairs, dense_reference, read_jsonl
from ..core.format.tokenizer import load_tokenizer
from .textmetrics import chrf, contains, exact_match, rouge_l

GRID = [(0.9, 0.7), (0.7, 0.7), (0.7, 0.5), (0.5, 0.35)]
QUICK_GRID = [(0.7, 0.5)]
TASKS = ("qa", "translation", "summarization", "navigation", "prose")
MAX_NEW = {"qa": 8, "translation": 40, "summarization": 40, "navigation": 16}
HEADLINE = ("qa_em", "translation_chrf", "summary_ref_ppl", "prose_ppl")  # the mean of their fractions
AGREEMENT_TASKS = ("qa", "translation", "summarization", "navigation")  # task_agreement: their mean


@dataclass(frozen=True)
class EvalConfig:
    name: str
    method: str  # dense, selectinfer, loading_only, random, coreinfer, griffin, or a strategy name
    load_ratio: float = 1.0
    compute_ratio: float = 1.0
    static_ratio: float = 0.3
    selection: str = "published"
    dynamic: str = "frequency"  # or "norm" (GRIFFIN)
    compute_mode: str = "prompt"  # or "token" (per-token selection)

    @property
    def model_key(self) -> tuple:
        return (self.load_ratio, self.static_ratio, self.selection, self.compute_mode)


def build_configs(grid: list[tuple[float, float]], strategies: list[str],
                  compute_modes: tuple[str, ...] = ("prompt",)) -> list[EvalConfig]:
    """Dense, the (gamma, phi) grid with loading-only beside it, and the ablations; with
    ``token`` in ``compute_modes`` each grid point's per-token row too."""
    out = [EvalConfig("dense", "dense")]
    if "token" in compute_modes:
        out += [EvalConfig(f"selectinfer {g:g}/{p:g} token", "selectinfer-token", g, p, min(0.3, p),
                           "published", compute_mode="token") for g, p in grid if p < g]
    if "prompt" not in compute_modes:
        return out
    seen = set()
    for gamma, phi in grid:
        delta = min(0.3, phi)
        for strat in ["published"] + [s for s in strategies if s != "published"]:
            tag = "" if strat == "published" else f" [{strat}]"
            method = "selectinfer" if strat == "published" else strat
            if (gamma, gamma, strat) not in seen:
                seen.add((gamma, gamma, strat))
                out.append(EvalConfig(f"loading-only {gamma:g}{tag}", "loading_only" if strat == "published"
                                      else method, gamma, gamma, delta, strat))
            if phi < gamma and (gamma, phi, strat) not in seen:
                seen.add((gamma, phi, strat))
                out.append(EvalConfig(f"selectinfer {gamma:g}/{phi:g}{tag}", method, gamma, phi, delta, strat))
    gammas = sorted({g for g, _ in grid if g < 1}, reverse=True)
    phis = sorted({p for g, p in grid if p < g}, reverse=True)
    for gamma in gammas:
        out.append(EvalConfig(f"random {gamma:g}", "random", gamma, gamma, min(0.3, gamma), "random"))
    for phi in phis:
        out.append(EvalConfig(f"coreinfer {phi:g}", "coreinfer", 1.0, phi, 0.0, "published", "frequency"))
        out.append(EvalConfig(f"griffin {phi:g}", "griffin", 1.0, phi, 0.0, "published", "norm"))
    return out


class Evaluator:
    """Runs every eval task on one engine; dense results give the reference for agreement."""

    def __init__(self, data_dir: Path, limit: int, tokenizer, generate: tuple[str, ...] = MAX_NEW.keys()):
        self.tok = tokenizer
        self.data = {t: read_jsonl(data_dir / f"{t}.jsonl")[:limit] for t in TASKS}
        self.dense_argmax: list[torch.Tensor] | None = None
        self.generate = tuple(generate)  # tasks answered by generation (the others: ppl only)
        self.pairs = {t: agreement_pairs(tokenizer, self.data[t]) for t in AGREEMENT_TASKS}
        self.dense_ref: dict[str, list] = {}
        self.agreement_only = False
        self.answers_only = False  # only the generated answers (no agreement, no perplexity)

    def _generate(self, engine: Engine, task: str) -> list[str]:
        out = []
        for r in self.data[task]:
            cfg = GenerationConfig(max_new_tokens=MAX_NEW[task], stop=list(r.get("stop", ["\n"])))
            out.append(engine.generate(r["prompt"], cfg).text)
        return out

    def _agreement(self, engine: Engine, task: str, out: dict) -> None:
        """Next-token agreement with dense (and KL) on the task's eval texts, split in the middle
        as the quality curve stored in profiles measures it."""
        if task not in self.dense_ref:  # the first configuration run is the dense one
            self.dense_ref[task] = dense_reference(engine, self.pairs[task])
        agree, kl, _ = agreement_and_kl(engine, self.pairs[task], self.dense_ref[task])
        out[f"{task}_agreement"], out[f"{task}_kl"] = agree, kl

    def _ppl(self, engine: Engine, pairs: list[tuple[list[int], list[int]]],
             keep_argmax: bool = False) -> tuple[float, list[torch.Tensor]]:
        nll, count, argmaxes = 0.0, 0, []
        for prefix, cont in pairs:
            logits = engine.score(prefix, cont)
            target = torch.tensor(cont, device=logits.device)
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += len(cont)
            if keep_argmax:
                argmaxes.append(logits.argmax(-1).cpu())
        return math.exp(nll / max(1, count)), argmaxes

    def prose_pairs(self) -> list[tuple[list[int], list[int]]]:
        pairs = []
        for r in self.data["prose"]:
            ids = self.tok(r["text"])["input_ids"]
            half = max(2, len(ids) // 2)
            pairs.append((ids[:half], ids[half:]))
        return pairs

    def summary_pairs(self) -> list[tuple[list[int], list[int]]]:
        out = []
        for r in self.data["summarization"]:
            prompt = self.tok(r["prompt"])["input_ids"]
            full = self.tok(r["prompt"] + r["reference"])["input_ids"]
            out.append((prompt, full[len(prompt):]))
        return out

    def run(self, engine: Engine, switch=None) -> dict[str, float]:
        """Metrics of one configuration; ``switch(task)`` selects the task's profile first."""
        out: dict[str, float] = {}
        for task in ("qa", "translation", "summarization", "navigation"):
            if switch:
                switch(task)
            if self.answers_only and task not in self.generate:
                continue
            if not self.answers_only:
                self._agreement(engine, task, out)
            if self.agreement_only:
                continue
            refs = [r["reference"] for r in self.data[task]]
            if task == "summarization" and not self.answers_only:
                out["summary_ref_ppl"], _ = self._ppl(engine, self.summary_pairs())
            if task not in self.generate:
                continue
            preds = self._generate(engine, task)
            if task in ("qa", "navigation"):
                key = "qa_em" if task == "qa" else "navigation_em"
                out[key] = sum(exact_match(p, r) for p, r in zip(preds, refs)) / len(refs)
                if task == "qa":
                    out["qa_contains"] = sum(contains(p, r) for p, r in zip(preds, refs)) / len(refs)
            elif task == "translation":
                out["translation_chrf"] = chrf(preds, refs)
            else:
                out["summary_rougeL"] = sum(rouge_l(p, r) for p, r in zip(preds, refs)) / len(refs)
        if self.answers_only:
            return out
        out["task_agreement"] = sum(out[f"{t}_agreement"] for t in AGREEMENT_TASKS) / len(AGREEMENT_TASKS)
        if self.agreement_only:
            return out
        if switch:
            switch("prose")
        dense = self.dense_argmax is None
        out["prose_ppl"], argmaxes = self._ppl(engine, self.prose_pairs(), keep_argmax=True)
        if dense:
            self.dense_argmax = argmaxes
        agree = sum(int((a == b).sum()) for a, b in zip(argmaxes, self.dense_argmax))
        out["next_token_agreement"] = agree / sum(len(a) for a in self.dense_argmax)
        return out


def add_fractions(rows: list[dict]) -> None:
    """Each metric as a fraction of dense (perplexities as dense/ppl) and the headline mean."""
    dense = next(r for r in rows if r["method"] == "dense")
    if "translation_chrf" not in dense or "prose_ppl" not in dense:
        for r in rows:  # what was measured (answers only: QA EM, ...), as fractions of dense
            for key in ("qa_em", "qa_contains", "translation_chrf", "navigation_em"):
                if key in r and dense.get(key):
                    r[f"{key}_frac"] = r[key] / dense[key]
        return
    for r in rows:
        for key in ("qa_em", "qa_contains", "translation_chrf", "summary_rougeL", "navigation_em"):
            if key in r and key in dense:
                r[f"{key}_frac"] = r[key] / dense[key] if dense[key] else 0.0
        for key in ("summary_ref_ppl", "prose_ppl"):
            r[f"{key}_frac"] = dense[key] / r[key] if r[key] else 0.0
        r["next_token_agreement_frac"] = r["next_token_agreement"]
        r["mean4_frac"] = sum(r[f"{k}_frac"] for k in HEADLINE) / len(HEADLINE)


def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[dict]:
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..core.format.models import resolve
    from ..core.format.pack import read_manifest
    model_path = resolve(args.model or "", "float", _log)
    manifest = read_manifest(model_path)
    profiles = Path(args.profiles) if args.profiles else default_profiles_dir(manifest.model_id)
    tok = load_tokenizer(model_path)
    grid = QUICK_GRID if args.quick else [tuple(map(float, g.split(","))) for g in args.grid] if args.grid else GRID
    strategies = args.strategies.split(",") if args.strategies else ["published"]
    configs = build_configs(grid, strategies, tuple(getattr(args, "compute_modes", None) or ["prompt"]))
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if c.method == "dense" or c.method in keep]
    limit = 3 if args.quick else args.limit
    generate = tuple(MAX_NEW) if not args.headline_only else ("qa", "translation")
    if getattr(args, "answers", None):
        generate = tuple(args.answers.split(","))
    if not args.cross_phrasing:
        data = Path(args.data) if args.data else DATA_DIR / "eval"
        return run_configs(args, model_path, manifest, tok, profiles, data, configs, limit, generate)
    # Cross-phrasing: profiles of phrasing A (profiling/) on eval_alt/, and profiles of phrasing
    # B (profiling_alt/) on eval/.
    alt = Path(args.alt_profiles) if args.alt_profiles else Path(args.out or "eval-out") / "profiles-alt"
    ensure_alt_profiles(model_path, alt, args)
    rows = []
    for direction, prof_dir, data in (("A->B", profiles, DATA_DIR / "eval_alt"),
                                      ("B->A", alt, DATA_DIR / "eval")):
        _log(f"[eval] cross-phrasing {direction}: profiles {prof_dir}, eval data {data}")
        part = run_configs(args, model_path, manifest, tok, prof_dir, data, configs, limit, generate)
        for r in part:
            r["direction"] = direction
        rows += part
    return rows


def ensure_alt_profiles(model_path: Path, alt: Path, args: argparse.Namespace) -> None:
    """Profiles of every task made on the second phrasing (profiling_alt/), once."""
    from ..core.selection.loader import load_dense
    from ..core.format.pack import read_manifest
    from ..core.profiling.profiler import profile_task
    manifest = read_manifest(model_path)
    files = sorted((DATA_DIR / "profiling_alt").glob("*.jsonl"))
    if alt.is_dir() and all((alt / f"{f.stem}.safetensors").exists() for f in files):
        return
    model, _ = load_dense(model_path, args.dtype)
    tok = load_tokenizer(model_path)
    for f in files:
        prof = profile_task(model, tok, manifest, f.stem, [f], normalize=args.normalize)
        prof.save(alt / f"{f.stem}.safetensors")
        _log(f"[eval] profiled {f.stem} on {f} -> {alt}")
    del model


def run_configs(args, model_path, manifest, tok, profiles, data_dir, configs, limit, generate) -> list[dict]:
    ev = Evaluator(data_dir, limit, tok, generate)
    ev.agreement_only = bool(getattr(args, "agreement_only", False))
    ev.answers_only = bool(getattr(args, "answers", None))
    task_of = {"qa": "qa", "translation": "translation", "summarization": "summarization",
               "navigation": "navigation", "prose": args.prose_task}
    if getattr(args, "task", None):  # one profile for every task (general: nothing given)
        task_of = dict.fromkeys(task_of, args.task)
    rows = []
    models: dict[tuple, SelectiveModel] = {}
    for cfg in configs:
        t0 = time.perf_counter()
        if cfg.method == "dense":  # the reference: this pack's dense model, or --dense-model's
            model, _ = load_dense(getattr(args, "dense_model", None) or model_path, args.dtype)
            engine = Engine(model, tok)
            metrics = ev.run(engine)
            weight = sum(p.numel() * p.element_size() for p in model.parameters())
            del model, engine
        else:
            if cfg.model_key not in models:
                models.clear()  # one selective model resident at a time
                models[cfg.model_key] = SelectiveModel(
                    model_path, profiles, task_of["qa"], load_ratio=cfg.load_ratio,
                    static_ratio=cfg.static_ratio, compute_ratio=cfg.load_ratio, alpha=args.alpha,
                    dtype=args.dtype, selection=cfg.selection, compute_mode=cfg.compute_mode)
                models[cfg.model_key].tokenizer = tok
            sm = models[cfg.model_key]
            sm.set_compute_ratio(cfg.compute_ratio)
            sm.state.method = cfg.dynamic
            engine = Engine.from_selective(sm)

            def switch(task: str, sm=sm) -> None:
                if sm.catalog is not None and task_of[task] != sm.task:
                    sm.switch_task(task_of[task])
            metrics = ev.run(engine, switch)
            weight = sm.weight_bytes()["total"]
            cfg_selection = sm.selection_strategy
        row = {"model": manifest.model_id, "name": cfg.name, "method": cfg.method,
               "load_ratio": cfg.load_ratio, "compute_ratio": cfg.compute_ratio,
               "static_ratio": cfg.static_ratio, "selection": cfg.selection, "dynamic": cfg.dynamic,
               "compute_mode": cfg.compute_mode,
               "weight_bytes": weight, "items_per_task": limit, "data": str(data_dir),
               "profiles": str(profiles), **metrics}
        if cfg.method != "dense":
            row["selection_resolved"] = cfg_selection
            for t in AGREEMENT_TASKS:  # what the curve stored in the profile predicted
                if sm.catalog is not None and t in sm.catalog.tasks and cfg.compute_mode == "prompt":
                    exp = sm.catalog.expected_agreement(t, cfg.load_ratio, cfg.compute_ratio,
                                                        selection=cfg_selection)
                    if exp is not None:
                        row[f"{t}_expected_agreement"] = exp
        rows.append(row)
        _log(f"[eval] {cfg.name}: " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
             + f" ({time.perf_counter() - t0:.0f} s)")
    add_fractions(rows)
    return rows


def print_table(rows: list[dict]) -> None:
    def f(r, k, fmt):
        return format(r[k], fmt) if k in r else "-"
    for direction in dict.fromkeys(r.get("direction", "") for r in rows):
        if direction:
            print(f"cross-phrasing {direction} (profiles of one phrasing, eval prompts of the other)")
        print(f"{'configuration':<34}{'QA EM':>7}{'chrF':>7}{'R-L':>6}{'sum ppl':>9}{'nav EM':>7}"
              f"{'prose ppl':>10}{'agree':>7}{'task agr':>9}{'mean4':>7}{'MiB':>8}")
        for r in rows:
            if r.get("direction", "") != direction:
                continue
            print(f"{r['name']:<34}{f(r, 'qa_em', '.2f'):>7}{f(r, 'translation_chrf', '.1f'):>7}"
                  f"{f(r, 'summary_rougeL', '.2f'):>6}{f(r, 'summary_ref_ppl', '.2f'):>9}"
                  f"{f(r, 'navigation_em', '.2f'):>7}{f(r, 'prose_ppl', '.2f'):>10}"
                  f"{f(r, 'next_token_agreement', '.2f'):>7}{f(r, 'task_agreement', '.2f'):>9}"
                  f"{f(r, 'mean4_frac', '.2f'):>7}{r['weight_bytes'] / 2**20:>8.1f}")
        pred = [r for r in rows if r.get("direction", "") == direction and "qa_expected_agreement" in r
                and "qa_agreement" in r]
        if pred:
            print("agreement on the eval texts: measured / predicted by the curve stored in the profile")
            print(f"{'configuration':<34}" + "".join(f"{t:>22}" for t in AGREEMENT_TASKS))
            for r in pred:
                cells = "".join(f"{r[t + '_agreement']:>12.3f} / {r.get(t + '_expected_agreement', float('nan')):.3f}"
                                for t in AGREEMENT_TASKS)
                print(f"{r['name']:<34}{cells}")
    print("mean4 = mean of QA EM, chrF, dense/summary-ppl, dense/prose-ppl as fractions of dense; "
          "agree = next-token agreement with dense on held-out prose; task agr = mean agreement "
          "on the qa/translation/summarization/navigation eval texts (split in the middle)")


def cmd_eval(args: argparse.Namespace) -> int:
    from .plots import tradeoff_plot
    rows = run(args)
    print_table(rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(rows, indent=2) + "\n")
        if "mean4_frac" not in rows[0]:  # answers only: no accuracy summary to plot
            print(f"wrote {out / 'eval.json'}")
            return 0
        tradeoff_plot(rows, "mean4_frac", "accuracy (mean fraction of dense)", out / "eval_accuracy_vs_memory.png",
                      title=f"{rows[0]['model']}: accuracy vs resident weights")
        tradeoff_plot(rows, "next_token_agreement", "next-token agreement with dense",
                      out / "eval_agreement_vs_memory.png",
                      title=f"{rows[0]['model']}: agreement vs resident weights")
        print(f"wrote {out / 'eval.json'} and plots")
    return 0
