"""Serving requests: a bounded queue and one worker thread that owns the model.

ROS-free. The inference node is an adapter: its goal callback calls :func:`goal_config`,
:meth:`Server.check_prompt` and :meth:`Server.admit` (all answer at once), its accepted callback
submits a :class:`GoalJob` whose callbacks publish feedback and the result, and its lifecycle
transitions call :meth:`Server.load`, :meth:`Server.drain` and :meth:`Server.unload`.

Guarantees: goals start in arrival order; a goal canceled while it waits leaves the queue at
once (its slot is free for the next goal); a running goal is canceled or aborted within one decode
step; a task switch (reload) waits in the same queue, may be abandoned only while it waits, and
once started always completes before its caller hears back.

Up to ``max_batch`` goals decode together (:class:`Batch`: one pass over the weights per token):
a goal at the head of the queue joins the running ones after its own prefill when there is room
(:meth:`Engine.batch_refusal`; no ``choices``, no task switch), whatever its compute ratio: the
rows compute the union of their neurons, each masked to its own. Any other job at the head (a
task switch, a ``choices`` goal, a goal under per-token selection, a call) waits until the running
goals are done, then runs alone. ``max_batch`` 1: one goal at a time.
"""
from __future__ import annotations

import collections
import copy
import math
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from ..execution.batch import Batch
from ..execution.chat import Chat, goal_chat, render, tool_grammar
from ..execution.constrain import GrammarError, grammars_available
from ..execution.engine import (Canceled, ChoiceResult, ContextLengthError, GenerationConfig,
                                GenerationResult, check_choice_sizes, encode, validate_choices)
from ..format.safetensors_io import FormatError
from ..options import MAX_RELOAD_TIMEOUT, NodeSettings
from ..selection.loader import SwitchCanceled, SwitchReport

# Error codes, named as the Generate action's result constants.
NONE, UNKNOWN, INVALID_GOAL, UNKNOWN_TASK = "NONE", "UNKNOWN", "INVALID_GOAL", "UNKNOWN_TASK"
PROMPT_TOO_LONG, QUEUE_FULL, PROFILE_SWITCH_FAILED = "PROMPT_TOO_LONG", "QUEUE_FULL", "PROFILE_SWITCH_FAILED"
GENERATION_FAILED, NO_MODEL, CANCELED = "GENERATION_FAILED", "NO_MODEL", "CANCELED"

# A prompt with more characters than this per context token is refused before tokenizing it
# (the goal callback must answer at once, even for an absurd prompt).
MAX_CHARS_PER_TOKEN = 100
MAX_CHOICES_CHECKED = 64  # more choices than this are refused before tokenizing any
MAX_NAME_CHARS = 64  # names (tasks) echoed in messages and logs are cut to this many characters
REFUSED = "rejected"  # finish_reason of a goal the node would not serve (ended at once, ABORTED)
MAX_REASON_CHARS = 400  # a rejection reason kept for diagnostics (last_rejection)
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # dividing logits by less overflows
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings a goal may give, characters each
# a json_schema/grammar goal that comes while the vocabulary is still being prepared (the load
# waits for it up to VOCAB_BUILD_SECONDS) waits this long, then is refused with NO_MODEL (retry)
VOCAB_WAIT_SECONDS = 0.5
VOCAB_BUILD_SECONDS = 120.0


def short(text: str, limit: int = MAX_NAME_CHARS) -> str:
    """``text`` cut to ``limit`` characters (``...`` marks a cut), for echoing untrusted names."""
    return text if len(text) <= limit else text[:limit] + "..."


def reload_timeout(requested: float, default: float) -> float:
    """Seconds a reload may wait for the goals ahead of it: ``requested`` (0 = ``default``),
    clamped to MAX_RELOAD_TIMEOUT (``inf`` too); Rejected(INVALID_GOAL) for NaN or < 0."""
    value = float(requested)
    if math.isnan(value) or value < 0:
        raise Rejected(INVALID_GOAL, f"timeout must be >= 0 seconds (0 = the node's "
                                     f"reload_timeout), got {value:g}")
    if value == 0:
        value = float(default)
    return min(value, MAX_RELOAD_TIMEOUT)


class Superseded(RuntimeError):
    """A task switch that waited was replaced by a later one (the last requested task wins)."""


