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

from .engine import Engine, GenerationConfig
from .loader import SelectiveModel, load_dense
from .paths import DATA_DIR, default_profiles_dir
from .profiler import read_jsonl
from .tokenizer import load_tokenizer
from .textmetrics import chrf, exact_match, rouge_l

GRID = [(0.9, 0.7), (0.7, 0.7), (0.7, 0.5), (0.5, 0.35)]
QUICK_GRID = [(0.7, 0.5)]
TASKS = ("qa", "translation", "summarization", "navigation", "prose")
MAX_NEW = {"qa": 8, "translation": 40, "summarization": 40, "navigation": 16}
HEADLINE = ("qa_em", "translation_chrf", "summary_ref_ppl", "prose_ppl")  # the mean of their fractions


@dataclass(frozen=True)
class EvalConfig:
    name: str
    method: str  # dense, selectinfer, loading_only, random, coreinfer, griffin, or a strategy name
    load_ratio: float = 1.0
    compute_ratio: float = 1.0
    static_ratio: float = 0.3
    selection: str = "published"
    dynamic: str = "frequency"  # or "norm" (GRIFFIN)

    @property
    def model_key(self) -> tuple:
        return (self.load_ratio, self.static_ratio, self.selection)


def build_configs(grid: list[tuple[float, float]], strategies: list[str]) -> list[EvalConfig]:
    """Dense, the (gamma, phi) grid with loading-only beside it, and the ablations."""
    out = [EvalConfig("dense", "dense")]
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

    def __init__(self, data_dir: Path, limit: int, tokenizer):
        self.tok = tokenizer
        self.data = {t: read_jsonl(data_dir / f"{t}.jsonl")[:limit] for t in TASKS}
        self.dense_argmax: list[torch.Tensor] | None = None

    def _generate(self, engine: Engine, task: str) -> list[str]:
        cfg = GenerationConfig(max_new_tokens=MAX_NEW[task], stop=["\n"])
        return [engine.generate(r["prompt"], cfg).text for r in self.data[task]]

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
            refs = [r["reference"] for r in self.data[task]]
            preds = self._generate(engine, task)
            if task in ("qa", "navigation"):
                key = "qa_em" if task == "qa" else "navigation_em"
                out[key] = sum(exact_match(p, r) for p, r in zip(preds, refs)) / len(refs)
            elif task == "translation":
                out["translation_chrf"] = chrf(preds, refs)
            else:
                out["summary_rougeL"] = sum(rouge_l(p, r) for p, r in zip(preds, refs)) / len(refs)
                out["summary_ref_ppl"], _ = self._ppl(engine, self.summary_pairs())
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
    for r in rows:
        for key in ("qa_em", "translation_chrf", "summary_rougeL", "navigation_em"):
            r[f"{key}_frac"] = r[key] / dense[key] if dense[key] else 0.0
        for key in ("summary_ref_ppl", "prose_ppl"):
            r[f"{key}_frac"] = dense[key] / r[key] if r[key] else 0.0
        r["next_token_agreement_frac"] = r["next_token_agreement"]
        r["mean4_frac"] = sum(r[f"{k}_frac"] for k in HEADLINE) / len(HEADLINE)


