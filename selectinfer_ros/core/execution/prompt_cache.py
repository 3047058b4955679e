"""The prompt cache: keys and values of earlier prompts, reused for a new prompt that starts
with the same tokens (an agent's system prompt and tools, the turns of a conversation so far).

ROS-free. An :class:`Entry` holds one prompt's token ids, the keys and values of all its
positions (a copy of its KV slot after the prefill) and, where the model chooses neurons from
the prompt (``compute_mode`` prompt with phi < gamma), the prompt's neuron votes per layer at its
end and at its marks (the end of the system message and tools): a prompt that reuses a prefix
must choose the neurons a fresh prefill would, and the votes of the tokens it skips come from
there (votes add up over tokens, :meth:`SelectiveMLP._votes`).

Exactness. A position's keys and values depend on the tokens up to it, the weights and the
neurons computed at the prefill: every resident neuron (the selection only shapes the decode
steps). Entries are therefore keyed by the model's resident neuron sets
(:meth:`SelectiveModel.residency_key`): a task switch at gamma < 1 changes them and drops every
entry (:meth:`PromptCache.find` and :meth:`PromptCache.invalidate`); the weights and the model
are fixed per engine. The prefix reused is the longest common prefix with any entry, at most the
new prompt's length minus :data:`MIN_SUFFIX` (its last tokens are prefilled, so selection and
the first logits run as in a fresh prefill), and where neurons are chosen from votes, only a
position the entry holds votes for. The logits equal a fresh prefill's to float rounding (the
prefill's products over fewer rows).

Bounded: ``limit`` bytes (keys, values and votes), least recently used entries evicted first; an
entry that alone exceeds the limit is not kept. Thread-safe.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

MIN_REUSE_TOKENS = 16  # a shorter common prefix is not worth a lookup's copy
MIN_SUFFIX = 2  # prompt tokens always prefilled (the last chunk computes selection and logits)

Votes = tuple  # per layer: (counts [I], mass [I]) by neuron id, or None (the layer did not vote)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class Entry:
    """One prompt: ``ids``, per layer its keys and values ``[n_kv, len(ids), head_dim]`` and the
    votes at some positions (``{position: per-layer votes}``)."""

    key: str
    ids: np.ndarray  # int64 [n]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    votes: dict[int, Votes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = sum(_nbytes(k) + _nbytes(v) for k, v in self.kv)
        seen = set()  # snapshots shared with the entry a prefix came from count once
        for layers in self.votes.values():
            for pair in layers:
                if pair is not None and id(pair) not in seen:
                    seen.add(id(pair))
                    n += _nbytes(pair[0]) + _nbytes(pair[1])
        return n

    def common(self, ids: np.ndarray) -> int:
        """Length of the common prefix of this entry's ids and ``ids``."""
        n = min(len(self.ids), len(ids))
        diff = np.flatnonzero(self.ids[:n] != ids[:n])
        return int(diff[0]) if diff.size else n

    def usable(self, ids: np.ndarray, voting: list[int]) -> int:
        """Tokens of ``ids`` this entry may serve: the common prefix, at most len(ids) -
        MIN_SUFFIX; with ``voting`` layers, the largest position up to there whose votes it holds
        for each of them (0: none)."""
        cap = min(self.common(ids), len(ids) - MIN_SUFFIX)
        if not voting:
            return max(cap, 0)
        return max((p for p, layers in self.votes.items()
                    if p <= cap and all(layers[i] is not None for i in voting)), default=0)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    saved_tokens: int = 0  # prompt tokens not prefilled thanks to hits
    stored: int = 0
    evicted: int = 0  # entries dropped for room
    invalidated: int = 0  # entries dropped because the resident neurons changed