class Rejected(Exception):
    """A request refused, with an error code and the reason."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class Outcome:
    """How a goal ended: ``status`` succeeded, canceled or aborted, with a code and a reason."""

    status: str
    code: str = NONE
    message: str = ""
    result: GenerationResult | None = None
    choice: ChoiceResult | None = None  # a choices goal's answer
    task: str = ""
    load_ratio: float = 0.0
    compute_ratio: float = 0.0


class GoalJob:
    """One accepted goal. The callbacks run on the worker thread (``on_done`` may also run on
    the thread that cancels a waiting goal or drains the queue)."""

    def __init__(self, prompt: str, config: GenerationConfig, task: str, compute_ratio: float,
                 cancel_requested: Callable[[], bool], on_start: Callable[[], None],
                 on_text: Callable[[str, int], None], on_done: Callable[[Outcome], None],
                 choices: list[str] | None = None, length_normalize: bool = False):
        self.prompt, self.config, self.task, self.compute_ratio = prompt, config, task, compute_ratio
        self.choices = list(choices or [])  # non-empty: answer with the most likely one
        self.length_normalize = length_normalize
        self.cancel_requested = cancel_requested
        self.on_start, self.on_text, self.on_done = on_start, on_text, on_done
        self.abort_reason: str | None = None  # set by drain/stop/end_running
        self.abort_code = NO_MODEL  # the error code of an abort_reason
        self.started_at: float | None = None  # time.monotonic() when it started running
        self.refused: Rejected | None = None  # set when the goal cannot run (it is aborted)
        self.outcome: Outcome | None = None


class _Reload:
    def __init__(self, task: str):
        self.task = task
        self.state = "queued"  # queued, running, abandoned, done
        self.done = threading.Event()
        self.report: SwitchReport | None = None
        self.error: Exception | None = None
        self.abandon = ""  # set (the reason) by drain/stop: a running reload stops before applying
        self.superseded_by: str | None = None  # a later reload took this one's place


class _Call:
    """Work run on the worker thread (model load and unload) with its result or exception."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def goal_prompt(goal) -> str | Chat:
    """What a goal asks to answer: its conversation (``messages``, ``tools``, ``tool_choice``),
    else its prompt."""
    chat = goal_chat(goal)
    return goal.prompt if chat is None else chat


def _check_chat(goal, chat: Chat | None) -> None:
    """Rejected(INVALID_GOAL) unless the goal gives a prompt or a well-formed conversation (not
    both), and tools only with a conversation and no other constraint."""
    if chat is None:
        if not goal.prompt or not goal.prompt.strip():
            raise Rejected(INVALID_GOAL, "empty prompt (give a prompt or messages)")
        if getattr(goal, "tools", None) or getattr(goal, "tool_choice", ""):
            raise Rejected(INVALID_GOAL, "tools and tool_choice need messages (a conversation)")
        return
    if goal.prompt.strip():
        raise Rejected(INVALID_GOAL, "give a prompt or messages, not both")
    try:
        chat.validate()
    except ValueError as e:
        raise Rejected(INVALID_GOAL, short(str(e), MAX_REASON_CHARS)) from None
    if chat.tools and (goal.choices or getattr(goal, "json_schema", "") or
                       getattr(goal, "grammar", "")):
        raise Rejected(INVALID_GOAL, "tools and choices/json_schema/grammar are mutually "
                                     "exclusive; give one")


