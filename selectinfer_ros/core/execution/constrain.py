"""Constrained decoding: a goal's JSON schema or grammar turned into an allowed-token mask per
step (llguidance; see docs/results/constrained-decoding.md for why that library).

ROS-free. :class:`Grammars` belongs to one tokenizer: it builds llguidance's view of the
vocabulary once (seconds for a 262k vocabulary; :meth:`Grammars.prepare` runs it in the
background when a model is loaded), compiles a goal's constraint within COMPILE_SECONDS (in a
worker thread; llguidance releases the GIL while it compiles) and caches compiled constraints by
content (the last CACHE_SIZE). :class:`Constraint` is one request's state: :meth:`mask_logits`
sets every token the grammar forbids to ``-inf`` (in place, with buffers reused from step to
step), :meth:`advance` feeds it the chosen token.

Grammar syntax: Lark, as llguidance takes it (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md):
rules ``name: ...``, terminals ``NAME: ...``, regular expressions ``/.../``, the start rule
``start``; ``%json {...}`` embeds a JSON schema. JSON schemas: draft 2020-12 as llguidance
supports it (objects, arrays with minItems/maxItems, enums, const, integer and number ranges,
string patterns and lengths, anyOf/oneOf, $ref); answers are compact (no whitespace between
tokens).
"""
from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import torch

COMPILE_SECONDS = 0.5  # a schema or grammar that takes longer to compile is refused
CACHE_SIZE = 32  # compiled constraints kept (by content)
MAX_SOURCE_CHARS = 64 * 1024  # a longer schema or grammar is refused before compiling
TOKENIZER_WAIT_SECONDS = 60.0  # a check waits this long for the vocabulary being prepared
KINDS = ("json_schema", "grammar")
LOOP_MIN_SPAN = 12  # tokens: a loop is a span repeated >= 3 times over at least this many tokens
LOOP_MAX_PERIOD = 48  # the longest repeated span looked for (tokens)
# JSON answers without whitespace between tokens: fewer tokens, and a model cannot ramble in
# whitespace; llguidance's parser limits keep one mask step bounded
JSON_OPTIONS = {"whitespace_flexible": False}
# Lenient JSON schemas (llguidance's own options): keywords it does not implement (uniqueItems,
# if/then/else, propertyNames, not, dependencies, ...) and unknown string formats are ignored,
# oneOf is read as anyOf; what was ignored comes back as warnings. Such an answer may break an
# ignored keyword: the schema's author opted in (node parameter schema_lenient, or
# "x-guidance": {"lenient": true} in the schema itself).
LENIENT_OPTIONS = {"lenient": True, "coerce_one_of": True}


