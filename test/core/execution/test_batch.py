"""Continuous batching: requests decoded together keep their own texts, limits and cancels."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selectinfer_ros.core.execution.batch import Batch
from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
from selectinfer_ros.core.selection.loader import SelectiveModel
from selectinfer_ros.lab.bench import pack_of

DATA = Path(__file__).resolve().parents[3] / "selectinfer_ros" / "data" / "eval_alt"


def _prompts(n: int) -> list[str]:
    """``n`` prompts of the held-out set's tasks in turn (phrased unlike profiling; prose: the
    opening of a text to continue)."""
    per = [[r.get("prompt") or r["text"][:300] for r in map(json.loads, f.read_text().splitlines())]
           for f in sorted(DATA.glob("*.jsonl"))]
    return [p for group in zip(*per) for p in group][:n]


def _run(batch: Batch, jobs: list[tuple[str, GenerationConfig]], cancel_at: dict | None = None,
         pre: dict | None = None, offset: int = 0) -> list:
    """Every job through ``batch``: each joins as soon as a slot is free (continuous
    batching), the running ones step together; the results in job order (``pre``: streams
    joined already, numbered before the jobs, which start at ``offset``)."""
    results: dict[int, object] = {}
    streams: dict[int, object] = dict(pre or {})
    waiting = [(offset + i, job) for i, job in enumerate(jobs)]
    while waiting or batch.running:
        while waiting and batch.room > 0:
            i, (prompt, cfg) = waiting.pop(0)
            s = streams[i] = batch.join(prompt, cfg, cancel=(cancel_at or {}).get(i))
            if s.finish is not None:
                results[i] = s.result()
        for s in batch.step():
            i = next(k for k, v in streams.items() if v is s)
            results[i] = s.result()
    return [results[i] for i in range(offset + len(jobs))]


@pytest.fixture(scope="module")
def int8_engine(embedded, embedded_profiles):
    sm = SelectiveModel(pack_of(embedded, "int8", lambda s: None), embedded_profiles, "qa",
                        load_ratio=1.0)
    e = Engine.from_selective(sm)
    assert e.decoder.path == "int8 decode kernel"
    return e


def test_greedy_texts_in_a_batch_of_4_equal_each_request_alone(int8_engine):
    """20 held-out prompts of the embedded model (int8, the decode kernel), greedy: the same
    text and finish whether a request runs alone or joins a batch of up to 4 as slots free."""
    cfg = GenerationConfig(max_new_tokens=24, stop=["\n"])
    prompts = _prompts(20)
    alone = [int8_engine.generate(p, cfg) for p in prompts]
    batch = Batch(int8_engine, 4)
    together = _run(batch, [(p, cfg) for p in prompts])
    assert [r.text for r in together] == [r.text for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    assert batch.rows > 2 * batch.steps  # the steps carried several requests at once
    assert not batch.running


def test_canceling_one_request_leaves_the_others_texts(int8_engine):
    """One request of a running batch canceled after its 3rd streamed token: it ends
    "canceled" with the text it streamed; the others' texts equal their runs alone; a request
    with its own sampling seed reproduces its text alone."""
    prompts = _prompts(4)
    greedy = GenerationConfig(max_new_tokens=16)
    sampled = GenerationConfig(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    jobs = [(prompts[0], greedy), (prompts[1], sampled), (prompts[2], greedy),
            (prompts[3], greedy)]
    alone = [int8_engine.generate(p, c) for p, c in jobs]
    calls = {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    batch = Batch(int8_engine, 4)
    results = _run(batch, jobs, cancel_at={2: cancel})
    assert results[2].finish_reason == "canceled"
    assert alone[2].text.startswith(results[2].text) and len(results[2].text) < len(alone[2].text)
    for i in (0, 1, 3):
        assert results[i].text == alone[i].text, i


def test_a_full_batch_and_a_bad_compute_ratio_are_refused_before_the_model_runs(int8_engine):
    """One request more than the batch holds, and a compute ratio the model cannot serve, are
    refused with the reason; the batch keeps serving."""
    batch = Batch(int8_engine, 1)
    with pytest.raises(ValueError, match=r"compute_ratio must be in \[static_ratio=1.0, "
                                         r"load_ratio=1.0\], got 0.5"):
        batch.join("Hello", GenerationConfig(compute_ratio=0.5))
    s = batch.join("The robot", GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="the batch is full"):
        batch.join("Hello", GenerationConfig(max_new_tokens=4))
    while batch.running:
        batch.step()
    assert s.result().finish_reason == "length"
    with pytest.raises(ValueError, match=r"max_batch 0 outside \[1, 16\]"):
        Batch(int8_engine, 0)


RATIOS = [0.4, 0.6, 0.8, 0.5, 0.6, 0.4, 0.8, 0.7]  # compute ratios of the mixed jobs (gamma 0.8)


def _row_ids(mlp, slot: int) -> set[int]:
    """The neuron ids KV slot ``slot``'s row computes in ``mlp`` (its mask over the prefix)."""
    on = mlp.row_mask[slot, :mlp.width] > 0
    return set(mlp.slot_ids[:mlp.width][on].tolist())