def goal_config(goal, settings: NodeSettings, rt) -> tuple[GenerationConfig, float]:
    """The GenerationConfig and compute ratio of a goal (any object with the Generate goal's
    fields), or Rejected with the reason. No tokenization here: every check is cheap, so even
    an absurd goal is answered at once. With ``choices`` the sampling fields, ``stop`` and
    ``max_new_tokens`` are ignored (as Generate.action says). A goal with tools answers under
    their grammar (:func:`.chat.tool_grammar`)."""
    chat = goal_chat(goal)
    _check_chat(goal, chat)
    if goal.task and goal.task != rt.task and goal.task not in rt.tasks:
        known = ", ".join(rt.tasks) or "none (no profiles folder)"
        raise Rejected(UNKNOWN_TASK, f"unknown task {short(goal.task)!r}; tasks: {known}")
    choices = bool(goal.choices)
    json_schema, grammar = getattr(goal, "json_schema", ""), getattr(goal, "grammar", "")
    if choices and (json_schema or grammar):
        raise Rejected(INVALID_GOAL, "choices and json_schema/grammar are mutually exclusive; "
                                     "give one")
    if json_schema and grammar:
        raise Rejected(INVALID_GOAL, "json_schema and grammar are mutually exclusive; give one")
    n = settings.max_new_tokens if choices else (goal.max_new_tokens or settings.max_new_tokens)
    if n > settings.max_new_tokens_limit:
        raise Rejected(INVALID_GOAL, f"max_new_tokens {n} exceeds the limit "
                                     f"{settings.max_new_tokens_limit}")
    if not math.isfinite(goal.compute_ratio):
        raise Rejected(INVALID_GOAL, "compute_ratio is not a finite number")
    if goal.compute_ratio < 0:
        raise Rejected(INVALID_GOAL, f"compute_ratio must be in (0, 1] (0 = node default), "
                                     f"got {goal.compute_ratio:g}")
    try:
        phi = rt.ratios_for(settings.compute_ratio).with_compute(float(goal.compute_ratio)).compute
    except ValueError as e:
        if rt.selective is not None:
            raise Rejected(INVALID_GOAL, str(e)) from None
        phi = 1.0  # the dense model computes every neuron
    phi_override = phi if rt.selective is not None and abs(phi - rt.compute_ratio) > 1e-9 else None
    if choices:  # sampling fields, stop and max_new_tokens are ignored
        return GenerationConfig(max_new_tokens=int(n), use_chat_template=bool(goal.use_chat_template),
                                special_tokens=settings.prompt_special_tokens,
                                compute_ratio=phi_override), phi
    _check_sampling(goal)
    cfg = GenerationConfig(
        max_new_tokens=int(n), temperature=float(goal.temperature), top_k=int(goal.top_k),
        top_p=float(goal.top_p) if goal.top_p > 0 else 1.0,
        repetition_penalty=float(goal.repetition_penalty) if goal.repetition_penalty > 0 else 1.0,
        seed=int(goal.seed) if goal.seed >= 0 else None,
        stop=[s for s in goal.stop if s], use_chat_template=bool(goal.use_chat_template),
        special_tokens=settings.prompt_special_tokens, compute_ratio=phi_override,
        json_schema=json_schema, grammar=grammar, lenient=bool(settings.schema_lenient))
    if chat is not None and chat.tools:
        cfg.grammar = tool_grammar(chat, rt.engine.tool_format)
        cfg.tool_calls = chat.calls_allowed
    try:
        cfg.validate()
    except ValueError as e:
        raise Rejected(INVALID_GOAL, str(e)) from None
    return cfg, phi