# llguidance's vocabularies by tokenizer (folder, size, vocabulary, EOS): a model loaded again in
# the same process (a node's cleanup and configure) does not build its vocabulary again
VOCABS_KEPT = 4
_VOCABS: collections.OrderedDict = collections.OrderedDict()
_VOCABS_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A schema or grammar refused (invalid, or too costly to compile), with the reason."""


def grammars_available() -> bool:
    """True when llguidance (the constrained-decoding library) is installed."""
    import importlib.util
    return importlib.util.find_spec("llguidance") is not None


def _limits():
    import llguidance
    return llguidance.LLParserLimits(verbose_errors=False)


@dataclass
class Compiled:
    """A compiled constraint: a pristine matcher copied per request."""

    kind: str
    matcher: object  # llguidance.LLMatcher in its start state
    seconds: float  # compile time (including the first mask)
    warnings: tuple[str, ...] = ()  # what a lenient schema's compile ignored


def grammar_text(kind: str, source: str, lenient: bool = False) -> str:
    """llguidance's grammar for a ``json_schema`` (``lenient``: :data:`LENIENT_OPTIONS`) or a
    Lark ``grammar``; GrammarError when the schema is not a JSON object."""
    import llguidance
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={**JSON_OPTIONS, **(LENIENT_OPTIONS if lenient else {})})
        except ValueError as e:
            raise GrammarError(f"invalid json_schema: {e}") from None
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(source)
    raise GrammarError(f"unknown constraint kind {kind!r}")


class Grammars:
    """Compiles and caches constraints for one tokenizer (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, *,
                 compile_seconds: float = COMPILE_SECONDS, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted(int(i) for i in eos_ids)
        self.compile_seconds = compile_seconds
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], Compiled | GrammarError] = \
            collections.OrderedDict()
        self._lltok = None
        self._lltok_error: BaseException | None = None
        self._ready = threading.Event()
        self._started = False
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="selectinfer-grammar")
        self.compile_times: collections.deque[float] = collections.deque(maxlen=1000)
        self._closer: Closer | None = None

    # ---- the vocabulary --------------------------------------------------------------------
    def prepare(self) -> None:
        """Start building llguidance's vocabulary in the background (once)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._build, name="selectinfer-grammar-vocab", daemon=True).start()

    def _build(self) -> None:
        try:
            key = (str(getattr(self.tokenizer, "name_or_path", "")), len(self.tokenizer),
                   self.vocab_size, tuple(self.eos_ids))
            with _VOCABS_LOCK:
                self._lltok = _VOCABS.get(key) if key[0] else None
            if self._lltok is None:
                import llguidance
                backend = self.tokenizer.backend_tokenizer
                self._lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_ids or None)
                with _VOCABS_LOCK:
                    _VOCABS[key] = self._lltok
                    while len(_VOCABS) > VOCABS_KEPT:
                        _VOCABS.popitem(last=False)
        except ImportError:
            self._lltok_error = ImportError("llguidance is not installed (pip install llguidance)")
        except BaseException as e:  # noqa: BLE001 - reported by every check
            self._lltok_error = e
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float) -> bool:
        """True once the vocabulary is prepared (or failed: the compile then says why)."""
        self.prepare()
        return self._ready.wait(timeout)

    def lltokenizer(self, wait: float = TOKENIZER_WAIT_SECONDS):
        self.prepare()
        if not self._ready.wait(wait):
            raise GrammarError("constrained decoding is still preparing this model's vocabulary; "
                               "try again in a few seconds")
        if self._lltok_error is not None:
            raise GrammarError(f"constrained decoding is unavailable: "
                               f"{type(self._lltok_error).__name__}: {self._lltok_error}")
        return self._lltok

    # ---- compiling -------------------------------------------------------------------------
    def compile(self, kind: str, source: str, lenient: bool = False) -> Compiled:
        """The compiled ``kind`` constraint (cached by content), or GrammarError with the reason:
        not valid (llguidance's reason names the keyword or construct: ``Unimplemented keys:
        ["uniqueItems"]``, ``oneOf constraints are not supported``, ``Unknown format: regex``, an
        unresolvable remote ``$ref``, a regex look-around, ...), or not compiled within
        ``compile_seconds`` (that verdict is cached too, so a repeated costly goal is refused at
        once). ``lenient`` JSON schemas: see :data:`LENIENT_OPTIONS`."""
        if kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {kind!r}")
        if not source.strip():
            raise GrammarError(f"empty {kind}")
        if len(source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"{kind} has {len(source)} characters; at most {MAX_SOURCE_CHARS}")
        lenient = bool(lenient) and kind == "json_schema"
        key = (kind, hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest(), lenient)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(kind, source, lenient)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def _compile(self, kind: str, source: str, lenient: bool) -> Compiled | GrammarError:
        lltok = self.lltokenizer()
        try:
            text = grammar_text(kind, source, lenient)
        except GrammarError as e:
            return e
        t0 = time.perf_counter()
        future = self._pool.submit(_build_matcher, lltok, text, self.vocab_size)
        try:
            matcher, error = future.result(timeout=self.compile_seconds)
        except FutureTimeout:
            return GrammarError(f"{kind} too costly: not compiled within "
                                f"{self.compile_seconds:g} s")
        seconds = time.perf_counter() - t0
        if error:
            hint = ""
            if kind == "json_schema" and not lenient and any(
                    k in error for k in ("Unimplemented keys", "oneOf", "Unknown format")):
                hint = (" (lenient mode ignores it: node parameter schema_lenient, or "
                        "\"x-guidance\": {\"lenient\": true} in the schema)")
            return GrammarError(f"invalid {kind}: {_first_line(error)}{hint}")
        self.compile_times.append(seconds)
        warnings = tuple(_first_line(w) for w in matcher.get_grammar_warnings())
        return Compiled(kind, matcher, seconds, warnings)

    def constraint(self, kind: str, source: str, lenient: bool = False) -> "Constraint":
        """A fresh request state for the ``kind`` constraint ``source``."""
        compiled = self.compile(kind, source, lenient)
        return Constraint(compiled.matcher.deep_copy(), self.vocab_size, self.closer(),
                          compiled.warnings)

    def closer(self) -> "Closer":
        """The shortest-completion search of this tokenizer (built once)."""
        with self._lock:
            if self._closer is None:
                self._closer = Closer(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._closer


def _first_line(text: str, limit: int = 300) -> str:
    """The error's text on one line, at most ``limit`` characters (llguidance's may be long)."""
    line = " ".join(s.strip() for s in str(text).splitlines() if s.strip())
    return line if len(line) <= limit else line[:limit] + "..."


def _build_matcher(lltok, text: str, vocab_size: int):
    """(matcher, error): llguidance compiles lazily, so the first mask is computed here too."""
    import llguidance
    m = llguidance.LLMatcher(lltok, text, log_level=0, limits=_limits())
    if m.is_error():
        return None, m.get_error()
    bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if m.is_error():
        return None, m.get_error()
    if not bool(bits.any()):
        return None, "the grammar allows no token at the start"
    return m, ""


class Constraint:
    """One request's grammar state and its mask buffers (allocated once per request)."""

    def __init__(self, matcher, vocab_size: int, closer: "Closer | None" = None,
                 warnings: tuple[str, ...] = ()):
        self.matcher = matcher
        self.warnings = warnings  # what a lenient compile ignored
        self.vocab_size = vocab_size
        self.closer = closer
        self.close_seconds = 0.0  # time spent searching closing paths (the budget's tracking)
        words = (vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)  # llguidance's mask: bit set = allowed
        self._forbidden_bits = np.zeros(words, dtype=np.int32)
        self._device_forbidden: torch.Tensor | None = None
        self.mask_seconds = 0.0  # time spent on the grammar: masks computed and applied, tokens fed
        self.steps = 0

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] with every token the grammar forbids at this step set to -inf (in
        place); GrammarError when the grammar is in an error state."""
        t0 = time.perf_counter()
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            raise GrammarError(f"constrained decoding failed: {_first_line(m.get_error())}")
        np.invert(self._bits, out=self._forbidden_bits)
        # one byte per token (little-endian bit order: bit j of word w is token 32 w + j)
        forbidden = torch.from_numpy(np.unpackbits(self._forbidden_bits.view(np.uint8),
                                                   bitorder="little").view(np.bool_))
        n = logits.shape[-1]
        if n > forbidden.numel():  # more logits than the vocabulary: the extra rows never allowed
            logits[forbidden.numel():] = float("-inf")
            logits = logits[:forbidden.numel()]
        else:
            forbidden = forbidden[:n]
        if logits.device.type != "cpu":
            if self._device_forbidden is None:
                self._device_forbidden = torch.empty_like(forbidden, device=logits.device)
            self._device_forbidden.copy_(forbidden)
            forbidden = self._device_forbidden
        logits.masked_fill_(forbidden, float("-inf"))
        self.mask_seconds += time.perf_counter() - t0
        self.steps += 1
        return logits

    def advance(self, token: int) -> None:
        """Feed the chosen token; GrammarError if the grammar refuses it."""
        t0 = time.perf_counter()
        ok = self.matcher.consume_token(int(token))
        self.mask_seconds += time.perf_counter() - t0
        if not ok:
            raise GrammarError(f"constrained decoding failed: "
                               f"{_first_line(self.matcher.get_error())}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows no further token (end of generation)."""
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The text so far is a complete answer under the grammar."""
        return bool(self.matcher.is_accepting())

    def closing_path(self, limit: int, after: int | None = None) -> list[int] | None:
        """The tokens of a short complete ending from here (after feeding ``after``, when
        given), at most ``limit`` of them (an EOS that ends it counts), or None (none found within
        ``limit``, or ``after`` refused). The matcher itself is not changed."""
        if self.closer is None:
            return None
        t0 = time.perf_counter()
        m = self.matcher.deep_copy()
        path = None if after is not None and not m.consume_token(int(after)) else \
            self.closer.path(m, limit)
        self.close_seconds += time.perf_counter() - t0
        return path


# Tokens a closing path tries first, in order. Inside a string (a letter that starts no JSON
# literal is allowed): those that end it, with the enclosing object or array where one token does
# both; elsewhere: those that end arrays and objects, a comma (a container that cannot end yet),
# then the shortest values (an empty string, 0, an empty array or object, null, a boolean). Keys,
# separators and anything else the grammar forces come from llguidance's fast-forward tokens.
IN_STRING_PROBES = ("x", "q", "z", "k")
STRING_CLOSERS = ('"}', '"]', '"}}', '"}]', '"]}', '"')
CLOSERS = ('}}', '}]', ']}', ']]', '}', ']', ',', '""', '0', '[]', '{}', 'null', 'true', 'false', '"',
           '1', '[', '{')
# Where none of those is allowed (a string with a pattern or a minimum length, an enum, a
# number with a minimum): one-character pieces, then the lowest allowed token.
FALLBACK_PIECES = tuple("a0A1-_x.:/ ") + tuple("bcdefghijklmnopqrstuvwyz23456789")


class Closer:
    """Short complete endings of a constrained answer, for one tokenizer: from a matcher's state,
    repeatedly take the fast-forward (forced) tokens, else EOS where the answer is complete, else
    the first allowed of :data:`STRING_CLOSERS` (inside a string) or :data:`CLOSERS`, else of
    :data:`FALLBACK_PIECES` (not one taken twice just before), else the lowest allowed token. Greedy, so not always the shortest, but each step is one mask (tens of
    microseconds); it bounds how many tokens an answer needs to end."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted(int(i) for i in eos_ids)

        def single(pieces) -> list[int]:
            out = []
            for p in pieces:
                ids = tokenizer(p, add_special_tokens=False)["input_ids"]
                if len(ids) == 1 and ids[0] < self.vocab_size and ids[0] not in out:
                    out.append(int(ids[0]))
            return out
        self.probes = single(IN_STRING_PROBES)
        self.string_closers = single(STRING_CLOSERS)
        self.closers = single(CLOSERS)
        self.fallback = single(FALLBACK_PIECES)
        self._bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def _allowed(self, t: int) -> bool:
        return bool((int(self._bits[t >> 5]) >> (t & 31)) & 1)

    def path(self, m, limit: int) -> list[int] | None:
        """The closing tokens from matcher ``m``'s state (``m`` is consumed), or None."""
        out: list[int] = []
        while len(out) <= limit:
            if m.is_error():
                return None
            if m.is_stopped():
                return out
            ff = m.compute_ff_tokens()
            if ff:
                if not m.consume_tokens(ff):
                    return None
                out += ff
                continue
            m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if m.is_error():
                return None
            eos = next((e for e in self.eos_ids if e < self.vocab_size and self._allowed(e)), None)
            if eos is not None and m.is_accepting():
                return out + [eos] if len(out) < limit else None
            in_string = any(self._allowed(t) for t in self.probes)
            prefer = self.string_closers if in_string else self.closers
            # a token taken twice in a row is not taken a third time while another is allowed
            # (a number range's regex may allow "-0.0" only followed by more digits)
            again = out[-1] if len(out) >= 2 and out[-1] == out[-2] else -1
            tok = next((t for t in prefer if t != again and self._allowed(t)), None)
            if tok is None:
                tok = next((t for t in self.fallback if t != again and self._allowed(t)), None)
            if tok is None:
                nz = np.flatnonzero(self._bits)
                if not nz.size:
                    return None
                w = int(nz[0])
                word = int(self._bits[w]) & 0xFFFFFFFF
                tok = 32 * w + ((word & -word).bit_length() - 1)
                if tok in self.eos_ids:
                    return None
            if not m.consume_token(tok):
                return None
            out.append(tok)
        return None


