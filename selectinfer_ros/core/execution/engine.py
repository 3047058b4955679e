"""Generation engine: prefill, selection, decode loop, sampling, streaming, stop strings.

Works on any transformers causal LM; with a :class:`SelectiveModel` it also drives the
per-request neuron selection (prefill computes every loaded neuron and chooses the dynamic
ones; decode computes only the active prefix).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from .chat import Chat, ToolFormat, parse_tool_calls, render
from .chat import tool_format as detect_tool_format
from .constrain import Budget, Constraint, Grammars, JsonKeys, repeating_token
from .decode import Decoder, unsupported
from .metrics import RequestMetrics
from .prompt_cache import MIN_REUSE_TOKENS, MIN_SUFFIX, Entry, PromptCache, chunk_end
from ..selection.selective_mlp import SelectionState


class ContextLengthError(ValueError):
    """The prompt does not fit the context window."""


class Canceled(Exception):
    pass


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    use_chat_template: bool = False
    special_tokens: bool = False  # control tokens typed in the prompt are read as such
    compute_ratio: float | None = None  # None = the model's setting
    ignore_eos: bool = False  # benchmarks: always produce max_new_tokens
    json_schema: str = ""  # non-empty: the answer is a JSON document valid under this schema
    grammar: str = ""  # non-empty: the answer matches this Lark grammar (llguidance's syntax)
    tool_calls: bool = False  # a chat with tools: a complete answer's calls are read back
    lenient: bool = False  # json_schema: keywords the constraint library lacks are ignored

    @property
    def constraint(self) -> tuple[str, str, bool] | None:
        """``(kind, source, lenient)`` of the goal's constraint, or None."""
        if self.json_schema:
            return "json_schema", self.json_schema, self.lenient
        if self.grammar:
            return "grammar", self.grammar, False
        return None

    def validate(self) -> None:
        if self.json_schema and self.grammar:
            raise ValueError("json_schema and grammar are mutually exclusive; give one")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


# A temperature below this samples as greedy decoding: dividing logits by it would overflow
# (1e-40 made every probability NaN) and the distribution is a point mass anyway.
GREEDY_BELOW = 1e-3


@dataclass
class GenerationResult:
    text: str
    finish_reason: str  # stop, length, context_length (the context window ended it), canceled;
    # grammar: a constrained answer is complete (the schema's or grammar's end, or EOS there);
    # closed: complete, ended early (closing tokens chosen) to fit max_new_tokens
    token_ids: list[int]
    metrics: RequestMetrics
    parsed: bool = False  # a constrained answer that is complete under its schema or grammar
    mask_seconds: float = 0.0  # time spent computing and applying the grammar's token masks
    tool_calls: list = field(default_factory=list)  # a chat with tools: the calls (chat.ToolCall)
    closed_early: bool = False  # constrained: complete, ended early to fit max_new_tokens
    loops_broken: int = 0  # constrained: steps where a repeating span was kept from repeating
    keys_refused: int = 0  # json_schema: tokens refused because they would repeat a key
    budget_seconds: list = field(default_factory=list)  # per token: the budget tracking's time
    warnings: list = field(default_factory=list)  # a lenient schema: what its compile ignored


