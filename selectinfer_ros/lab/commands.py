"""The lab's ``selectinfer`` subcommands (bench, eval, eval-choices, frontier): their options, and the
command functions, imported only when a subcommand runs (``selectinfer --help`` loads no torch).

Spelling shared with the rest of the CLI: ``--model``, ``--profiles``, ``--task``, ``--device``,
``--dtype``, ``--alpha``, ``--threads`` mean what the ``ModelOptions`` field of that name means;
``--grid G,P ...`` is a list of (load_ratio, compute_ratio) pairs.
"""
from __future__ import annotations

import argparse

from ..core.format.paths import DATA_DIR
from ..core.format.weights import BENCH_WEIGHTS, WEIGHTS
from ..core.options import COMPUTE_MODES, ModelOptions, add_option
from .llama_cpp import FRONTIER_TYPES

GRID_HELP = ("gamma,phi pairs (load_ratio,compute_ratio), space-separated, e.g. "
             "--grid 1,1 0.7,0.5")



def _compute_modes(p: argparse.ArgumentParser, token: str) -> None:
    """``--compute-modes``: which computation modes' rows a command measures (one spelling for
    bench, eval and frontier; ``token`` says what the per-token rows are there)."""
    p.add_argument("--compute-modes", nargs="+", choices=COMPUTE_MODES, metavar="MODE",
                   help=f"prompt (the published mode) and/or token ({token}); default: prompt")