def repeating_token(ids: list[int], min_span: int = LOOP_MIN_SPAN, min_repeats: int = 3,
                    max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The token that would continue a loop at the end of ``ids``: for the shortest period p
    (1 to ``max_period``) such that the last p * r tokens are one span of p tokens repeated r >=
    ``min_repeats`` times and p * r >= ``min_span``, the token that repeats next (``ids[-p]``);
    None when the end does not loop."""
    n = len(ids)
    for p in range(1, min(max_period, n // min_repeats) + 1):
        reps = max(min_repeats, -(-min_span // p))
        span = p * reps
        if span > n:
            continue
        tail = ids[n - span:]
        if all(tail[i] == tail[i - p] for i in range(p, span)):
            return ids[-p]
    return None


class Budget:
    """Keeps a constrained answer able to end within its token budget: while the tokens left are
    more than a closing path needs (plus :data:`SLACK`), the model's token stands and the path is
    measured again every :data:`EVERY` tokens; nearer the end, each token of the model's is kept
    only if a closing path still fits after it, else the path's next token is taken instead (the
    answer is *closed early*: strings, arrays and objects ended, required fields given their
    shortest values). Where no closing path fits from the start (the grammar's shortest answer
    is longer than the budget), the answer is cut off as before."""

    SLACK = 24  # tokens of margin before every token is checked
    EVERY = 16  # tokens between measurements while far from the end
    LONGEST = 192  # a closing path is searched this far at most (each step is one mask)

    def __init__(self, constraint: Constraint):
        self.c = constraint
        self.plan: list[int] | None = None  # a closing path from the current state
        self.need: int | None = None  # its length when last measured
        self.checked = -self.EVERY  # token count at the last measurement
        self.forced = 0  # tokens taken from a closing path instead of the model's
        self.seconds: list[float] = []  # per token: the time this tracking took

    @property
    def closed_early(self) -> bool:
        return self.forced > 0

    def choose(self, tok: int, remaining: int, n: int) -> int:
        """The token to emit instead of the model's ``tok`` (usually ``tok`` itself), with
        ``remaining`` tokens left in the budget (this one included) after ``n`` generated."""
        t0 = time.perf_counter()
        try:
            return self._choose(tok, remaining, n)
        finally:
            self.seconds.append(time.perf_counter() - t0)

    def _choose(self, tok: int, remaining: int, n: int) -> int:
        c = self.c
        if self.plan is None:
            due = n - self.checked >= self.EVERY
            if not due and (self.need is None or remaining > self.need + self.SLACK):
                return tok
            self.checked = n
            self.plan = c.closing_path(min(remaining, self.LONGEST))
            self.need = None if self.plan is None else len(self.plan)
            if self.plan is None:
                return tok  # no ending fits (or none found): nothing to keep
        plan = self.plan
        if remaining > len(plan) + self.SLACK:  # far from the end: measured again later
            self.plan = None
            return tok
        if plan and tok == plan[0]:
            self.plan = plan[1:]
            self.need = len(self.plan)
            return tok
        after = c.closing_path(min(remaining - 1, self.LONGEST), after=tok)
        if after is not None:
            self.plan, self.need = after, len(after)
            return tok
        if not plan:
            return tok  # complete already (an EOS-less end): the mask decides
        self.forced += 1
        self.plan = plan[1:]
        self.need = len(self.plan)
        return plan[0]


class JsonKeys:
    """The keys written so far in each open object of a compact JSON answer, read as its text
    grows, so that a token which would write a key a second time into one object can be refused
    (llguidance's JSON grammar allows repeated keys; ``json.loads`` keeps the last value, a strict
    reader refuses the document). Only tokens with a ``"`` can complete a key."""

    def __init__(self) -> None:
        self.stack: list[list] = []  # per open container: [is_object, keys (set), expect_key]
        self.in_string = False
        self.is_key = False
        self.escape = False
        self.key: list[str] = []

    def _step(self, c: str, added: dict | None) -> bool:
        """Read one character; False when it completes a key its object already has (then
        ``added``, the keys of a trial, is not changed)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.is_key and self.stack:
                    key, frame = "".join(self.key), self.stack[-1]
                    extra = added.setdefault(id(frame), set()) if added is not None else frame[1]
                    if key in frame[1] or (added is not None and key in extra):
                        return False
                    extra.add(key)
                    frame[2] = False
                return True
            if self.is_key:
                self.key.append(c)
            return True
        if c == '"':
            self.in_string, self.escape, self.key = True, False, []
            self.is_key = bool(self.stack) and self.stack[-1][0] and self.stack[-1][2]
        elif c == "{":
            self.stack.append([True, set(), True])
        elif c == "[":
            self.stack.append([False, None, False])
        elif c in "}]":
            if self.stack:
                self.stack.pop()
        elif c == "," and self.stack and self.stack[-1][0]:
            self.stack[-1][2] = True
        return True

    def allows(self, text: str) -> bool:
        """Whether appending ``text`` writes no key twice into one object (nothing is changed)."""
        if '"' not in text:
            return True
        scalars = (self.in_string, self.is_key, self.escape, list(self.key))
        frames, flags = list(self.stack), [f[2] for f in self.stack]
        try:
            added: dict = {}  # keys the trial writes, by object
            return all(self._step(c, added) for c in text)
        finally:
            self.in_string, self.is_key, self.escape, self.key = scalars
            self.stack = frames
            for f, flag in zip(frames, flags):
                f[2] = flag

    def feed(self, text: str) -> None:
        for c in text:
            self._step(c, None)