def _check_sampling(goal) -> None:
    """Rejected(INVALID_GOAL) unless the sampling fields and stop strings are in a sane range."""
    for name in ("temperature", "top_p", "repetition_penalty"):
        if not math.isfinite(getattr(goal, name)):
            raise Rejected(INVALID_GOAL, f"{name} is not a finite number")
    if not 0 <= goal.temperature <= MAX_TEMPERATURE:
        raise Rejected(INVALID_GOAL, f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = "
                                     f"greedy), got {goal.temperature:g}")
    if goal.top_p < 0 or goal.top_p > 1:
        raise Rejected(INVALID_GOAL, f"top_p must be in [0, 1] (0 = off), got {goal.top_p:g}")
    rp = goal.repetition_penalty
    if rp != 0 and not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
        raise Rejected(INVALID_GOAL, f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                                     f"{MAX_REPETITION_PENALTY:g}] (0 = off), got {rp:g}")
    if goal.top_k < 0:
        raise Rejected(INVALID_GOAL, f"top_k must be >= 0 (0 = off), got {goal.top_k}")
    if len(goal.stop) > MAX_STOPS:
        raise Rejected(INVALID_GOAL, f"{len(goal.stop)} stop strings; at most {MAX_STOPS}")
    longest = max((len(s) for s in goal.stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise Rejected(INVALID_GOAL, f"a stop string has {longest} characters; at most "
                                     f"{MAX_STOP_CHARS}")


class Server:
    """The queue and the worker thread (see the module docstring)."""

    def __init__(self, queue_length: int = 4, log: Callable[[str], None] = lambda s: None,
                 max_batch: int = 1):
        self.queue_length = queue_length
        self.max_batch = max_batch  # goals that decode together (read when a batch forms)
        self.log = log
        self.on_switch: Callable[[SwitchReport], None] = lambda report: None
        self.accepting = False  # goals are admitted only while true (the node is active)
        self.runtime = None
        self.state = "unloaded"  # unloaded, loading, loaded, load failed: ...
        self.rejected_without_model = 0
        self.last_rejection = ""
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._in_system = 0  # admitted goals not finished (running + waiting)
        self._running: list[GoalJob] = []  # in the order they started
        self.aggregate_tokens_per_second = 0.0  # decode tok/s of all goals of the last batch
        self._reloading = False  # a reload is running on the worker
        self._current_reload: _Reload | None = None
        self._stopping = False
        self._worker: threading.Thread | None = None
        self._check_lock = threading.Lock()  # the goal callbacks' own tokenizer
        self._check_tokenizer = None

    # ---- worker ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (once)."""
        with self._lock:
            if self._worker is not None and self._worker.is_alive():
                return
            self._stopping = False
            self._worker = threading.Thread(target=self._work, name="selectinfer-worker", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                if isinstance(job, GoalJob):
                    self._running.append(job)
                elif isinstance(job, _Reload):
                    job.state = "running"
                    self._reloading = True
                    self._current_reload = job
            batched = False
            try:
                if isinstance(job, GoalJob):
                    batched = self._batchable(job)
                    (self._run_batch if batched else self._run_goal)(job)
                elif isinstance(job, _Reload):
                    self._run_reload(job)
                else:
                    self._run_call(job)
            except Exception as e:  # noqa: BLE001 - never let the worker die
                self.log(f"worker: unexpected {type(e).__name__}: {e}\n{traceback.format_exc()}")
            finally:
                with self._lock:
                    self._reloading = False
                    self._current_reload = None
                    if isinstance(job, GoalJob) and not batched:
                        self._leave_locked(job)

    def _leave_locked(self, job: GoalJob) -> None:
        """A running goal is done (with the lock held)."""
        if job in self._running:
            self._running.remove(job)
        self._in_system -= 1

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread after the jobs ahead of it; its value or exception."""
        call = _Call(fn)
        with self._cond:
            if self._worker is None or not self._worker.is_alive():
                raise RuntimeError("the serving worker is not running")
            self._queue.append(call)
            self._cond.notify()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.value

    @staticmethod
    def _run_call(call: _Call) -> None:
        try:
            call.value = call.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            call.error = e
        finally:
            call.done.set()

    # ---- model ----------------------------------------------------------------------------
    def load(self, make: Callable[[], Any]) -> Any:
        """Build the runtime with ``make()`` on the worker thread (so the model and its
        tokenizer stay with the thread that uses them); raises what ``make`` raised."""
        self.state = "loading"

        def build():
            rt = make()
            checker = copy.deepcopy(rt.engine.tokenizer)
            rt.engine.tool_format  # how its chat template takes tools, found once here
            if grammars_available():
                # The vocabulary for constrained goals, as part of the load: llguidance holds the
                # GIL while it builds it (Gemma 3's 262144 tokens: 2.5 s, up to 5 s on a busy
                # machine), which built in the background stalled the node's callbacks just as
                # it became active: a goal sent when wait_for_server() returned was answered
                # 1.5-5 s later.
                rt.engine.grammars.wait_ready(VOCAB_BUILD_SECONDS)
            return rt, checker

        try:
            rt, checker = self._call(build)
        except Exception as e:
            self.state = f"load failed: {type(e).__name__}: {e}"
            raise
        with self._check_lock:
            self._check_tokenizer = checker
        self.runtime = rt
        self.state = "loaded"
        return rt

    def unload(self) -> None:
        """Drop the runtime (after the jobs ahead of it) and free its memory."""
        def drop():
            self.runtime = None
            import gc
            gc.collect()

        if self._worker is not None and self._worker.is_alive():
            self._call(drop)
        else:
            drop()
        with self._check_lock:
            self._check_tokenizer = None
        self.state = "unloaded"

    # ---- goals ----------------------------------------------------------------------------
    def check_prompt(self, prompt: str | Chat, use_chat_template: bool,
                     special_tokens: bool = False) -> int:
        """Tokens of ``prompt`` (a conversation: as its chat template renders it) if it fits the
        context, else Rejected. Uses a tokenizer of its own (never the worker's), so the answer
        does not depend on what the worker is doing."""
        rt = self.runtime
        if rt is None:
            raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
        limit = rt.engine.context_limit
        chars = prompt.chars() if isinstance(prompt, Chat) else len(prompt)
        if chars > limit * MAX_CHARS_PER_TOKEN:
            what = "the conversation" if isinstance(prompt, Chat) else "prompt"
            raise Rejected(PROMPT_TOO_LONG, f"{what} has {chars} characters; the context "
                                            f"limit is {limit} tokens")
        with self._check_lock:
            tok = self._check_tokenizer
            if tok is None:
                raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
            try:
                ids = (render(tok, prompt, rt.engine.tool_format, special_tokens).ids
                       if isinstance(prompt, Chat) else
                       encode(tok, prompt, use_chat_template, special_tokens))
            except ValueError as e:  # e.g. no chat template
                raise Rejected(INVALID_GOAL, str(e)) from None
            except Exception as e:  # noqa: BLE001 - a tokenizer failure is the goal's problem
                raise Rejected(INVALID_GOAL, f"prompt could not be tokenized: "
                                             f"{type(e).__name__}: {e}") from None
        try:
            rt.engine.check_prompt(len(ids))
        except ContextLengthError as e:
            raise Rejected(PROMPT_TOO_LONG, str(e)) from None
        except ValueError as e:
            raise Rejected(INVALID_GOAL, str(e)) from None
        return len(ids)

    def check_choices(self, choices: list[str], prompt_tokens: int) -> None:
        """Rejected(INVALID_GOAL) when ``choices`` cannot be scored after a prompt of
        ``prompt_tokens`` tokens (at most 64, none empty or repeated, each fits the context, at
        most MAX_CHOICE_TOKENS in all); sizes are checked in characters before tokenizing, with
        the goal callbacks' own tokenizer."""
        rt = self.runtime
        if rt is None:
            raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
        try:  # counts and characters first: nothing absurd is tokenized
            check_choice_sizes(list(choices), rt.engine.context_limit)
        except ValueError as e:
            raise Rejected(INVALID_GOAL, f"invalid choices: {e}") from None
        with self._check_lock:
            tok = self._check_tokenizer
            if tok is None:
                raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
            try:
                # + 1 token: the space Engine.choose may put between prompt and choice
                ids = [tok(c, add_special_tokens=False)["input_ids"] + [0]
                       for c in choices[:MAX_CHOICES_CHECKED]]
                validate_choices(list(choices), rt.engine, prompt_tokens, ids
                                 if len(choices) <= MAX_CHOICES_CHECKED else None)
            except ValueError as e:
                raise Rejected(INVALID_GOAL, f"invalid choices: {e}") from None

    def check_tools(self, chat: Chat) -> None:
        """Rejected(INVALID_GOAL) naming the first tool whose parameters schema does not compile
        (bounded and cached as a json_schema goal's); NO_MODEL while the vocabulary is being
        prepared."""
        rt = self.runtime
        if rt is None:
            raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
        for tool in chat.tools:
            if tool.parameters.strip():
                try:
                    self.check_constraint(GenerationConfig(json_schema=tool.parameters))
                except Rejected as e:
                    if e.code != INVALID_GOAL:
                        raise
                    raise Rejected(INVALID_GOAL, short(f"tool {tool.name!r}: {e.reason}",
                                                       MAX_REASON_CHARS)) from None

    def check_constraint(self, config: GenerationConfig) -> None:
        """Rejected(INVALID_GOAL) when the goal's JSON schema or grammar is invalid or takes
        longer than the bound to compile (constrain.COMPILE_SECONDS; compiled off this thread,
        cached by content: the worker reuses it); Rejected(NO_MODEL) while the model's
        vocabulary is still being prepared."""
        constraint = config.constraint
        if constraint is None:
            return
        rt = self.runtime
        if rt is None:
            raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
        grammars = rt.engine.grammars
        if not grammars.wait_ready(VOCAB_WAIT_SECONDS):  # the goal callback answers at once
            raise Rejected(NO_MODEL, "constrained decoding is still preparing the model's "
                                     "vocabulary (a few seconds after configure); retry")
        try:
            grammars.compile(*constraint)
        except GrammarError as e:
            raise Rejected(INVALID_GOAL, short(str(e), MAX_REASON_CHARS)) from None

    def admit(self) -> None:
        """Reserve a place for one goal, or Rejected (not serving, no model, queue full)."""
        with self._lock:
            if self._stopping or not self.accepting:
                raise Rejected(NO_MODEL, "node is not active (deactivating, shutting down or "
                                         "not yet configured)")
            if self.runtime is None:
                raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
            if self._in_system >= self.queue_length + self._max_running():
                raise Rejected(QUEUE_FULL, f"queue full: {self._in_system} goals in progress, "
                                           f"queue_length {self.queue_length}")
            self._in_system += 1

    def _max_running(self) -> int:
        """Goals that may run at once: ``max_batch`` where the model's goals batch (not per-token
        selection), else 1."""
        rt = self.runtime
        if self.max_batch < 2 or rt is None or getattr(rt.engine, "decoder", None) is None:
            return 1
        return self.max_batch if rt.engine.batch_refusal(GenerationConfig()) is None else 1

    def release(self) -> None:
        """Give back the place of an admitted goal that will not be submitted."""
        with self._lock:
            self._in_system = max(0, self._in_system - 1)

    def note_rejection(self, e: Rejected) -> None:
        with self._lock:
            if self.runtime is not None:
                self.runtime.stats.rejected += 1
            else:
                self.rejected_without_model += 1
            self.last_rejection = short(f"{e.code}: {e.reason}", MAX_REASON_CHARS)

    def submit(self, job: GoalJob) -> None:
        """Queue an admitted goal (see :meth:`admit`)."""
        with self._cond:
            if self._stopping:
                self._in_system -= 1
                abort = True
            else:
                self._queue.append(job)
                self._cond.notify()
                abort = False
        if abort:
            self._finish(job, Outcome("aborted", NO_MODEL, "node shutting down"))

    def cancel(self, job: GoalJob) -> bool:
        """A client's cancel: a waiting goal leaves the queue now (True; it ends CANCELED); a
        running one stops within a decode step (its ``cancel_requested`` is polled)."""
        with self._lock:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            self._in_system -= 1
        self._finish(job, Outcome("canceled", CANCELED, "canceled before it started"))
        return True

    def drain(self, reason: str, timeout: float = 30.0) -> bool:
        """Stop admitting goals; abort the waiting ones and the running one (within one decode
        step) with ``reason``; True once the worker is idle within ``timeout``."""
        with self._lock:
            self.accepting = False
            waiting = [j for j in self._queue if isinstance(j, (GoalJob, _Reload))]
            for j in waiting:
                self._queue.remove(j)
            self._in_system -= sum(isinstance(j, GoalJob) for j in waiting)
            for job in self._running:
                job.abort_code, job.abort_reason = NO_MODEL, reason
            if self._current_reload is not None:
                self._current_reload.abandon = reason
        for j in waiting:
            if isinstance(j, GoalJob):
                self._finish(j, Outcome("aborted", NO_MODEL, reason))
            else:
                j.state, j.error = "done", RuntimeError(reason)
                j.done.set()
        return self.wait_idle(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """True once no goal runs or waits (polled), False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._running and not any(isinstance(j, GoalJob) for j in self._queue):
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def stop(self, reason: str = "node shutting down", timeout: float = 10.0) -> bool:
        """Drain with ``reason`` and end the worker thread; True if it ended within ``timeout``."""
        self.drain(reason, timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
        return worker is None or not worker.is_alive()

    def end_running(self, job: GoalJob, code: str, reason: str) -> bool:
        """End ``job`` with ``code`` and ``reason`` if it is the running goal (within one decode
        step; aborted with the text so far); False if it is not running."""
        with self._lock:
            if job not in self._running or job.abort_reason is not None:
                return False
            job.abort_code, job.abort_reason = code, reason
        return True

    @property
    def running(self) -> GoalJob | None:
        """The goal that started first of those running now, or None."""
        with self._lock:
            return self._running[0] if self._running else None

    @property
    def running_jobs(self) -> list[GoalJob]:
        """The goals running now (several while they decode in a batch)."""
        with self._lock:
            return list(self._running)

    @property
    def generating(self) -> bool:
        return bool(self._running)

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._in_system - len(self._running)

    def _finish(self, job: GoalJob, outcome: Outcome) -> None:
        rt = self.runtime
        if rt is not None:
            with self._lock:
                if outcome.status == "succeeded":
                    rt.stats.succeeded += 1
                    res = outcome.result
                    rt.stats.closed_early += bool(res is not None and res.closed_early)
                    rt.stats.loops_broken += bool(res is not None and res.loops_broken)
                elif outcome.status == "canceled":
                    rt.stats.canceled += 1
                else:
                    rt.stats.aborted += 1
            outcome.task = outcome.task or rt.task
            outcome.load_ratio = outcome.load_ratio or float(rt.load_ratio)
        job.outcome = outcome
        job.on_done(outcome)

    def _begin(self, job: GoalJob) -> Outcome | None:
        """Mark ``job`` started; the outcome it ends with before it runs (canceled or aborted
        while it waited, refused, no model), or None."""
        job.started_at = time.monotonic()
        job.on_start()
        if job.cancel_requested():
            return Outcome("canceled", CANCELED, "canceled before it started")
        if job.abort_reason is not None:
            return Outcome("aborted", job.abort_code, job.abort_reason)
        if job.refused is not None:
            return Outcome("aborted", job.refused.code, job.refused.reason)
        if self.runtime is None:
            return Outcome("aborted", NO_MODEL, f"no model loaded ({self.state})")
        return None

    @staticmethod
    def _failure(job: GoalJob, e: Exception) -> Outcome:
        """The outcome of a goal whose run raised ``e``."""
        if isinstance(e, Canceled):
            if job.cancel_requested():
                return Outcome("canceled", CANCELED, "canceled by client")
            return Outcome("aborted", job.abort_code, str(job.abort_reason))
        if isinstance(e, Rejected):
            return Outcome("aborted", e.code, e.reason)
        if isinstance(e, ContextLengthError):
            return Outcome("aborted", PROMPT_TOO_LONG, str(e))
        if isinstance(e, ValueError):
            return Outcome("aborted", INVALID_GOAL, str(e))
        return Outcome("aborted", GENERATION_FAILED, f"generation failed: {type(e).__name__}: {e}")

    @staticmethod
    def _stop(job: GoalJob) -> Callable[[], bool]:
        return lambda: job.cancel_requested() or job.abort_reason is not None

    def _run_goal(self, job: GoalJob) -> None:
        rt = self.runtime
        early = self._begin(job)
        if early is not None:
            return self._finish(job, early)
        stop = self._stop(job)
        try:
            if job.task and job.task != rt.task:
                self._switch(rt, job.task, cancel=stop)
            if job.choices:
                choice = rt.choose(job.prompt, job.choices, length_normalize=job.length_normalize,
                                   compute_ratio=job.config.compute_ratio,
                                   use_chat_template=job.config.use_chat_template, cancel=stop,
                                   special_tokens=job.config.special_tokens)
                return self._finish(job, Outcome("succeeded", choice=choice, task=rt.task,
                                                 load_ratio=float(rt.load_ratio),
                                                 compute_ratio=job.compute_ratio))
            res = rt.generate(job.prompt, job.config, on_text=job.on_text, cancel=stop)
        except Exception as e:  # noqa: BLE001 - abort this goal, keep serving
            return self._finish(job, self._failure(job, e))
        self._finish(job, self._outcome(job, res, rt))

    @staticmethod
    def _outcome(job: GoalJob, res: GenerationResult, rt) -> Outcome:
        """A generation's outcome: succeeded, or canceled / aborted with the text so far."""
        out = Outcome("succeeded", result=res, task=rt.task, load_ratio=float(rt.load_ratio),
                      compute_ratio=job.compute_ratio)
        if res.finish_reason == "canceled":
            if job.cancel_requested():
                out.status, out.code, out.message = "canceled", CANCELED, "canceled by client"
            else:
                out.status, out.code = "aborted", job.abort_code
                out.message = f"{job.abort_reason}; generation stopped after " \
                              f"{res.metrics.generated_tokens} tokens"
        return out

    # ---- goals decoded together -----------------------------------------------------------
    def _batchable(self, job: GoalJob) -> bool:
        """Whether ``job`` may decode in a batch (see the module docstring)."""
        rt = self.runtime
        if self.max_batch < 2 or rt is None or job.choices or job.refused is not None:
            return False
        if job.task and job.task != rt.task:
            return False
        return getattr(rt.engine, "decoder", None) is not None and \
            rt.engine.batch_refusal(job.config) is None

    def _next_for_batch(self, batch: Batch) -> GoalJob | None:
        """The goal at the head of the queue, taken out to join ``batch`` (None: no room, or the
        head is not a goal that may join)."""
        with self._lock:
            if batch.room <= 0 or not self._queue or self._stopping:
                return None
            head = self._queue[0]
            if not isinstance(head, GoalJob) or not self._batchable(head):
                return None
            self._queue.popleft()
            self._running.append(head)
            return head

    def _end_batched(self, job: GoalJob, outcome: Outcome) -> None:
        self._finish(job, outcome)
        with self._lock:
            self._leave_locked(job)

    def _join(self, batch: Batch, job: GoalJob, jobs: dict) -> None:
        """Start ``job``: its prefill, then it decodes with the batch (or it ends here)."""
        early = self._begin(job)
        if early is not None:
            return self._end_batched(job, early)
        try:
            stream = batch.join(job.prompt, job.config, on_text=job.on_text, cancel=self._stop(job))
        except Exception as e:  # noqa: BLE001 - abort this goal, keep serving
            return self._end_batched(job, self._failure(job, e))
        if stream.finish is not None:
            return self._complete(job, stream)
        jobs[id(stream)] = job

    def _complete(self, job: GoalJob, stream) -> None:
        rt = self.runtime
        res = stream.result()
        rt.stats.record(res.metrics)
        self._end_batched(job, self._outcome(job, res, rt))

    def _run_batch(self, first: GoalJob) -> None:
        """Decode ``first`` and every goal that may join it, until none runs (worker thread)."""
        batch = Batch(self.runtime.engine, self.max_batch)
        jobs: dict[int, GoalJob] = {}  # id(stream) -> its goal
        pending: GoalJob | None = first
        t_steps = 0.0  # seconds in batched steps
        try:
            while True:
                while pending is not None:
                    self._join(batch, pending, jobs)
                    pending = self._next_for_batch(batch)
                if not batch.running and not batch.pending:
                    return
                try:
                    t0 = time.perf_counter()
                    ended = batch.step()
                    t_steps += time.perf_counter() - t0
                    self.aggregate_tokens_per_second = batch.rows / t_steps
                except Exception as e:  # noqa: BLE001 - abort these goals, keep serving
                    self.log(f"batched step failed: {type(e).__name__}: {e}\n"
                             f"{traceback.format_exc()}")
                    for s in batch.cancel_all():
                        self._end_batched(jobs.pop(id(s)), Outcome(
                            "aborted", GENERATION_FAILED,
                            f"generation failed: {type(e).__name__}: {e}"))
                    return
                for s in ended:
                    self._complete(jobs.pop(id(s)), s)
                pending = self._next_for_batch(batch)
        finally:
            for s in batch.cancel_all():  # only after an unexpected error
                self._end_batched(jobs.pop(id(s)), Outcome("aborted", GENERATION_FAILED,
                                                           "the batch ended unexpectedly"))

    # ---- task switches --------------------------------------------------------------------
    def _switch(self, rt, task: str, cancel: Callable[[], bool] | None = None) -> SwitchReport:
        """Switch base neurons (worker thread); Rejected on failure, Canceled when ``cancel()``
        turns true before the switch is applied; the previous task stays active then."""
        before = rt.task
        if task not in rt.tasks:
            raise Rejected(UNKNOWN_TASK, f"unknown task {short(task)!r}; tasks: "
                                         f"{', '.join(rt.tasks) or 'none (no profiles folder)'}")
        try:
            report = rt.switch_task(task, cancel=cancel)
        except SwitchCanceled:
            raise Canceled from None
        except KeyError as e:
            raise Rejected(UNKNOWN_TASK, short(str(e.args[0]) if e.args else str(e),
                                               MAX_REASON_CHARS)) from None
        except (FormatError, ValueError, OSError) as e:
            raise Rejected(PROFILE_SWITCH_FAILED, f"profile switch to {short(task)!r} refused "
                                                  f"({short(str(e), MAX_REASON_CHARS)}); "
                                                  f"{before!r} stays active") from None
        self.log(f"switched base neurons {before!r} -> {short(task)!r} in {report.seconds:.3f} s: read "
                 f"{report.bytes_read / 2**20:.2f} MiB ({report.neurons_read} neurons), dropped "
                 f"{report.neurons_dropped} (full load: {rt.bytes_read / 2**20:.1f} MiB in "
                 f"{rt.load_seconds:.2f} s)")
        self.on_switch(report)
        return report

    def _run_reload(self, job: _Reload) -> None:
        try:
            rt = self.runtime
            if rt is None:
                raise Rejected(NO_MODEL, f"no model loaded ({self.state})")
            if job.task and job.task != rt.task:
                job.report = self._switch(rt, job.task, cancel=lambda: job.abandon)
        except Canceled:
            job.error = RuntimeError(job.abandon or "reload canceled")
        except Exception as e:  # noqa: BLE001 - handed to the caller
            job.error = e
        finally:
            job.state = "done"
            job.done.set()

    def reload(self, task: str, timeout: float) -> SwitchReport | None:
        """Switch to ``task`` in queue order. Waits at most ``timeout`` seconds (clamped to
        MAX_RELOAD_TIMEOUT; NaN or negative: Rejected) for the jobs ahead of it (TimeoutError:
        the reload is abandoned and will not run); once started it completes before this
        returns, unless the node drains (RuntimeError, nothing applied). None when ``task`` is
        already active; Rejected on failure (the previous task stays active)."""
        timeout = reload_timeout(timeout, MAX_RELOAD_TIMEOUT) if timeout != 0 else 0.0
        job = _Reload(task)
        with self._cond:
            if self._stopping or self._worker is None or not self._worker.is_alive():
                raise Rejected(NO_MODEL, "node shutting down")
            waiting = next((j for j in self._queue if isinstance(j, _Reload)), None)
            if task in ("", self.task) and not self._reloading and waiting is None:
                return None  # no switch ahead could change the task: no need to wait for goals
            if waiting is not None:  # the last requested task wins; it takes the waiting one's place
                self._queue[self._queue.index(waiting)] = job
                waiting.state, waiting.superseded_by = "abandoned", task
                waiting.error = Superseded(
                    f"superseded by a later switch to {short(task or self.task)!r} (the last "
                    f"requested task wins); {short(waiting.task)!r} was not loaded")
                waiting.done.set()
            else:
                self._queue.append(job)
            self._cond.notify()
        if not job.done.wait(timeout):
            with self._lock:
                if job.state == "queued" and job in self._queue:
                    self._queue.remove(job)
                    job.state = "abandoned"
            if job.state == "abandoned" and job.superseded_by is None:
                raise TimeoutError(f"the reload waited {timeout:g} s for the goals ahead of it "
                                   f"and was abandoned; task {self.task!r} stays active")
            job.done.wait()
        if job.error is not None:
            raise job.error
        return job.report

    @property
    def task(self) -> str:
        rt = self.runtime
        return rt.task if rt is not None else ""