class PromptCache:
    """Entries of one engine's prompts, least recently used first (see the module docstring)."""

    def __init__(self, limit: int = 0):
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._next = 0
        self._bytes = 0
        self.limit = max(0, int(limit))
        self.stats = CacheStats()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def set_limit(self, limit: int) -> None:
        """Keep at most ``limit`` bytes (0: off, every entry dropped)."""
        with self._lock:
            self.limit = max(0, int(limit))
            self._shrink(self.limit)

    def clear(self) -> None:
        with self._lock:
            self._shrink(0)

    def invalidate(self, key: str) -> int:
        """Drop the entries made under another key (the resident neurons changed); how many."""
        with self._lock:
            return self._invalidate(key)

    def _invalidate(self, key: str) -> int:
        stale = [k for k, e in self._entries.items() if e.key != key]
        for k in stale:
            self._bytes -= self._entries.pop(k).nbytes
        self.stats.invalidated += len(stale)
        return len(stale)

    def _shrink(self, limit: int) -> None:
        while self._entries and self._bytes > limit:
            _, e = self._entries.popitem(last=False)
            self._bytes -= e.nbytes
            self.stats.evicted += 1

    def find(self, key: str, ids: list[int], voting: list[int]) -> tuple[Entry, int] | None:
        """The entry serving the longest prefix of ``ids`` under ``key`` and that prefix's length
        (at least MIN_REUSE_TOKENS), or None; counts a hit or a miss."""
        if not self.enabled:
            return None
        arr = np.asarray(ids, dtype=np.int64)
        with self._lock:
            self._invalidate(key)
            best, best_n = None, 0
            for k, e in self._entries.items():
                n = e.usable(arr, voting)
                if n > best_n:
                    best, best_n = k, n
            if best is None or best_n < MIN_REUSE_TOKENS:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(best)
            self.stats.hits += 1
            self.stats.saved_tokens += best_n
            return self._entries[best], best_n

    def put(self, entry: Entry) -> bool:
        """Keep ``entry`` (evicting the least recently used entries for room); an entry whose ids
        an earlier one holds already only refreshes that one, earlier entries whose ids are a
        prefix of this one's are replaced. False when it alone exceeds the limit."""
        size = entry.nbytes
        with self._lock:
            if size > self.limit:
                return False
            self._invalidate(entry.key)
            for k, e in list(self._entries.items()):
                n = len(e.ids)
                if n >= len(entry.ids) and e.common(entry.ids) == len(entry.ids) and \
                        set(entry.votes) <= set(e.votes):
                    self._entries.move_to_end(k)  # holds this prompt (and more) already
                    return True
                if n < len(entry.ids) and e.common(entry.ids) == n and set(e.votes) <= set(entry.votes):
                    self._bytes -= self._entries.pop(k).nbytes  # superseded
            self._shrink(self.limit - size)
            self._entries[self._next] = entry
            self._next += 1
            self._bytes += size
            self.stats.stored += 1
            return True

    def snapshot(self) -> dict[str, int]:
        """The figures diagnostics report."""
        with self._lock:
            s = self.stats
            return {"prompt_cache_entries": len(self._entries), "prompt_cache_bytes": self._bytes,
                    "prompt_cache_limit_bytes": self.limit, "prompt_cache_hits": s.hits,
                    "prompt_cache_misses": s.misses, "prompt_cache_saved_tokens": s.saved_tokens,
                    "prompt_cache_evicted": s.evicted, "prompt_cache_invalidated": s.invalidated}


def chunk_end(lo: int, n: int, budget: int, marks: tuple[int, ...] = ()) -> int:
    """The end of the prompt chunk that starts at ``lo`` (of ``n`` tokens): at most ``budget``
    tokens, cut at the first mark past ``lo`` + 1, and never leaving a last chunk of one token
    (a one-token forward runs the decode kernel, which chooses no neurons)."""
    hi = min(n, lo + max(1, budget))
    cut = [m for m in marks if lo + 2 <= m < hi]
    if cut:
        hi = min(cut)
    if n - hi == 1:
        hi = n
    return hi
