"""Generation engine: prefill, selection, decode loop, sampling, streaming, stop strings.

Works on any transformers causal LM; with a :class:`SelectiveModel` it also drives the
per-request neuron selection (prefill computes every loaded neuron and chooses the dynamic
ones; decode computes only the active prefix).
"""
from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from .metrics import RequestMetrics
from .selective_mlp import SelectionState


class ContextLengthError(ValueError):
    """The prompt does not fit the context window."""


class Canceled(Exception):
    pass


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    use_chat_template: bool = False
    compute_ratio: float | None = None  # None = the model's setting
    ignore_eos: bool = False  # benchmarks: always produce max_new_tokens

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class GenerationResult:
    text: str
    finish_reason: str  # stop, length, canceled
    token_ids: list[int]
    metrics: RequestMetrics


def encode(tok, prompt: str, use_chat_template: bool = False) -> list[int]:
    """Token ids of ``prompt`` (as a user turn of the chat template, if asked)."""
    if use_chat_template:
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tok(prompt)["input_ids"]


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
                 context_limit: int | None = None):
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

    @classmethod
    def from_selective(cls, sm, context_limit: int | None = None) -> "Engine":
        return cls(sm.model, sm.tokenizer, sm, context_limit)

    def encode(self, prompt: str, use_chat_template: bool = False) -> list[int]:
        return encode(self.tokenizer, prompt, use_chat_template)

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

    def _generate(self, prompt, config, on_text, cancel) -> GenerationResult:
        t0 = time.perf_counter()
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, config.use_chat_template)
        self.check_prompt(len(ids))
        max_new = min(config.max_new_tokens, self.context_limit - len(ids))
        metrics = RequestMetrics(prompt_tokens=len(ids))
        gen = torch.Generator(device="cpu")
        gen.manual_seed(config.seed if config.seed is not None and config.seed >= 0
                        else int(time.time_ns() % (2**63)))
        sm = self.selective
        if sm is not None and config.compute_ratio is not None and config.compute_ratio != sm.compute_ratio:
            restore = sm.compute_ratio
            sm.set_compute_ratio(config.compute_ratio)
        else:
            restore = None
        try:
            return self._run(ids, config, max_new, metrics, gen, on_text, cancel, t0)
        finally:
            if restore is not None:
                sm.set_compute_ratio(restore)

    def _run(self, ids, config, max_new, metrics, gen, on_text, cancel, t0) -> GenerationResult:
        input_ids = torch.tensor([ids], device=self.device)  # [1, T]
        cache = DynamicCache(config=self.model.config)
        if self.state is not None:
            bos = self.tokenizer.bos_token_id
            self.state.token_weight = (input_ids[0] != bos).float() if bos is not None else None
            self.state.prefill = True
        history = torch.zeros(self.model.config.vocab_size, dtype=torch.bool)
        history[torch.tensor(ids)] = True
        new_ids: list[int] = []
        emitted = 0
        text = ""
        finish = "length"
        try:
            if cancel is not None and cancel():
                raise Canceled
            kw = {self._cache_kw: cache, "use_cache": True}
            logits = self.model(input_ids, logits_to_keep=1, **kw).logits[0, -1]
            tok = self._sample(logits, config, history, gen)
            t_first = time.perf_counter()
            metrics.prefill_seconds = metrics.time_to_first_token = t_first - t0
            if self.state is not None:
                self.state.prefill = False
            step = torch.empty(1, 1, dtype=torch.long, device=self.device)
            while True:
                new_ids.append(tok)
                history[tok] = True
                if tok in self.eos_ids and not config.ignore_eos:
                    new_ids.pop()
                    finish = "stop"
                    break
                text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
                stop_at = min((i for i in (text.find(s) for s in config.stop if s) if i >= 0),
                              default=-1)
                if stop_at >= 0:
                    text = text[:stop_at]
                    finish = "stop"
                    break
                if len(new_ids) >= max_new:
                    break
                safe = len(text) - _stop_hold(text, config.stop)
                if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more
                    safe = min(safe, len(text) - 1)
                if on_text is not None and safe > emitted:
                    on_text(text[emitted:safe], len(new_ids))
                    emitted = safe
                if cancel is not None and cancel():
                    raise Canceled
                step[0, 0] = tok
                logits = self.model(step, **kw).logits[0, -1]
                tok = self._sample(logits, config, history, gen)
        except Canceled:
            finish = "canceled"
        finally:
            if self.state is not None:
                self.state.prefill = True
        metrics.generated_tokens = len(new_ids)
        if new_ids:
            metrics.decode_seconds = time.perf_counter() - t0 - metrics.time_to_first_token
        if finish == "canceled":
            text = text[:emitted]  # what the client has seen; held-back text stays unsaid
        if on_text is not None and len(text) > emitted and finish != "canceled":
            on_text(text[emitted:], len(new_ids))
        return GenerationResult(text, finish, new_ids, metrics)

    @torch.inference_mode()
    def score(self, prefix: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits ``[len(continuation), V]`` predicting each continuation token, computed as
        generation would: selection at the prefix's prefill, then the decode path (active neurons
        only) over the continuation, teacher-forced."""
        with self._lock:
            cache = DynamicCache(config=self.model.config)
            kw = {self._cache_kw: cache, "use_cache": True}
            ids = torch.tensor([prefix], device=self.device)
            if self.state is not None:
                bos = self.tokenizer.bos_token_id
                self.state.token_weight = (ids[0] != bos).float() if bos is not None else None
                self.state.prefill = True
            try:
                first = self.model(ids, logits_to_keep=1, **kw).logits[0, -1:]
                if self.state is not None:
                    self.state.prefill = False
                if len(continuation) < 2:
                    return first.float()
                rest = torch.tensor([continuation[:-1]], device=self.device)
                return torch.cat([first, self.model(rest, **kw).logits[0]]).float()
            finally:
                if self.state is not None:
                    self.state.prefill = True

    @staticmethod
    def _sample(logits: torch.Tensor, config: GenerationConfig, history: torch.Tensor,
                gen: torch.Generator) -> int:
        logits = logits.float().cpu()  # [V]
        if config.repetition_penalty != 1.0:
            seen = logits[history]
            logits[history] = torch.where(seen > 0, seen / config.repetition_penalty,
                                          seen * config.repetition_penalty)
        if config.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / config.temperature
        if config.top_k > 0:
            kth = torch.topk(logits, min(config.top_k, logits.numel())).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if config.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cut = torch.cumsum(sp, 0) - sp > config.top_p
            sp[cut] = 0
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        return int(torch.multinomial(probs, 1, generator=gen))
