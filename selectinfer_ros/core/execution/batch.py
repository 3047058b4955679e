"""Continuous batching: requests that decode together, one pass over the weights per token.

A request joins with its own prefill into a free KV slot of the lean decoder and leaves when it is
done; between, each :meth:`Batch.step` appends one token to every running request
(:meth:`Decoder.decode_batch`: the int8 kernel reads every weight once for all rows). Each request
keeps its own sampling, seed, stop strings, grammar, text stream and cancel (:class:`Stream`),
and its own neurons: requests whose prompts choose different dynamic neurons, or that compute
different ratios, decode over the union of their neurons with each row masked to its own
(:meth:`SelectiveMLP.place`; a leaving request's neurons leave the union).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from .engine import Canceled, Engine, GenerationConfig, Stream
from ..options import MAX_BATCH

PREFILL_CHUNK = 128  # prompt tokens prefilled per step while other requests decode


class Batch:
    """Requests that decode together (continuous batching): each joins with its own prefill
    (:meth:`join`) and leaves when it is done; :meth:`step` appends one token to every running
    request in one pass over the weights (:meth:`Decoder.decode_batch`), each request keeping its
    own KV cache slot, sampling, seed, stop strings, grammar, text stream and cancel. Greedy text
    equals the request's alone (row b of a step is the same arithmetic as a step alone, except an
    output product that takes the blocked path: 9 or more rows on AVX-512 VNNI, 5 or more on the
    AVX2-class paths; and a prompt prefilled in chunks sums its attention and products by
    chunk). Rows that compute different neurons differ from alone also in where their neurons
    sit in the prefix (the int8 kernel quantizes the down product's inputs by blocks of 32
    slots): to int8 rounding. Per-token selection decodes alone (:meth:`Engine.batch_refusal`).
    Not thread-safe: one thread owns a batch (the engine's lock is held per call)."""

    def __init__(self, engine: Engine, max_batch: int, prefill_chunk: int = PREFILL_CHUNK):
        if engine.decoder is None:
            raise ValueError(f"batched decoding needs the lean decoder ({engine.decode_path})")
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch {max_batch} outside [1, {MAX_BATCH}]")
        self.engine, self.max_batch, self.prefill_chunk = engine, max_batch, max(1, prefill_chunk)
        self.running: list[Stream] = []
        self.pending: list[Stream] = []  # prompts being prefilled chunk by chunk, in order
        self.steps = 0  # batched decode steps taken
        self.rows = 0  # tokens they produced (sum of the batch sizes)

    @property
    def room(self) -> int:
        return self.max_batch - len(self.running) - len(self.pending)

    def join(self, prompt: str | list[int], config: GenerationConfig | None = None,
             on_text: Callable[[str, int], None] | None = None,
             cancel: Callable[[], bool] | None = None) -> Stream:
        """Prefill a request into a free slot; the stream joins the running ones unless its
        first token already ends it (``finish`` set: take its :meth:`Stream.result`). A prompt
        longer than ``prefill_chunk`` tokens while others decode is prefilled by :meth:`step`,
        one chunk per step, so they keep streaming (the stream is in ``pending`` until its first
        token; a step then returns it if that token ends it). ValueError
        (checked before the model runs) for a request that may not batch, a full batch or a bad
        prompt; a canceled prefill ends with ``finish`` "canceled"."""
        e, t0 = self.engine, time.perf_counter()
        config = config or GenerationConfig()
        config.validate()
        reason = e.batch_refusal(config)
        if reason is not None:
            raise ValueError(f"this request cannot decode in a batch: {reason}")
        if self.room <= 0:
            raise ValueError(f"the batch is full ({self.max_batch} requests)")
        ids, max_new, metrics, gen, marks = e.request(prompt, config)
        stream = Stream(e, ids, config, max_new, metrics, gen, on_text, cancel, t0, marks)
        used = {r.slot for r in self.running + self.pending}
        stream.slot = next(s for s in range(self.max_batch) if s not in used)
        with e._lock, torch.inference_mode(), e.phi(config.compute_ratio):
            e.decoder.reserve(len(ids) + max_new, self.max_batch)
            if e.selective is not None:
                e.selective.share_rows(self.max_batch)
            e.open_prompt(stream, stream.slot, stream.slot)  # a cached prefix, its votes
        if self.running and len(ids) - stream.filled > self.prefill_chunk:
            self.pending.append(stream)
        else:  # at once (in chunks only where a mark cuts it)
            while stream.finish is None and stream not in self.running:
                self._prefill(stream, len(ids))
        return stream

    def _prefill(self, stream: Stream, n: int) -> None:
        """The next chunk (at most ``n`` tokens, :meth:`Engine.prefill_chunk`) of ``stream``'s
        prompt into its slot; after the last, its first token (it joins the running ones unless
        that ends it)."""
        e = self.engine
        cancel, st = stream.cancel, e.state
        last = False
        with e._lock, torch.inference_mode(), e.phi(stream.config.compute_ratio):
            ok = False
            try:
                if cancel is not None and cancel():
                    raise Canceled
                with e.cancel_between_layers(cancel):
                    logits = e.prefill_chunk(stream, stream.slot, stream.slot, n, 0)
                last = logits is not None
                done = last and stream.advance(logits)
                if last:
                    e._end_prefill(stream.metrics)
                ok = True
            except Canceled:
                stream.finish, done = "canceled", True
            finally:
                if st is not None:
                    st.prefill = True
                if not ok or done:
                    self._release(stream)
        if stream in self.pending and (done or last):
            self.pending.remove(stream)
        if last and not done:
            self.running.append(stream)

    def _release(self, stream: Stream) -> None:
        """``stream`` left the batch: its neurons leave the union the rows compute."""
        if self.engine.selective is not None:
            self.engine.selective.release_row(stream.slot)

    def step(self) -> list[Stream]:
        """The next chunk of the first pending prompt, then one token for every running request;
        the requests it ended (removed from the batch; take each one's :meth:`Stream.result`).
        An exception leaves the batch as it was."""
        ended = []
        if self.pending:
            first = self.pending[0]
            self._prefill(first, self.prefill_chunk)
            if first.finish is not None:
                ended.append(first)
        if not self.running:
            return ended
        e, d = self.engine, self.engine.decoder
        rows = self.running
        with e._lock, torch.inference_mode():
            if e.state is not None:
                e.state.prefill = False
            try:
                logits = d.decode_batch([r.tok for r in rows], [r.slot for r in rows])  # [B, V]
            finally:
                if e.state is not None:
                    e.state.prefill = True
            self.steps += 1
            self.rows += len(rows)
            done = [r for b, r in enumerate(rows) if r.advance(logits[b])]
            for r in done:
                self._release(r)
        self.running = [r for r in self.running if r.finish is None]
        return ended + done

    def cancel_all(self, finish: str = "canceled") -> list[Stream]:
        """End every running or pending request (``finish``); they are returned, the batch is
        empty."""
        ended, self.running, self.pending = self.running + self.pending, [], []
        with self.engine._lock:
            for r in ended:
                r.finish = finish
                self._release(r)
        return ended