def run(args: argparse.Namespace) -> list[dict]:
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.threads:
        torch.set_num_threads(args.threads)
    from .default_model import ensure_packed
    from .pack import read_manifest
    model_path = Path(args.model) if args.model else ensure_packed(log)
    manifest = read_manifest(model_path)
    profiles = Path(args.profiles) if args.profiles else default_profiles_dir(manifest.model_id)
    tok = load_tokenizer(model_path)
    grid = QUICK_GRID if args.quick else [tuple(map(float, g.split(","))) for g in args.grid] if args.grid else GRID
    strategies = args.strategies.split(",") if args.strategies else ["published"]
    configs = build_configs(grid, strategies)
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if c.method == "dense" or c.method in keep]
    limit = 3 if args.quick else args.limit
    ev = Evaluator(Path(args.data) if args.data else DATA_DIR / "eval", limit, tok)
    task_of = {"qa": "qa", "translation": "translation", "summarization": "summarization",
               "navigation": "navigation", "prose": args.prose_task}
    rows = []
    models: dict[tuple, SelectiveModel] = {}
    for cfg in configs:
        t0 = time.perf_counter()
        if cfg.method == "dense":
            model, _ = load_dense(model_path, args.dtype)
            engine = Engine(model, tok)
            metrics = ev.run(engine)
            weight = sum(p.numel() * p.element_size() for p in model.parameters())
            del model, engine
        else:
            if cfg.model_key not in models:
                models.clear()  # one selective model resident at a time
                models[cfg.model_key] = SelectiveModel(
                    model_path, profiles, "qa", cfg.load_ratio, cfg.static_ratio, cfg.load_ratio,
                    args.alpha, dtype=args.dtype, selection=cfg.selection)
                models[cfg.model_key]._tokenizer = tok
            sm = models[cfg.model_key]
            sm.set_compute_ratio(cfg.compute_ratio)
            sm.state.method = cfg.dynamic
            engine = Engine.from_selective(sm)

            def switch(task: str, sm=sm) -> None:
                if sm.catalog is not None and task_of[task] != sm.task:
                    sm.switch_task(task_of[task])
            metrics = ev.run(engine, switch)
            weight = sm.weight_bytes()["total"]
        row = {"model": manifest.model_id, "name": cfg.name, "method": cfg.method,
               "load_ratio": cfg.load_ratio, "compute_ratio": cfg.compute_ratio,
               "static_ratio": cfg.static_ratio, "selection": cfg.selection, "dynamic": cfg.dynamic,
               "weight_bytes": weight, "items_per_task": limit, **metrics}
        rows.append(row)
        log(f"[eval] {cfg.name}: " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
            + f" ({time.perf_counter() - t0:.0f} s)")
    add_fractions(rows)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'configuration':<34}{'QA EM':>7}{'chrF':>7}{'R-L':>6}{'sum ppl':>9}{'nav EM':>7}"
          f"{'prose ppl':>10}{'agree':>7}{'mean4':>7}{'MiB':>8}")
    for r in rows:
        print(f"{r['name']:<34}{r['qa_em']:>7.2f}{r['translation_chrf']:>7.1f}{r['summary_rougeL']:>6.2f}"
              f"{r['summary_ref_ppl']:>9.2f}{r['navigation_em']:>7.2f}{r['prose_ppl']:>10.2f}"
              f"{r['next_token_agreement']:>7.2f}{r['mean4_frac']:>7.2f}{r['weight_bytes'] / 2**20:>8.1f}")
    print("mean4 = mean of QA EM, chrF, dense/summary-ppl, dense/prose-ppl as fractions of dense; "
          "agree = next-token agreement with dense on held-out prose")


def cmd_eval(args: argparse.Namespace) -> int:
    from .plots import tradeoff_plot
    rows = run(args)
    print_table(rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(rows, indent=2) + "\n")
        tradeoff_plot(rows, "mean4_frac", "accuracy (mean fraction of dense)", out / "eval_accuracy_vs_memory.png",
                      title=f"{rows[0]['model']}: accuracy vs resident weights")
        tradeoff_plot(rows, "next_token_agreement", "next-token agreement with dense",
                      out / "eval_agreement_vs_memory.png",
                      title=f"{rows[0]['model']}: agreement vs resident weights")
        print(f"wrote {out / 'eval.json'} and plots")
    return 0


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy against dense on held-out sets, with ablations")
    p.add_argument("--model")
    p.add_argument("--profiles")
    p.add_argument("--data", help="folder of eval JSONL files (default: the shipped eval sets)")
    p.add_argument("--limit", type=int, default=20, help="items per task")
    p.add_argument("--grid", nargs="+", help="gamma,phi pairs (default: 0.9,0.7 0.7,0.7 0.7,0.5 0.5,0.35)")
    p.add_argument("--strategies", help="comma list of selection strategies besides published")
    p.add_argument("--only", help="comma list of methods to run besides dense")
    p.add_argument("--prose-task", default="summarization", help="profile used for held-out prose")
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--dtype")
    p.add_argument("--threads", type=int)
    p.add_argument("--quick", action="store_true", help="one grid point, 3 items per task (CI)")
    p.add_argument("--out")
    p.set_defaults(func=cmd_eval)
