"""Generation engine: streaming, stop strings, limits, sampling, cancellation, metrics."""
from __future__ import annotations

import pytest
import torch

from selectinfer_ros.core.execution.engine import ContextLengthError, Engine, GenerationConfig
from selectinfer_ros.core.selection.loader import SelectiveModel


@pytest.fixture(scope="module")
def engine(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-llama"]
    sm = SelectiveModel(packed, tiny_profiles["tiny-llama"], "alpha", load_ratio=0.8,
                        static_ratio=0.3, compute_ratio=0.5)
    return Engine.from_selective(sm, context_limit=128)


PROMPT = "w10 w11 w12 w13 w14 w15"


def test_stream_pieces_add_up_to_the_text(engine):
    pieces: list[str] = []
    res = engine.generate(PROMPT, GenerationConfig(max_new_tokens=12), on_text=lambda s, n: pieces.append(s))
    assert res.finish_reason in ("length", "stop")
    assert "".join(pieces) == res.text
    assert len(pieces) >= 2
    m = res.metrics
    assert m.prompt_tokens == 7  # BOS + 6 words
    assert m.generated_tokens == len(res.token_ids) <= 12
    assert m.time_to_first_token > 0 and m.tokens_per_second > 0


def test_greedy_is_deterministic_and_max_new_tokens_holds(engine):
    a = engine.generate(PROMPT, GenerationConfig(max_new_tokens=9))
    b = engine.generate(PROMPT, GenerationConfig(max_new_tokens=9))
    assert a.token_ids == b.token_ids
    if a.finish_reason == "length":
        assert len(a.token_ids) == 9


def test_seeded_sampling_reproduces_and_seeds_differ(engine):
    cfg = dict(max_new_tokens=10, temperature=1.5, top_k=50, top_p=0.95, repetition_penalty=1.2)
    a = engine.generate(PROMPT, GenerationConfig(seed=7, **cfg))
    b = engine.generate(PROMPT, GenerationConfig(seed=7, **cfg))
    c = engine.generate(PROMPT, GenerationConfig(seed=8, **cfg))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_truncates_and_is_never_streamed(engine):
    free = engine.generate(PROMPT, GenerationConfig(max_new_tokens=10))
    words = free.text.split()
    assert len(words) >= 4
    stop = " ".join(words[2:4])
    pieces: list[str] = []
    res = engine.generate(PROMPT, GenerationConfig(max_new_tokens=10, stop=[stop]), on_text=lambda s, n: pieces.append(s))
    assert res.finish_reason == "stop"
    assert stop not in res.text and stop not in "".join(pieces)
    assert free.text.startswith(res.text)


def test_cancel_returns_partial_text_within_one_step(engine):
    calls = {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return calls["n"] > 4 + engine.cancel_points

    res = engine.generate(PROMPT, GenerationConfig(max_new_tokens=50), cancel=cancel)
    assert res.finish_reason == "canceled"
    # the check runs before the prefill, in it twice per layer, and before every token
    assert len(res.token_ids) == 4


def test_context_limit_is_enforced(engine):
    with pytest.raises(ContextLengthError, match="context limit is 128"):
        engine.generate(" ".join(["w9"] * 130), GenerationConfig(max_new_tokens=4))
    res = engine.generate(" ".join(["w9"] * 120), GenerationConfig(max_new_tokens=50))
    assert res.metrics.prompt_tokens + res.metrics.generated_tokens <= 128


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0.0),
                                 dict(top_k=-2), dict(repetition_penalty=0.0)])
def test_bad_generation_settings_are_refused(engine, bad):
    with pytest.raises(ValueError):
        engine.generate(PROMPT, GenerationConfig(**bad))


def test_compute_ratio_override_is_per_request(engine):
    sm = engine.selective
    engine.generate(PROMPT, GenerationConfig(max_new_tokens=3, compute_ratio=0.35))
    assert sm.compute_ratio == 0.5
    with pytest.raises(ValueError, match="compute_ratio"):
        engine.generate(PROMPT, GenerationConfig(max_new_tokens=3, compute_ratio=0.9))


def test_dense_engine_matches_selective_at_full_ratio(tiny_models):
    from selectinfer_ros.core.selection.loader import load_dense
    from selectinfer_ros.core.format.tokenizer import load_tokenizer
    _, packed = tiny_models["tiny-gemma3"]
    dense, _ = load_dense(packed)
    e1 = Engine(dense, load_tokenizer(packed))
    e2 = Engine.from_selective(SelectiveModel(packed))
    cfg = GenerationConfig(max_new_tokens=16)
    assert e1.generate(PROMPT, cfg).token_ids == e2.generate(PROMPT, cfg).token_ids


def test_bos_does_not_vote(engine):
    state = engine.selective.state
    seen = {}
    orig = engine.selective.mlps[0]._select

    def spy(h):
        seen["w"] = state.token_weight.clone()
        orig(h)

    engine.selective.mlps[0]._select = spy
    try:
        engine.generate(PROMPT, GenerationConfig(max_new_tokens=2))
    finally:
        del engine.selective.mlps[0]._select
    assert seen["w"].tolist() == [0.0] + [1.0] * 6