PROMPT_SLOT = "\x00selectinfer-prompt\x00"  # where the prompt goes in a rendered chat template


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the largest logit ``[V]`` (the first of equal ones, as torch.argmax). A CPU
    float32 vector goes through numpy: torch.argmax took 0.40 ms over Gemma 3's 262144 logits,
    numpy 0.03 ms (Zen 4, 2 threads), a quarter of what three more goals add to a batched step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def encode(tok, prompt: str, use_chat_template: bool = False,
           special_tokens: bool = False) -> list[int]:
    """Token ids of ``prompt`` (as a user turn of the chat template, if asked). Control tokens
    typed in the prompt (``<eos>``, ``<end_of_turn>``, ...) are plain text unless
    ``special_tokens``: text from speech or a web page cannot end the user's turn. The chat
    template's own control tokens and the tokenizer's BOS are inserted either way."""
    split = not special_tokens
    if use_chat_template:
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        if PROMPT_SLOT in prompt:
            raise ValueError("the prompt contains the chat template's prompt marker")
        if special_tokens:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        text = tok.apply_chat_template([{"role": "user", "content": PROMPT_SLOT}],
                                       add_generation_prompt=True, tokenize=False)
        head, _, tail = text.partition(PROMPT_SLOT)
        return (tok(head, add_special_tokens=False)["input_ids"]
                + tok(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                + tok(tail, add_special_tokens=False)["input_ids"])
    return tok(prompt, split_special_tokens=split)["input_ids"]


MAX_CHOICES = 64
# Option tokens a choices request may score in all (64 options of 64 tokens): bounds its work.
MAX_CHOICE_TOKENS = 4096
# Tokens one forward of Engine.choose may run (rows x positions): bounds memory and the time
# between two cancel checks.
CHOICE_TOKENS_PER_FORWARD = 512
# Logit elements one output-layer call of Engine.choose may produce (float32: 64 MiB).
CHOICE_LOGITS_BUDGET = 16 * 2**20
# Bytes the prompt's KV cache may take once repeated for the rows of one choices forward.
CHOICE_CACHE_BUDGET = 256 * 2**20
# A choice this many characters per context token is refused before tokenizing it.
MAX_CHOICE_CHARS_PER_TOKEN = 100


@dataclass
class ChoiceResult:
    """What :meth:`Engine.choose` found: the chosen index and every choice's scores."""

    choices: list[str]
    index: int
    logprobs: list[float]  # total log-prob of each choice's tokens given the prompt
    logprobs_normalized: list[float]  # that total / the choice's token count
    token_counts: list[int]
    length_normalize: bool  # which of the two ranked the choices
    prompt_tokens: int
    prefill_seconds: float
    seconds: float  # the whole request: tokenizing, prefill, scoring

    @property
    def choice(self) -> str:
        return self.choices[self.index]


def _cache_bytes(cache) -> int:
    """Bytes of a DynamicCache's keys and values (0 when its layout is unknown)."""
    layers = getattr(cache, "layers", None)
    tensors = ([t for layer in layers for t in (getattr(layer, "keys", None),
                                                 getattr(layer, "values", None))]
               if layers is not None else
               list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", [])))
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def check_choice_sizes(choices: list[str], context_limit: int) -> None:
    """ValueError unless ``choices`` are few and short enough to tokenize: at most MAX_CHOICES,
    each at most ``context_limit`` x MAX_CHOICE_CHARS_PER_TOKEN characters and all together at
    most MAX_CHOICE_TOKENS x MAX_CHOICE_CHARS_PER_TOKEN. Counts characters only (cheap)."""
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"{len(choices)} choices; at most {MAX_CHOICES} are allowed")
    for i, c in enumerate(choices):
        if len(c) > context_limit * MAX_CHOICE_CHARS_PER_TOKEN:
            raise ValueError(f"choice {i} has {len(c)} characters; the context limit is "
                             f"{context_limit} tokens")
    total = sum(len(c) for c in choices)
    if total > MAX_CHOICE_TOKENS * MAX_CHOICE_CHARS_PER_TOKEN:
        raise ValueError(f"the choices have {total} characters in all; at most "
                         f"{MAX_CHOICE_TOKENS} tokens may be scored")


def validate_choices(choices: list[str], engine: "Engine", prompt_tokens: int = 0,
                     token_ids: list[list[int]] | None = None) -> None:
    """None when ``choices`` can be scored after a prompt of ``prompt_tokens`` tokens; otherwise
    ValueError with the reason: none given, more than MAX_CHOICES, an empty or duplicate choice,
    a choice that does not fit the context after the prompt, or more than MAX_CHOICE_TOKENS
    option tokens in all."""
    if not choices:
        raise ValueError("no choices given")
    check_choice_sizes(choices, engine.context_limit)
    room = engine.context_limit - prompt_tokens
    total = 0
    seen: dict[str, int] = {}
    for i, c in enumerate(choices):
        if not c or not c.strip():
            raise ValueError(f"choice {i} is empty")
        if c in seen:
            raise ValueError(f"choice {i} {c!r} repeats choice {seen[c]}")
        seen[c] = i
        if len(c) > engine.context_limit * MAX_CHOICE_CHARS_PER_TOKEN:
            raise ValueError(f"choice {i} has {len(c)} characters; the context limit is "
                             f"{engine.context_limit} tokens")
        # without the ids: one token more for the space choose() may put in front
        n = len(token_ids[i]) if token_ids is not None else len(engine.choice_ids(None, c)) + 1
        if n > room:
            raise ValueError(f"choice {i} has {n} tokens; after the prompt's {prompt_tokens} "
                             f"tokens the context ({engine.context_limit}) leaves {max(room, 0)}")
        total += n
        if total > MAX_CHOICE_TOKENS:
            raise ValueError(f"the choices have more than {MAX_CHOICE_TOKENS} tokens in all "
                             f"({total} in the first {i + 1}); fewer or shorter options")


class Detokenizer:
    """Text of a growing token sequence, one token at a time, decoding only a short window
    (the tokens since the last completed piece of text), so a step costs O(1) in the output
    length. The text equals decoding the whole sequence; an incomplete UTF-8 character waits
    for the tokens that complete it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: context for the pieces that follow
        self._read = 0  # tokens whose text is in self.text

    def add(self, token: int) -> str:
        """Append ``token``; returns the text it completes (may be empty)."""
        self.ids.append(token)
        dec = self.tokenizer.decode
        before = dec(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = dec(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def _stop_hold(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still grow into a stop string."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


class Engine:
    """Streams completions from a causal LM, one request at a time."""

    def __init__(self, model: torch.nn.Module, tokenizer, selective=None,
                 context_limit: int | None = None, lean: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.selective = selective
        self.state: SelectionState | None = selective.state if selective is not None else None
        cfg = model.config
        limit = getattr(cfg, "max_position_embeddings", None) or 4096
        self.context_limit = min(limit, context_limit) if context_limit else limit
        self.device = next(model.parameters()).device
        gen = getattr(model, "generation_config", None)
        eos = set()
        for src in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(src, int):
                eos.add(src)
            elif src:
                eos.update(src)
        self.eos_ids = eos
        self._lock = threading.Lock()
        params = inspect.signature(model.forward).parameters
        # transformers renamed past_key_values to cache (5.x); robots may run either.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        reason = unsupported(model) if lean else "lean decoder turned off"
        # generation runs on the lean decoder where it can, else on the transformers forward
        self.decoder: Decoder | None = Decoder(model) if reason is None else None
        self.decode_path = (f"lean decoder, {self.decoder.path}" if reason is None
                            else f"transformers forward ({reason})")
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._tool_format: ToolFormat | None = None
        # keys and values of earlier prompts (lean decoder only; limit 0: off until set)
        self.prompt_cache = PromptCache()

    @property
    def grammars(self) -> Grammars:
        """The compiler of this model's JSON schemas and grammars (built on first use; call
        ``grammars.prepare()`` to build its vocabulary in the background)."""
        with self._grammars_lock:
            if self._grammars is None:
                vocab = max(int(self.model.config.vocab_size), len(self.tokenizer))
                self._grammars = Grammars(self.tokenizer, vocab, self.eos_ids)
            return self._grammars

    @property
    def tool_format(self) -> ToolFormat:
        """How this model's chat template takes tools (:func:`.chat.tool_format`; found once)."""
        with self._grammars_lock:
            if self._tool_format is None:
                self._tool_format = detect_tool_format(self.tokenizer)
            return self._tool_format

    def prompt_ids(self, prompt: "str | list[int] | Chat", use_chat_template: bool = False,
                   special_tokens: bool = False) -> tuple[list[int], tuple[int, ...]]:
        """A request's token ids and its marks (where a prefix shared with other prompts ends:
        a conversation's system message and tools)."""
        if isinstance(prompt, Chat):
            r = render(self.tokenizer, prompt, self.tool_format, special_tokens)
            return r.ids, r.marks
        if isinstance(prompt, list):
            return prompt, ()
        return self.encode(prompt, use_chat_template, special_tokens), ()

    def set_prompt_cache(self, megabytes: float) -> None:
        """Keep at most ``megabytes`` MiB of earlier prompts' keys and values (0: off)."""
        self.prompt_cache.set_limit(int(megabytes * 2**20) if self.decoder is not None else 0)

    def cache_key(self) -> str:
        """What a prompt's keys and values depend on besides its tokens (the resident neurons)."""
        return self.selective.residency_key() if self.selective is not None else "dense"

    @classmethod
    def from_selective(cls, sm, context_limit: int | None = None) -> "Engine":
        return cls(sm.model, sm.tokenizer, sm, context_limit)

    def encode(self, prompt: str, use_chat_template: bool = False,
               special_tokens: bool = False) -> list[int]:
        return encode(self.tokenizer, prompt, use_chat_template, special_tokens)

    def check_prompt(self, prompt_tokens: int) -> None:
        if prompt_tokens == 0:
            raise ValueError("empty prompt")
        if prompt_tokens >= self.context_limit:
            raise ContextLengthError(f"prompt has {prompt_tokens} tokens; the context limit is "
                                     f"{self.context_limit} (prompt + at least one new token)")

    @torch.inference_mode()
    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None,
                 on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], bool] | None = None) -> GenerationResult:
        """Generate a completion; ``on_text(delta, tokens)`` gets each new piece of text and the
        number of tokens generated so far; ``cancel`` is polled before every token (a canceled
        request returns exactly the text streamed until then)."""
        config = config or GenerationConfig()
        config.validate()
        with self._lock:
            return self._generate(prompt, config, on_text, cancel)

    def request(self, prompt: "str | list[int] | Chat", config: GenerationConfig
                ) -> tuple[list[int], int, RequestMetrics, torch.Generator, tuple[int, ...]]:
        """A request's prompt ids (checked against the context), how many tokens it may add, its
        metrics, its seeded generator and its marks (:meth:`prompt_ids`)."""
        ids, marks = self.prompt_ids(prompt, config.use_chat_template, config.special_tokens)
        self.check_prompt(len(ids))
        max_new = min(config.max_new_tokens, self.context_limit - len(ids))
        gen = torch.Generator(device="cpu")
        gen.manual_seed(config.seed if config.seed is not None and config.seed >= 0
                        else int(time.time_ns() % (2**63)))
        return ids, max_new, RequestMetrics(prompt_tokens=len(ids)), gen, marks

    def _generate(self, prompt, config, on_text, cancel) -> GenerationResult:
        t0 = time.perf_counter()
        ids, max_new, metrics, gen, marks = self.request(prompt, config)
        with self.phi(config.compute_ratio):
            return self._run(ids, config, max_new, metrics, gen, on_text, cancel, t0, marks)

    @contextlib.contextmanager
    def phi(self, compute_ratio: float | None):
        """One request's compute ratio: ``compute_ratio`` (None = the model's) while the block
        runs, the model's own afterwards (also when the block raises)."""
        sm = self.selective
        if sm is None or compute_ratio is None or compute_ratio == sm.compute_ratio:
            yield
            return
        restore = sm.compute_ratio
        sm.set_compute_ratio(compute_ratio)
        try:
            yield
        finally:
            sm.set_compute_ratio(restore)

    def _start(self, input_ids: torch.Tensor) -> None:
        """Mark the next forward as a request's prefill (selection runs there)."""
        if self.state is not None:
            bos = self.tokenizer.bos_token_id
            self.state.start_prefill((input_ids[0] != bos).float() if bos is not None else None)

    def _end_prefill(self, metrics: RequestMetrics | None = None) -> None:
        if self.state is not None:
            self.state.prefill = False
            if metrics is not None:
                metrics.selection_seconds = self.state.select_seconds

    def _cancel_points(self) -> list[torch.nn.Module]:
        """The modules a long forward polls cancel before: per decoder layer its attention's
        query projection and its MLP (both the lean decoder and the transformers forward call
        them as modules)."""
        layers = getattr(getattr(self.model, "model", None), "layers", None) or []
        points = []
        for blk in layers:
            q = getattr(getattr(blk, "self_attn", None), "q_proj", None)
            points += [m for m in (q, getattr(blk, "mlp", None)) if isinstance(m, torch.nn.Module)]
        return points

    @property
    def cancel_points(self) -> int:
        """How often one forward polls cancel (twice per layer)."""
        return len(self._cancel_points())

    @contextlib.contextmanager
    def cancel_between_layers(self, cancel: Callable[[], bool] | None):
        """While the block runs, every layer polls ``cancel`` before its attention and before its
        MLP and raises :class:`Canceled` when it turns true: a long forward (a prefill, a choices
        batch) stops within half a layer."""
        if cancel is None:
            yield
            return

        def check(module, args) -> None:
            if cancel():
                raise Canceled

        hooks = [m.register_forward_pre_hook(check) for m in self._cancel_points()]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def _forward_fns(self, input_ids: torch.Tensor, max_new: int):
        """``(prefill() -> logits [V], decode_one_token(token) -> logits [V])`` of one request."""
        if self.decoder is not None:
            d = self.decoder
            return (lambda: d.prefill(input_ids, extra=max_new)), d.decode_one_token
        kw = {self._cache_kw: DynamicCache(config=self.model.config), "use_cache": True}
        step = torch.empty(1, 1, dtype=torch.long, device=self.device)

        def prefill() -> torch.Tensor:
            return self.model(input_ids, logits_to_keep=1, **kw).logits[0, -1]

        def decode_one_token(token: int) -> torch.Tensor:
            step[0, 0] = token
            return self.model(step, **kw).logits[0, -1]
        return prefill, decode_one_token

    def _run(self, ids, config, max_new, metrics, gen, on_text, cancel, t0,
             marks: tuple[int, ...] = ()) -> GenerationResult:
        stream = Stream(self, ids, config, max_new, metrics, gen, on_text, cancel, t0, marks)
        input_ids = torch.tensor([ids], device=self.device)  # [1, T]
        prefill, decode_one_token = self._forward_fns(input_ids, max_new)
        if self.decoder is not None:  # chunk by chunk: the prompt cache, its marks
            self.decoder.reserve(len(ids) + max_new)
            self.open_prompt(stream, 0, None)

            def prefill() -> torch.Tensor:
                logits = None
                while logits is None:
                    logits = self.prefill_chunk(stream, 0, None, len(ids), max_new)
                return logits
        self._start(input_ids)
        counted = None  # token mode: the neuron counts after the prefill
        try:
            if cancel is not None and cancel():
                raise Canceled
            with self.cancel_between_layers(cancel):
                logits = prefill()
            done = stream.advance(logits)
            self._end_prefill(metrics)
            sm = self.selective
            if sm is not None and sm.state.per_token:
                counted = sm.counts()
            while not done:
                done = stream.advance(decode_one_token(stream.tok))
        except Canceled:
            stream.finish = "canceled"
        finally:
            if self.state is not None:
                self.state.prefill = True
        if counted is not None and self.selective.counts()[0] > counted[0]:
            metrics.computed_share = self.selective.read_shares(counted)["computed_share"]
        return stream.result()

    @torch.inference_mode()
    def first_logits(self, prompt: "str | list[int] | Chat",
                     config: GenerationConfig | None = None) -> tuple[torch.Tensor, int]:
        """The logits ``[V]`` after ``prompt`` as a generation computes them (its selection, the
        prompt cache) and how many of its tokens the prompt cache served (lean decoder)."""
        config = config or GenerationConfig()
        if self.decoder is None:
            raise ValueError(f"first_logits needs the lean decoder ({self.decode_path})")
        with self._lock, self.phi(config.compute_ratio):
            ids, _, metrics, gen, marks = self.request(prompt, config)
            stream = Stream(self, ids, config, 1, metrics, gen, None, None, 0.0, marks)
            self.decoder.reserve(len(ids) + 1)
            self.open_prompt(stream, 0, None)
            try:
                logits = None
                while logits is None:
                    logits = self.prefill_chunk(stream, 0, None, len(ids), 1)
            finally:
                if self.state is not None:
                    self.state.prefill = True
            return logits.float().clone(), stream.cached

    # ---- a prompt's prefill, chunk by chunk, with the prompt cache -------------------------
    def _voting(self) -> list[int]:
        """The neuron stores (:attr:`SelectiveModel.stores`: a layer's, or its tiers') whose decode
        neurons this request's prompt votes for (prompt mode, phi < gamma; under the request's
        compute ratio)."""
        sm = self.selective
        return [] if sm is None else [i for i, m in enumerate(sm.stores) if m.needs_votes]

    def _caching(self) -> bool:
        return self.prompt_cache.enabled and self.decoder is not None

    def open_prompt(self, stream: "Stream", slot: int, row: int | None) -> None:
        """Before a request's first prompt chunk (engine lock held, the request's compute ratio
        in force): its votes start empty, or from the longest prefix the prompt cache serves,
        whose keys and values go into KV slot ``slot`` (``stream.filled`` = ``stream.cached``
        = its length)."""
        voting = self._voting()
        hit = (self.prompt_cache.find(self.cache_key(), stream.ids, voting)
               if self._caching() else None)
        start = None
        if hit is not None:
            entry, n = hit
            self.decoder.import_prefix(slot, entry.kv, n)
            stream.filled = stream.cached = n
            stream.metrics.cached_tokens = n
            stream.votes = {p: v for p, v in entry.votes.items() if p <= n}
            start = entry.votes.get(n) if voting else None
        if self.selective is not None:
            for i, m in enumerate(self.selective.stores):
                m.start_votes(row, start[i] if start is not None and m.needs_votes else None)

    def prefill_chunk(self, stream: "Stream", slot: int, row: int | None, budget: int,
                      extra: int) -> torch.Tensor | None:
        """The next chunk (at most ``budget`` tokens, :func:`.prompt_cache.chunk_end`) of
        ``stream``'s prompt into KV slot ``slot`` (``row``: a batch's row, None alone; room for
        ``extra`` more tokens); the logits after the last prompt token once it is in (None
        before). The prompt's votes are kept at its marks and at its end, and the whole prompt
        goes into the prompt cache (engine lock held, the request's compute ratio in force)."""
        ids, lo = stream.ids, stream.filled
        caching = self._caching() and len(ids) >= MIN_REUSE_TOKENS + MIN_SUFFIX
        voting = self._voting() if caching else []
        hi = chunk_end(lo, len(ids), budget, stream.marks if voting else ())
        last = hi == len(ids)
        st = self.state
        self._start(torch.tensor([ids[lo:hi]]))
        if st is not None:  # its selection places its neurons for its row
            st.row, st.last_chunk, st.keep_votes = row, last, bool(voting)
        try:
            logits = self.decoder.prefill(ids[lo:hi], extra=extra, slot=slot, start=lo,
                                          logits=last)
        finally:
            if st is not None:
                st.row, st.last_chunk, st.keep_votes = None, True, False
        stream.filled = hi
        if voting and not last and hi in stream.marks:
            stream.votes[hi] = tuple(self._votes_now(m, row) for m in self.selective.stores)
        if last and caching:
            votes = dict(stream.votes)
            if voting:
                votes[hi] = tuple(m.kept_votes if m.needs_votes else None
                                  for m in self.selective.stores)
            self.prompt_cache.put(Entry(self.cache_key(), np.asarray(ids, dtype=np.int64),
                                        self.decoder.export_prefix(slot, len(ids)), votes))
        return logits

    @staticmethod
    def _votes_now(mlp, row: int | None):
        v = mlp.prompt_votes(row) if mlp.needs_votes else None
        return None if v is None else (v[0].clone(), v[1].clone())

    def batch_refusal(self, config: GenerationConfig) -> str | None:
        """Why a request with ``config`` cannot decode in a :class:`Batch` with others (None when
        it can). Requests whose prompts choose different neurons (any compute ratio) share a
        pass over the union of their neurons, each row masked to its own; a request whose tokens
        choose their own (per-token mode) decodes alone, and so do models off the lean decoder."""
        if self.decoder is None:
            return f"decoding runs on the {self.decode_path}"
        sm = self.selective
        if sm is not None and sm.state.per_token:
            return "per-token selection (each token computes its own neurons)"
        return None

    @torch.inference_mode()
    def score(self, prefix: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits ``[len(continuation), V]`` predicting each continuation token, computed as
        generation would: selection at the prefix's prefill, then the decode path (active neurons
        only) over the continuation, teacher-forced."""
        with self._lock:
            cache = DynamicCache(config=self.model.config)
            kw = {self._cache_kw: cache, "use_cache": True}
            ids = torch.tensor([prefix], device=self.device)
            self._start(ids)
            try:
                first = self.model(ids, logits_to_keep=1, **kw).logits[0, -1:]
                self._end_prefill()
                if len(continuation) < 2:
                    return first.float()
                rest = torch.tensor([continuation[:-1]], device=self.device)
                return torch.cat([first, self.model(rest, **kw).logits[0]]).float()
            finally:
                if self.state is not None:
                    self.state.prefill = True

    @torch.inference_mode()
    def choose(self, prompt: str | list[int], choices: list[str], *,
               length_normalize: bool = False, compute_ratio: float | None = None,
               use_chat_template: bool = False, special_tokens: bool = False,
               cancel: Callable[[], bool] | None = None) -> ChoiceResult:
        """The choice with the highest log-likelihood after ``prompt``.

        One prefill of the prompt (selection as in :meth:`generate`), then every choice scored
        teacher-forced through the decode path (active neurons only), all choices in one batched
        forward over copies of the prompt's cache (right-padded: causal attention never lets a
        choice token see the padding). Each choice is scored as the text that follows the prompt,
        with a space between them when neither supplies whitespace. Raises :class:`Canceled` when
        ``cancel()`` turns true, ValueError (see :func:`validate_choices`) for invalid choices.
        """
        with self._lock, self.phi(compute_ratio):
            return self._choose(prompt, list(choices), length_normalize, use_chat_template, cancel,
                                special_tokens)

    def choice_ids(self, prompt_text: str | None, choice: str) -> list[int]:
        """Token ids of ``choice`` as it follows ``prompt_text`` (see :meth:`choose`)."""
        if prompt_text is not None and prompt_text[-1:].strip() and choice[:1].strip():
            choice = " " + choice
        return self.tokenizer(choice, add_special_tokens=False)["input_ids"]

    def _choose(self, prompt, choices, length_normalize, use_chat_template, cancel,
                special_tokens=False) -> ChoiceResult:
        t0 = time.perf_counter()
        ids, _ = self.prompt_ids(prompt, use_chat_template, special_tokens)
        self.check_prompt(len(ids))
        text = None if not isinstance(prompt, str) else (
            prompt if not use_chat_template else self.tokenizer.decode(ids))
        conts = [self.choice_ids(text, c) for c in choices]
        validate_choices(choices, self, len(ids), conts)
        if cancel is not None and cancel():
            raise Canceled
        cache = DynamicCache(config=self.model.config)
        kw = {self._cache_kw: cache, "use_cache": True}
        input_ids = torch.tensor([ids], device=self.device)
        self._start(input_ids)
        try:
            with self.cancel_between_layers(cancel):
                first = self.model(input_ids, logits_to_keep=1, **kw).logits[0, -1].float()
            t_prefill = time.perf_counter() - t0
            self._end_prefill()
            first_lp = torch.log_softmax(first, dim=-1).cpu()
            totals = [float(first_lp[c[0]]) for c in conts]
            longest = max(len(c) for c in conts)
            if longest > 1:
                with self.cancel_between_layers(cancel):
                    rest = self._score_rest(cache, conts, cancel)
                totals = [t + r for t, r in zip(totals, rest)]
        finally:
            if self.state is not None:
                self.state.prefill = True
        normalized = [t / len(c) for t, c in zip(totals, conts)]
        key = normalized if length_normalize else totals
        index = max(range(len(choices)), key=key.__getitem__)
        return ChoiceResult(choices, index, totals, normalized, [len(c) for c in conts],
                            length_normalize, len(ids), t_prefill, time.perf_counter() - t0)

    def _score_rest(self, cache, conts: list[list[int]],
                    cancel: Callable[[], bool] | None = None) -> list[float]:
        """Summed log-probs of every choice's tokens after its first, teacher-forced on the decode
        path. Choices that share a prefix share its logits: the output layer (the 262k-token
        matmul of the embedded model) runs once per distinct prefix, not once per position.

        Memory stays bounded whatever the choices: rows (the longest distinct prefixes) run in
        batches of at most CHOICE_TOKENS_PER_FORWARD tokens (and CHOICE_CACHE_BUDGET bytes of
        repeated prompt cache), long rows in segments along their length; only the hidden state
        of each needed prefix is kept ``[prefixes, H]``; the output layer runs in chunks of
        CHOICE_LOGITS_BUDGET logits and only the log-probs of the option tokens are gathered.
        ``cancel`` is polled between forwards and chunks."""
        def check() -> None:
            if cancel is not None and cancel():
                raise Canceled

        prefixes: dict[tuple[int, ...], int] = {}  # prefix -> its row in ``h``
        for c in conts:
            for j in range(1, len(c)):
                prefixes.setdefault(tuple(c[:j]), len(prefixes))
        # rows: the longest prefixes; the shorter ones are their own prefixes
        parents = {q[:-1] for q in prefixes}  # the set is prefix-closed: a proper prefix is a parent
        rows = sorted((p for p in prefixes if p not in parents), key=len, reverse=True)
        where: dict[tuple[int, ...], tuple[int, int]] = {}
        for r, p in enumerate(rows):
            for j in range(1, len(p) + 1):
                where.setdefault(p[:j], (r, j - 1))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        per_rows = max(1, CHOICE_CACHE_BUDGET // max(1, _cache_bytes(cache)))
        h: torch.Tensor | None = None  # [prefixes, H]: the hidden state after each prefix
        needed: dict[int, list[tuple[int, int]]] = {}  # row -> (position, prefix index)
        for p, i in prefixes.items():
            r, j = where[p]
            needed.setdefault(r, []).append((j, i))
        lo = 0
        while lo < len(rows):
            width = len(rows[lo])  # rows are sorted longest first
            n = max(1, min(per_rows, CHOICE_TOKENS_PER_FORWARD // width, len(rows) - lo))
            seg = max(1, CHOICE_TOKENS_PER_FORWARD // n)  # positions per forward
            inp = torch.full((n, width), pad, dtype=torch.long)
            for r in range(n):
                inp[r, :len(rows[lo + r])] = torch.tensor(rows[lo + r])
            batch = cache if lo + n >= len(rows) else copy.deepcopy(cache)
            batch.batch_repeat_interleave(n)
            for start in range(0, width, seg):
                check()
                body = self.model.model(inp[:, start:start + seg].to(self.device),
                                        **{self._cache_kw: batch, "use_cache": True})
                hid = body.last_hidden_state  # [n, seg, H], final norm applied
                if h is None:
                    h = torch.empty(len(prefixes), hid.shape[-1], dtype=hid.dtype, device=hid.device)
                for r in range(n):
                    for j, i in needed.get(lo + r, ()):
                        if start <= j < start + hid.shape[1]:
                            h[i] = hid[r, j - start]
            del batch
            lo += n
        # the option tokens' log-probs: (prefix index, next token) -> summed into each choice
        pairs = [(prefixes[tuple(c[:j])], c[j], k) for k, c in enumerate(conts) for j in range(1, len(c))]
        rows_of = torch.tensor([p[0] for p in pairs])
        tokens = torch.tensor([p[1] for p in pairs])
        owner = torch.tensor([p[2] for p in pairs])
        totals = torch.zeros(len(conts), dtype=torch.float64)
        head = self.model.get_output_embeddings()
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        per = max(1, CHOICE_LOGITS_BUDGET // self.model.config.vocab_size)  # prefixes per chunk
        for lo in range(0, len(prefixes), per):
            check()
            logits = head(h[lo:lo + per]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            lp = torch.log_softmax(logits, dim=-1).cpu()
            mine = (rows_of >= lo) & (rows_of < lo + per)
            got = lp[rows_of[mine] - lo, tokens[mine]].double()
            totals.index_add_(0, owner[mine], got)
        return totals.tolist()

    @staticmethod
    def _sample(logits: torch.Tensor, config: GenerationConfig, history: torch.Tensor,
                gen: torch.Generator) -> int:
        """The next token of a sampled request: repetition penalty, temperature, then top-k (the
        k largest logits) and top-p (the smallest most likely set whose mass passes p: a token
        stays while the mass before it is at most p), drawn with ``gen``. Only the candidates are
        sorted and summed (Gemma 3's 262144 logits: top-p 0.9 took 31 ms a token with a sort
        of the vocabulary and torch.multinomial, a temperature alone 6 ms; now about 1 ms for a
        model's peaked distribution, a flat one still sorts the vocabulary once)."""
        logits = logits.float().cpu()  # [V]
        if config.repetition_penalty != 1.0:
            seen = logits[history]
            logits[history] = torch.where(seen > 0, seen / config.repetition_penalty,
                                          seen * config.repetition_penalty)
        if config.temperature < GREEDY_BELOW:
            return greedy_token(logits)
        logits = logits / config.temperature
        ids = None  # the candidates' token ids, most likely first (None: every token, in order)
        if 0 < config.top_k < logits.numel():
            logits, ids = torch.topk(logits, config.top_k)  # [k], descending
        probs = torch.softmax(logits, dim=-1)
        if config.top_p < 1.0:
            if ids is None:
                probs, ids = _top_mass(probs, config.top_p)
            probs = probs.masked_fill(torch.cumsum(probs, 0) - probs > config.top_p, 0.0)
        j = _draw(probs, gen)
        return int(ids[j]) if ids is not None else j


def _top_mass(probs: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest M probabilities, descending, and their ids, M the first of 64 and 1024 whose
    mass passes ``p``, else all (one sort): they hold every token top-p keeps."""
    for m in (64, 1024):
        if m < probs.numel():
            vals, ids = torch.topk(probs, m)
            if float(vals.sum()) > p:
                return vals, ids
    return torch.sort(probs, descending=True)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """An index drawn with probability proportional to ``probs`` (non-negative, not all zero):
    the first whose running sum passes a uniform draw of the total."""
    c = torch.cumsum(probs.double(), 0)
    u = torch.rand(1, generator=gen, dtype=torch.float64) * c[-1]
    return min(int(torch.searchsorted(c, u, right=True)), probs.numel() - 1)


KEY_TRIES = 8  # tokens tried in one step before a repeated key is let through


class Stream:
    """One request from its prefill's logits on: :meth:`advance` takes the logits after the last
    token, picks the next token (the grammar's mask, then greedy or sampled: the one place logits
    become a token) and runs what follows it (end of sequence, stop strings, the grammar's end,
    the length limit, streamed text, cancel). ``tok`` is then the next step's input, unless the
    request is done (``finish`` set); :meth:`result` is its outcome."""

    def __init__(self, engine: Engine, ids: list[int], config: GenerationConfig, max_new: int,
                 metrics: RequestMetrics, gen: torch.Generator,
                 on_text: Callable[[str, int], None] | None, cancel: Callable[[], bool] | None,
                 t0: float, marks: tuple[int, ...] = ()):
        constrained = config.constraint  # compiled (or from the cache) before the model runs
        self.constraint: Constraint | None = (engine.grammars.constraint(*constrained)
                                              if constrained is not None else None)
        # a constrained answer ends complete within max_new tokens where its grammar allows
        self.budget = (Budget(self.constraint) if self.constraint is not None
                       and not config.ignore_eos else None)
        self.loops_broken = 0  # steps where a repeating span was not allowed to repeat again
        # a JSON-schema answer: a key is not written twice into one object
        self.keys = JsonKeys() if config.json_schema and self.constraint is not None else None
        self._lltok = engine.grammars.lltokenizer() if self.keys is not None else None
        self.keys_refused = 0  # tokens refused because they would repeat a key
        self.config, self.max_new, self.metrics, self.gen = config, max_new, metrics, gen
        self.on_text, self.cancel, self.t0 = on_text, cancel, t0
        self.eos_ids = engine.eos_ids
        self.greedy = config.temperature < GREEDY_BELOW and config.repetition_penalty == 1.0
        self.history = None
        if not self.greedy:
            self.history = torch.zeros(engine.model.config.vocab_size, dtype=torch.bool)
            self.history[torch.tensor(ids)] = True
        self.detok = Detokenizer(engine.tokenizer)
        self.stops = [s for s in config.stop if s]
        self.emitted = 0
        self.text = ""
        self.tok = -1
        self.finish: str | None = None
        self.slot = -1  # a batch's KV slot
        self.ids, self.filled = ids, 0  # the prompt, and how much of it is prefilled
        self.marks = marks  # where prefixes shared with other prompts end (the prompt cache)
        self.cached = 0  # prompt tokens whose keys and values came from the prompt cache
        self.votes: dict = {}  # position -> the prompt's votes there (the prompt cache)
        self._tokenizer = engine.tokenizer

    def _next_token(self, logits: torch.Tensor) -> int:
        c = self.constraint
        if c is not None:
            c.mask_logits(logits)
            self._break_loop(logits)
        tok = self._pick(logits)
        if self.keys is not None and tok not in self.eos_ids:
            tok = self._new_key(tok, logits)
        if self.budget is not None and tok not in self.eos_ids:
            n = len(self.detok.ids)
            tok = self.budget.choose(tok, self.max_new - n, n)
        if c is not None and tok not in self.eos_ids:
            c.advance(tok)
            if self.keys is not None:
                self.keys.feed(self._piece(tok))
        return tok

    def _pick(self, logits: torch.Tensor) -> int:
        return (greedy_token(logits) if self.greedy
                else Engine._sample(logits, self.config, self.history, self.gen))

    def _piece(self, tok: int) -> str:
        """The token's text, exactly (llguidance's bytes of it)."""
        return self._lltok.decode_bytes([tok]).decode("utf-8", "replace")

    def _new_key(self, tok: int, logits: torch.Tensor) -> int:
        """``tok``, or where it would write a key its object already has, the next choice among
        the tokens that would not (at most KEY_TRIES tries; then ``tok`` stands)."""
        first = tok
        for _ in range(KEY_TRIES):
            if self.keys.allows(self._piece(tok)):
                return tok
            logits[tok] = float("-inf")
            if math.isinf(float(logits.max())):
                return first
            self.keys_refused += 1
            tok = self._pick(logits)
        return tok if self.keys.allows(self._piece(tok)) else first

    def _break_loop(self, logits: torch.Tensor) -> None:
        """A constrained answer whose end repeats one span (:func:`.constrain.repeating_token`):
        the token that would repeat it again is forbidden this step, unless it is the only one
        the grammar allows."""
        t = repeating_token(self.detok.ids)
        if t is None or t >= logits.shape[-1] or not math.isfinite(float(logits[t])):
            return
        keep = float(logits[t])
        logits[t] = float("-inf")
        if math.isinf(float(logits.max())):
            logits[t] = keep
            return
        self.loops_broken += 1

    def advance(self, logits: torch.Tensor) -> bool:
        """The token after ``logits`` ``[V]``; True when the request is done."""
        tok = self.tok = self._next_token(logits)
        m, config, c = self.metrics, self.config, self.constraint
        if not self.detok.ids and not m.time_to_first_token:
            m.prefill_seconds = m.time_to_first_token = time.perf_counter() - self.t0
        if tok in self.eos_ids and not config.ignore_eos:
            # constrained: the mask allows EOS only where the answer is complete
            self.finish = "grammar" if c is not None and c.accepting else "stop"
            return True
        delta = self.detok.add(tok)
        if self.history is not None:
            self.history[tok] = True
        text = self.text = self.detok.text
        stops = self.stops
        if stops and delta:
            start = max(0, len(text) - len(delta) - max(map(len, stops)))
            stop_at = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
            if stop_at >= 0:
                self.text = text[:stop_at]
                self.finish = "stop"
                return True
        if c is not None and c.stopped:
            self.finish = "grammar"  # the grammar ends here: no further token is allowed
            return True
        n = len(self.detok.ids)
        if n >= self.max_new:
            self.finish = "context_length" if self.max_new < config.max_new_tokens else "length"
            return True
        safe = len(text) - (_stop_hold(text, stops) if stops else 0)
        if self.on_text is not None and safe > self.emitted:
            self.on_text(text[self.emitted:safe], n)
            self.emitted = safe
        if self.cancel is not None and self.cancel():
            self.finish = "canceled"
            return True
        return False

    def result(self) -> GenerationResult:
        m, new_ids, text = self.metrics, self.detok.ids, self.text
        finish = self.finish or "canceled"
        m.generated_tokens = len(new_ids)
        if new_ids:
            m.decode_seconds = time.perf_counter() - self.t0 - m.time_to_first_token
        if finish == "canceled":
            text = text[:self.emitted]  # what the client has seen; held-back text stays unsaid
        if self.on_text is not None and len(text) > self.emitted and finish != "canceled":
            self.on_text(text[self.emitted:], len(new_ids))
        c, budget = self.constraint, self.budget
        calls, parsed = [], finish == "grammar"
        closed = parsed and budget is not None and budget.closed_early
        if closed:
            finish = "closed"  # complete, but ended early to fit max_new_tokens
        if self.config.tool_calls and parsed:  # complete: calls, or a text answer (auto, none)
            calls = parse_tool_calls(self._tokenizer.decode(new_ids, skip_special_tokens=False))
            finish = "tool_calls" if calls else ("closed" if closed else "stop")
        return GenerationResult(text, finish, list(new_ids), m, parsed=parsed,
                                mask_seconds=c.mask_seconds if c else 0.0, tool_calls=calls,
                                closed_early=closed, loops_broken=self.loops_broken,
                                keys_refused=self.keys_refused,
                                budget_seconds=budget.seconds if budget else [],
                                warnings=list(c.warnings) if c else [])

