"""The prompt cache: a reused prefix gives a fresh prefill's logits and neurons (prompt-mode
selection included), the cache stays within its bound, a task switch at gamma < 1 drops what it
invalidates (a stale reuse would give other logits), batched requests reuse prefixes too."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from selectinfer_ros.core.execution.batch import Batch
from selectinfer_ros.core.execution.chat import chat_of
from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
from selectinfer_ros.core.execution.prompt_cache import (MIN_SUFFIX, Entry, PromptCache,
                                                         chunk_end)
from selectinfer_ros.core.selection.loader import SelectiveModel

SYSTEM = ("You are the control program of a home robot with an arm. It drives to rooms, picks up "
          "objects and speaks to people. Keep answers short.")
TOOLS = [{"name": "navigate_to", "description": "Drive to a room.",
          "parameters": {"type": "object", "properties": {"room": {"type": "string"}},
                         "required": ["room"]}},
         {"name": "say", "description": "Say a sentence aloud.",
          "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                         "required": ["text"]}}]


def chat(*turns: str):
    roles = ["user", "assistant"]
    return chat_of([{"role": "system", "content": SYSTEM}] +
                   [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)], TOOLS)


def engine(path, profiles=None, task=None, gamma=1.0, phi=1.0) -> Engine:
    sm = SelectiveModel(path, profiles, task, load_ratio=gamma, compute_ratio=phi,
                        static_ratio=min(0.3, phi))
    return Engine.from_selective(sm)


def active(e: Engine) -> list[torch.Tensor]:
    return [torch.sort(ids)[0] for ids in e.selective.active_neuron_ids()]


def run(e: Engine, prompts, megabytes: float):
    """Each prompt's first logits, neurons chosen and tokens served from the cache, in order."""
    e.prompt_cache.clear()
    e.set_prompt_cache(megabytes)
    out = []
    for p in prompts:
        logits, served = e.first_logits(p)
        out.append((logits, active(e), served))
    return out


@pytest.mark.parametrize("gamma,phi", [(0.7, 0.5), (1.0, 1.0)])
def test_a_cached_prefix_gives_the_logits_and_neurons_of_a_fresh_prefill(smollm2, smollm2_profiles,
                                                                         gamma, phi):
    """SmolLM2 (float records): an agent's goals (one system prompt and tools, other questions,
    a conversation that goes on) give with the cache the logits and the decode neurons they give
    without it, to float rounding; at phi < gamma the neurons are chosen from votes (the mark's
    and the end's). (int8 records: a prefix's keys and values differ to int8 rounding between
    two fresh prompts of other lengths already, up to 0.9 logits on SmolLM2: the attention's
    float sums round differently and the next product's quantization moves by a step.)"""
    e = engine(smollm2["float"], smollm2_profiles, "navigation", gamma, phi)
    prompts = [chat("Where is the red cup?"), chat("Bring me the keys, please."),
               chat("Bring me the keys, please.", "I will get them.", "Thanks. Then say hello.")]
    fresh = run(e, prompts, 0)
    cached = run(e, prompts, 64)
    mark = e.prompt_ids(prompts[1])[1][0]
    served = [c[2] for c in cached]
    assert served[0] == 0 and served[2] == len(e.prompt_ids(prompts[1])[0])
    # neurons voted: the mark (the system prompt and tools) serves; else the whole common prefix
    assert served[1] == mark if phi < gamma else served[1] > mark
    for (lf, af, _), (lc, ac, _) in zip(fresh, cached):
        assert torch.allclose(lf, lc, atol=1e-4, rtol=0), (lf - lc).abs().max()
        assert int(lf.argmax()) == int(lc.argmax())
        assert all(torch.equal(x, y) for x, y in zip(af, ac))  # the same decode neurons
    assert e.prompt_cache.stats.hits == 2 and e.prompt_cache.stats.saved_tokens == sum(served)
    cfg = GenerationConfig(max_new_tokens=12)
    with_cache = e.generate(prompts[2], cfg)
    assert with_cache.metrics.cached_tokens > 0
    e.set_prompt_cache(0)
    assert e.generate(prompts[2], cfg).text == with_cache.text


def test_the_cache_stays_within_its_bound_under_50_random_prefixes(tiny_models):
    """50 prompts made of random stems and tails (tiny Llama): never more bytes than the limit,
    entries evicted least recently used first, hits on the stems that come back."""
    _, packed = tiny_models["tiny-llama"]
    e = engine(packed)
    rng = random.Random(7)
    stems = [[rng.randrange(4, 500) for _ in range(40)] for _ in range(6)]
    e.set_prompt_cache(64)
    e.first_logits(stems[0] + [7, 8])
    per_token = e.prompt_cache.nbytes / 42
    limit = int(per_token * 130)  # two or three entries
    cache = e.prompt_cache = PromptCache(limit)
    for _ in range(50):
        tail = [rng.randrange(4, 500) for _ in range(rng.randint(2, 12))]
        e.first_logits(rng.choice(stems) + tail)
        assert cache.nbytes <= limit
        assert cache.nbytes == sum(x.nbytes for x in cache._entries.values())
    s = cache.stats
    assert s.hits > 5 and s.misses > 5 and s.evicted > 5 and len(cache) >= 1
    assert s.hits + s.misses == 50