def test_requests_of_different_compute_ratios_decode_together_each_with_its_own_neurons(
        embedded, embedded_profiles):
    """8 held-out prompts with compute ratios 0.4-0.8 of gamma 0.8 (float weights: the masked
    products are exact), each choosing its dynamic neurons at its prefill, decoded 4 at a time
    over the union of their neurons and leaving at different lengths: each row computes its
    own neurons (as many as its ratio asks, the static ones included) and its greedy text
    equals its run alone; when all are done no row is left in any layer."""
    sm = SelectiveModel(embedded, embedded_profiles, "qa", load_ratio=0.8, static_ratio=0.3,
                        compute_ratio=0.6)
    e = Engine.from_selective(sm)
    assert e.decoder is not None and e.batch_refusal(GenerationConfig(compute_ratio=0.4)) is None
    jobs = [(p, GenerationConfig(max_new_tokens=12 + 3 * i, compute_ratio=r))
            for i, (p, r) in enumerate(zip(_prompts(8), RATIOS))]
    alone = [e.generate(p, c) for p, c in jobs]
    batch = Batch(e, 4)
    first = [batch.join(p, c) for p, c in jobs[:4]]
    asked = []  # per ratio, the neurons each layer computes
    for r in RATIOS[:4]:
        with e.phi(r):
            asked.append([m.n_active for m in sm.mlps])
    for layer, mlp in enumerate(sm.mlps):
        rows = [_row_ids(mlp, s.slot) for s in first]
        assert [len(r) for r in rows] == [a[layer] for a in asked]
        static = set(mlp.slot_ids[:mlp.n_static].tolist())
        assert all(static <= r for r in rows)
        assert mlp.width == len(set().union(*rows)) and mlp.masked
    together = _run(batch, jobs[4:], pre={i: s for i, s in enumerate(first)}, offset=4)
    assert [r.text for r in together] == [r.text for r in alone]
    assert batch.rows > 2 * batch.steps
    assert all(not m.live and m.width is None and not m.masked for m in sm.mlps)