def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import cmd_bench as run
    return run(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import cmd_eval as run
    return run(args)


def cmd_frontier(args: argparse.Namespace) -> int:
    from .frontier import cmd_frontier as run
    return run(args)


def cmd_eval_choices(args: argparse.Namespace) -> int:
    from .choice_eval import cmd_eval_choices as run
    return run(args)


def _model(p: argparse.ArgumentParser) -> None:
    add_option(p, ModelOptions, "model", default=None)
    add_option(p, ModelOptions, "profiles", default=None)


def register(sub) -> None:
    """Add ``bench``, ``eval``, ``eval-choices`` and ``frontier`` to the ``selectinfer`` subparsers."""
    p = sub.add_parser("bench", help="speed and memory of dense, SelectInfer and quantized, "
                                     "interleaved in one process")
    _model(p)
    p.add_argument("--preset", help="random-weight model with a real config (llama-3.2-1b, "
                                    "llama-3.2-3b, ...) instead of --model")
    add_option(p, ModelOptions, "task")
    add_option(p, ModelOptions, "device")
    add_option(p, ModelOptions, "dtype", default=None)
    add_option(p, ModelOptions, "num_threads", "--threads", dest="threads", default=None)
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; rows are medians "
                                                           "(default 5)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded (default 32)")
    p.add_argument("--grid", nargs="+", metavar="G,P",
                   help=f"{GRID_HELP} (default 1,1 0.9,0.7 0.7,0.7 0.7,0.5 0.5,0.35)")
    _compute_modes(p, "the grid's points (phi < gamma) with per-token selection too")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=None,
                   help="SelectInfer rows over these `pack --weights` records (default: "
                        f"{' '.join(BENCH_WEIGHTS)}; --quick: float)")
    p.add_argument("--no-quant", action="store_true", help="skip torch int8/int4 weight-only")
    p.add_argument("--llama-cpp", help="llama.cpp build folder with llama-bench and llama-quantize, "
                   "or `auto`: the build of scripts/build_llama_cpp.sh; adds Q8_0, F16 and Q4_K_M "
                   "rows of the same weights to the same interleaved run (embedded model, --preset)")
    p.add_argument("--llama-types", nargs="+", metavar="TYPE",
                   help="llama.cpp quants instead of Q8_0 F16 Q4_K_M (e.g. Q5_K_M Q4_K_S Q4_0)")
    p.add_argument("--int8-ratios", nargs="+", type=float, metavar="R",
                   help="tiered rows of the 4-bit packs: each share of the neurons per layer in "
                        "the int8 tier (below gamma), beside the one-tier row")
    p.add_argument("--quick", action="store_true", help="small grid, few tokens (CI)")
    p.add_argument("--out", help="folder for bench.json and the plot")
    p.add_argument("--json-only", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="accuracy against dense on held-out sets, with ablations")
    _model(p)
    p.add_argument("--data", help="folder of eval JSONL files (default: the shipped eval sets)")
    p.add_argument("--dense-model", help="packed model whose dense run is the reference (e.g. the "
                   "float pack when --model is a quantized one; default: --model)")
    p.add_argument("--limit", type=int, default=20, help="items per task (default 20)")
    p.add_argument("--grid", nargs="+", metavar="G,P",
                   help=f"{GRID_HELP} (default 0.9,0.7 0.7,0.7 0.7,0.5 0.5,0.35)")
    p.add_argument("--strategies", help="comma list of selection strategies besides published")
    p.add_argument("--only", help="comma list of methods to run besides dense")
    _compute_modes(p, "each grid point with per-token selection too, method selectinfer-token")
    p.add_argument("--prose-task", default="summarization",
                   help="profile used for held-out prose (default 'summarization')")
    add_option(p, ModelOptions, "alpha")
    add_option(p, ModelOptions, "dtype", default=None)
    add_option(p, ModelOptions, "num_threads", "--threads", dest="threads", default=None)
    p.add_argument("--quick", action="store_true", help="one grid point, 3 items per task (CI)")
    p.add_argument("--cross-phrasing", action="store_true",
                   help="profiles of one phrasing on eval prompts of the other, both directions "
                   "(profiling/ -> eval_alt/, profiling_alt/ -> eval/)")
    p.add_argument("--alt-profiles", help="profiles made on profiling_alt/ (default: made once "
                   "into OUT/profiles-alt)")
    p.add_argument("--normalize", default="none", choices=["none", "token"],
                   help="score normalisation when making the alt profiles")
    p.add_argument("--agreement-only", action="store_true",
                   help="only next-token agreement on the eval texts (and the stored curve's prediction)")
    p.add_argument("--headline-only", action="store_true",
                   help="generate only QA and translation (summaries scored by reference ppl)")
    p.add_argument("--answers", metavar="TASKS", help="comma list (qa,translation,...): only "
                   "the generated answers of these tasks, no agreement or perplexity")
    p.add_argument("--task", help="answer every task with this profile (e.g. general: what runs "
                   "when no task is given; default: each task its own)")
    p.add_argument("--out", help="folder for eval.json and the plots")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("eval-choices", help="multiple-choice answers vs free text, dense vs "
                                            "SelectInfer (data/eval/choices.jsonl)")
    _model(p)
    p.add_argument("--data", default=str(DATA_DIR / "eval" / "choices.jsonl"),
                   help="JSONL: prompt, options, answer, task (default: data/eval/choices.jsonl)")
    p.add_argument("--grid", nargs="+", metavar="G,P", default=["0.7,0.7", "0.7,0.5"],
                   help=f"{GRID_HELP} (default 0.7,0.7 0.7,0.5)")
    p.add_argument("--limit", type=int, help="first N items only")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="free-text answer length (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="room latency probe repeats (default 5)")
    add_option(p, ModelOptions, "num_threads", "--threads", dest="threads", default=1)
    p.add_argument("--out", help="JSON report file")
    p.set_defaults(func=cmd_eval_choices)

    p = sub.add_parser("frontier", help="agreement with dense vs memory and speed of every "
                                        "configuration (ours, torch int8/int4, llama.cpp quants) "
                                        "on one set of held-out tokens")
    _model(p)
    add_option(p, ModelOptions, "task", help="profile for the selection (default: 'general', "
                                             "else the first listed)")
    p.add_argument("--data", help="text or JSONL file of held-out text (default: the eval sets, "
                                  "data/eval)")
    p.add_argument("--llama-cpp", help="llama.cpp build folder with llama-bench, llama-quantize "
                   "and llama-perplexity, or `auto`: the build of scripts/build_llama_cpp.sh; adds "
                   "the --llama-types rows scored on the same tokens")
    p.add_argument("--weights", nargs="+", help="pack --weights formats of ours (default: all)")
    p.add_argument("--gammas", nargs="+", type=float, metavar="G",
                   help="load ratios of ours, each with phi = gamma and 0.7 gamma "
                        "(default 1 0.9 0.8 0.7 0.6 0.5)")
    _compute_modes(p, "per-token rows at --token-shares beside the prompt mode's phi = gamma "
                      "and 0.7 gamma")
    p.add_argument("--token-shares", nargs="+", type=float, metavar="S",
                   help="phi / gamma of the token rows (default 0.7 0.5)")
    p.add_argument("--phi-shares", nargs="+", type=float, metavar="S",
                   help="phi / gamma of the prompt mode's rows (default 1 0.7)")
    p.add_argument("--int8-ratios", nargs="+", type=float, metavar="R",
                   help="tiered rows of the 4-bit packs: each share of the neurons per layer in "
                        "the int8 tier (below gamma), beside the one-tier row")
    p.add_argument("--rankings", nargs="+", choices=("profile", "random"), metavar="RANKING",
                   help="selection orders of the rows with gamma < 1 or an int8 tier: profile "
                        "(the default), random (the ablation: the same bytes, no profile)")
    p.add_argument("--llama-types", nargs="+", metavar="TYPE",
                   help=f"llama.cpp quants to row (default {' '.join(FRONTIER_TYPES)})")
    p.add_argument("--merge", metavar="FRONTIER_JSON", help="keep this earlier run's rows (same "
                   "model and held-out tokens), this run's replacing those of the same name")
    p.add_argument("--no-quant", action="store_true", help="skip torch int8/int4 weight-only")
    p.add_argument("--tokens", type=int, default=2040,
                   help="held-out tokens to score (default 2040: 8 chunks of 512; fewer when "
                        "the text is short)")
    p.add_argument("--ctx", type=int, default=512, help="chunk length; the second half of each "
                                                        "chunk is scored (default 512)")
    add_option(p, ModelOptions, "num_threads", "--threads", dest="threads", default=1,
               help="threads of the decode speed runs")
    p.add_argument("--score-threads", type=int, help="threads of the scoring passes (default: "
                                                     "torch's)")
    p.add_argument("--repeats", type=int, default=3, help="decode runs per configuration; the "
                                                          "median is kept (default 3)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per decode run (default 16)")
    p.add_argument("--base", help="the dense model's log-probs from an earlier run on the same "
                                  "tokens (llama-perplexity's --kl-divergence-base layout; a run "
                                  "with --out keeps its own as dense-logits.kld) instead of "
                                  "computing them")
    p.add_argument("--out", help="folder for frontier.json and frontier.png")
    p.set_defaults(func=cmd_frontier)