def test_a_task_switch_at_gamma_below_one_drops_the_entries_it_invalidates(tiny_models,
                                                                          tiny_profiles):
    """Tiny Llama at gamma 0.7: a prompt cached under task alpha is dropped by the switch to
    beta (other resident neurons) and the same prompt then gives beta's fresh logits; reusing
    alpha's keys and values would have given other logits."""
    _, packed = tiny_models["tiny-llama"]
    profiles = tiny_profiles["tiny-llama"]
    e = engine(packed, profiles, "alpha", 0.7, 0.7)
    fresh_beta = engine(packed, profiles, "beta", 0.7, 0.7)
    ids = list(range(5, 45))
    longer = ids + [50, 51, 52, 53, 54]
    e.set_prompt_cache(16)
    e.first_logits(ids)
    stale = next(iter(e.prompt_cache._entries.values()))
    assert e.first_logits(longer)[1] == len(ids)  # served under alpha
    e.selective.switch_task("beta")
    e.prompt_cache.invalidate(e.cache_key())  # as Runtime's switch does
    assert len(e.prompt_cache) == 0 and e.prompt_cache.stats.invalidated == 1  # longer superseded ids
    got, served = e.first_logits(longer)
    assert served == 0
    want, _ = fresh_beta.first_logits(longer)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    # what a stale reuse would give: alpha's keys and values under beta's neurons
    with torch.inference_mode():
        d = e.decoder
        d.import_prefix(0, stale.kv, len(ids))
        e._start(torch.tensor([longer[len(ids):]]))
        wrong = d.prefill(longer[len(ids):], start=len(ids)).float()
        e.state.prefill = True
    assert not torch.allclose(wrong, want, atol=1e-3, rtol=0)


def test_batched_requests_reuse_a_prefix_and_keep_their_texts(smollm2):
    """A request joining a batch reuses the prefix an earlier one left (its prompt, the system
    prompt and tools), and its greedy text equals the request alone without the cache."""
    e = engine(smollm2["float"])
    cfg = GenerationConfig(max_new_tokens=10)
    prompts = [chat("Where is the red cup?"), chat("Bring me the keys, please."),
               chat("Where is the red cup?", "In the kitchen.", "Go there.")]
    alone = [e.generate(p, cfg).text for p in prompts]
    e.set_prompt_cache(64)
    batch = Batch(e, 3)
    streams = [batch.join(prompts[0], cfg)]
    streams += [batch.join(p, cfg) for p in prompts[1:]]  # join while the first decodes
    while batch.running or batch.pending:
        batch.step()
    results = [s.result() for s in streams]
    assert [r.text for r in results] == alone
    served = [r.metrics.cached_tokens for r in results]
    assert served[0] == 0 and served[1] > 0 and served[2] > served[1]


def test_chunks_never_leave_one_token_and_stop_at_marks():
    assert chunk_end(0, 300, 128) == 128
    assert chunk_end(128, 257, 128) == 257  # not 256: a one-token last chunk
    assert chunk_end(0, 300, 300, marks=(90,)) == 90
    assert chunk_end(89, 300, 300, marks=(90,)) == 300  # a mark one token away is skipped
    assert chunk_end(90, 300, 300, marks=(90,)) == 300


def _entry(ids, votes=None, key="k") -> Entry:
    kv = [(torch.zeros(1, len(ids), 4), torch.zeros(1, len(ids), 4))]
    return Entry(key, np.asarray(ids, dtype=np.int64), kv, votes or {})


def test_lookups_take_the_longest_usable_prefix_and_need_votes_where_neurons_are_voted():
    cache = PromptCache(2**20)
    a = list(range(100))
    cache.put(_entry(a[:60], {40: (None, (torch.ones(3), torch.ones(3))), 60: (None, None)}))
    cache.put(_entry(a[:30] + [999] * 30))
    entry, n = cache.find("k", a, voting=[])
    assert n == 60 and len(entry.ids) == 60
    assert cache.find("k", a, voting=[1])[1] == 40  # layer 1 votes: only position 40 serves
    assert cache.find("k", a[:61], voting=[])[1] == 61 - MIN_SUFFIX
    assert cache.find("other", a, voting=[]) is None and len(cache) == 0  # other neurons
    cache.put(_entry(a[:50]))
    cache.put(_entry(a[:70]))  # supersedes its prefix a[:50]
    assert [len(x.ids) for x in cache._entries.values()] == [70]