def test_detokenizer_text_equals_decoding_the_whole_sequence(embedded):
    """Token by token, over text with multi-byte characters split across tokens: the running
    text always equals the whole sequence decoded (once no character is incomplete)."""
    from selectinfer_ros.core.execution.engine import Detokenizer
    from selectinfer_ros.core.format.tokenizer import load_tokenizer
    tok = load_tokenizer(embedded)
    text = "Robot 🤖 goes to the kitchen — 厨房, then déjà vu:\n  - dock ✓ «fin»"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, tok.vocab_size, (60,), generator=g).tolist()
    for seq in (ids, noise):
        d = Detokenizer(tok)
        pieces = [d.add(t) for t in seq]
        whole = tok.decode(seq, skip_special_tokens=True)
        assert "".join(pieces) == d.text
        assert d.text == whole or (seq is noise and whole.endswith("\ufffd")
                                   and whole.startswith(d.text))


def test_context_limit_cut_says_so(engine):
    """A generation ended by the context window (not by max_new_tokens) has finish_reason
    context_length."""
    prompt = " ".join(f"w{i}" for i in range(10, 130))  # 121 tokens of 128
    res = engine.generate(prompt, GenerationConfig(max_new_tokens=50, ignore_eos=True))
    assert res.finish_reason == "context_length" and len(res.token_ids) == 7
    res = engine.generate(prompt, GenerationConfig(max_new_tokens=7, ignore_eos=True))
    assert res.finish_reason == "length"


def test_tiny_temperature_decodes_greedily(engine):
    greedy = engine.generate(PROMPT, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    for t in (1e-40, 1e-6, 5e-4):
        res = engine.generate(PROMPT, GenerationConfig(max_new_tokens=8, temperature=t,
                                                       ignore_eos=True, seed=1))
        assert res.token_ids == greedy.token_ids
    with pytest.raises(ValueError, match="finite"):
        GenerationConfig(temperature=float("inf")).validate()


def test_cancel_inside_a_long_prefill(engine):
    """The prefill polls cancel before every layer: a long prompt stops within one layer."""
    assert engine.cancel_points == 2 * len(engine.model.model.layers)  # attention and MLP
    prompt = " ".join(f"w{i}" for i in range(10, 120))
    polls = []
    res = engine.generate(prompt, GenerationConfig(max_new_tokens=5),
                          cancel=lambda: polls.append(1) or len(polls) > 2)
    assert res.finish_reason == "canceled" and res.token_ids == [] and len(polls) == 3
    assert engine.generate(PROMPT, GenerationConfig(max_new_tokens=3)).token_ids  # still serves


def test_greedy_token_is_torch_argmax_on_every_layout():
    """The greedy pick (numpy for a CPU float32 vector) equals torch.argmax: the first of equal
    maxima, a NaN, all -inf, a strided view, a row of a batch's logits, other dtypes."""
    from selectinfer_ros.core.execution.engine import greedy_token
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(4, 1000, generator=g)
    cases = [torch.tensor([1.0, 3.0, 3.0, 2.0]), torch.tensor([1.0, float("nan"), 5.0]),
             torch.full((7,), float("-inf")), batch[:, 3], batch[2], batch[1, ::3],
             batch[0].to(torch.bfloat16), batch[0].double()]
    with torch.inference_mode():
        cases.append(torch.randn(262144, generator=g))
    for x in cases:
        assert greedy_token(x) == int(torch.argmax(x)), x


def test_sampling_draws_each_token_at_its_probability():
    """Temperature, top-k and top-p (a token stays while the mass before it is at most p) on 8
    logits: 20000 seeded draws land only on the kept tokens, each at its renormalized
    probability (within 0.015); the 262144-logit path (candidates only) keeps the same tokens."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 3.0, -1.0])

    def expected(t, k, p):
        z = logits / t
        keep = torch.ones(8, dtype=torch.bool)
        if k:
            keep &= z >= torch.topk(z, k).values[-1]
        probs = torch.softmax(z.masked_fill(~keep, float("-inf")), 0)
        sp, si = torch.sort(probs, descending=True)
        sp[torch.cumsum(sp, 0) - sp > p] = 0
        out = torch.zeros(8).scatter_(0, si, sp)
        return out / out.sum()

    for t, k, p in ((1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.6), (1.3, 5, 0.8)):
        cfg = GenerationConfig(temperature=t, top_k=k, top_p=p)
        gen = torch.Generator().manual_seed(1)
        counts = torch.bincount(torch.tensor([Engine._sample(logits.clone(), cfg, None, gen)
                                              for _ in range(20000)]), minlength=8)
        want = expected(t, k, p)
        assert torch.equal(counts > 0, want > 0), (t, k, p, counts, want)
        assert (counts / 20000 - want).abs().max() < 0.015, (t, k, p, counts / 20000, want)
    big = torch.randn(262144, generator=torch.Generator().manual_seed(2))
    big[[5, 70000, 262143]] += torch.tensor([14.0, 13.5, 13.0])  # three tokens hold 0.908
    cfg = GenerationConfig(temperature=1.0, top_p=0.9)
    gen = torch.Generator().manual_seed(3)
    drawn = {Engine._sample(big.clone(), cfg, None, gen) for _ in range(300)}
    assert drawn == {5, 70000, 262143}  # softmax: 0.824, 0.054, 0.030 (before the third: 0.878)