@pytest.mark.parametrize("weights", ["int8", "q4", "tiers"])
def test_masked_rows_in_the_kernel_equal_the_torch_path(tiny_models, tiny_profiles, weights,
                                                       tmp_path):
    """Rows of one decode step computing different neurons of the shared prefix (tiny Llama,
    int8 and 4-bit records, and tiered ones (int8 0.3, 4-bit the rest), compute ratios
    0.3 / 0.5 / 0.7 of gamma 0.7): the decode kernel's logits equal the torch path's on the same
    slots and masks, and differ without the masks."""
    from selectinfer_ros.core.format.pack import pack
    hf, packed = tiny_models["tiny-llama"]
    if weights != "int8":
        packed = pack(hf, tmp_path / "q4", weights="q4", log=lambda s: None).path
    else:
        packed = pack_of(packed, "int8", lambda s: None)
    sm = SelectiveModel(packed, tiny_profiles["tiny-llama"], "alpha", load_ratio=0.7,
                        static_ratio=0.2, compute_ratio=0.5,
                        int8_ratio=0.3 if weights == "tiers" else 0.0)
    parts = [p for m in sm.mlps for p in m.parts]
    assert len(parts) == (2 if weights == "tiers" else 1) * len(sm.mlps)
    e = Engine.from_selective(sm)
    assert e.decoder.path == "int8 decode kernel"
    batch = Batch(e, 3)
    rows = [batch.join(f"w{11 * i} w{7 + i} w{40 - i} w{3 * i}",
                       GenerationConfig(max_new_tokens=8, compute_ratio=r, ignore_eos=True))
            for i, r in enumerate((0.3, 0.5, 0.7))]
    assert all(m.masked for m in parts)
    d = e.decoder
    toks, slots = [r.tok for r in rows], [r.slot for r in rows]
    lengths = list(d.lengths)

    def step(native) -> torch.Tensor:
        d.lengths[:] = lengths
        kept, d.native = d.native, native
        try:
            e.state.prefill = False
            with torch.inference_mode():
                return d.decode_batch(toks, slots)
        finally:
            d.native, e.state.prefill = kept, True

    kernel, torch_path = step(d.native), step(None)
    scale = float(torch_path.abs().max())
    assert torch.allclose(kernel, torch_path, rtol=0, atol=2e-4 * scale)
    for m in parts:
        m.masked = False
    e.state.version += 1
    unmasked = step(d.native)
    assert (unmasked - torch_path).abs().max() > 100 * (kernel - torch_path).abs().max()


def test_grammar_and_stop_strings_hold_per_request(int8_engine):
    """A JSON-schema request and a stop-string request in one batch: each ends as it does alone
    (the grammar's mask and the stop strings are the request's own)."""
    schema = ('{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
              '"required": ["ok"]}')
    jobs = [("Answer in JSON. Is the door open?", GenerationConfig(max_new_tokens=24,
                                                                  json_schema=schema)),
            ("Count: one, two, three,", GenerationConfig(max_new_tokens=24, stop=[","]))]
    if not int8_engine.grammars.wait_ready(120.0):
        pytest.fail("the grammar vocabulary was not prepared")
    alone = [int8_engine.generate(p, c) for p, c in jobs]
    together = _run(Batch(int8_engine, 2), jobs)
    assert [(r.text, r.finish_reason) for r in together] == \
        [(r.text, r.finish_reason) for r in alone]
    assert together[0].finish_reason == "grammar" and together[1].finish_reason == "stop"


def test_a_long_prompt_is_prefilled_in_chunks_while_others_stream(int8_engine):
    """A prompt of ~300 tokens joining a running request is prefilled 64 tokens per step: the
    running request gets a token at every one of those steps, and the long prompt's greedy text
    equals its run alone."""
    long = " ".join(_prompts(20))[:1400] + "\nIn short:"
    cfg = GenerationConfig(max_new_tokens=12)
    alone = int8_engine.generate(long, cfg)
    batch = Batch(int8_engine, 2, prefill_chunk=64)
    first = batch.join(_prompts(1)[0], GenerationConfig(max_new_tokens=40, ignore_eos=True))
    second = batch.join(long, cfg)
    n_prompt = len(second.ids)
    assert n_prompt > 256 and second in batch.pending and second.filled == 0
    chunks = 0
    while second in batch.pending:
        before = len(first.detok.ids)
        batch.step()
        chunks += 1
        assert len(first.detok.ids) == before + 1  # the running request streamed meanwhile
    assert chunks == -(-n_prompt // 64)
    while batch.running:
        batch.step()
    assert second.result().text == alone.text
    assert first.result().finish_reason == "length"
