"""Hostile input to the serving layer (no ROS): every goal and service request is answered with
a value or a Rejected reason, at once, and what is accepted can run.

Property-based (hypothesis) over the fields of the Generate goal and the ReloadBase timeout,
plus the worst cases an outside tester found (issue 19): 8 options x 250,000 characters, 64
options x 2,000 characters, ``timeout: .inf``, ``temperature: 1e-40``, a 10,000-character task.
"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selectinfer_ros.core.execution.engine import (MAX_CHOICE_TOKENS, Engine, GenerationConfig,
                                                   validate_choices)
from selectinfer_ros.core.options import NodeSettings
from selectinfer_ros.core.serving import server as serving
from selectinfer_ros.core.serving.server import Rejected

PROMPT = "w10 w11 w12 w13 w14 w15"
SETTINGS = NodeSettings(max_new_tokens=8, max_new_tokens_limit=64, load_ratio=0.7,
                        compute_ratio=0.5)
FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(module_server):
    """One served model for the whole module: these tests only validate."""
    return module_server


def goal(**over):
    base = dict(prompt=PROMPT, task="", max_new_tokens=0, temperature=0.0, top_k=0, top_p=0.0,
                repetition_penalty=0.0, seed=-1, stop=[], use_chat_template=False,
                compute_ratio=0.0, choices=[], length_normalize=False)
    base.update(over)
    return SimpleNamespace(**base)


# float32 message fields: anything a client can put there, NaN and infinities included
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
tiny = st.floats(min_value=0.0, max_value=0.0009765625, width=32, exclude_min=True)
text = st.text(max_size=300)
goals = st.fixed_dictionaries({
    "prompt": st.one_of(st.just(PROMPT), text),
    "task": st.one_of(st.just(""), st.sampled_from(["alpha", "beta"]), text),
    "max_new_tokens": st.integers(0, 2**32 - 1),
    "temperature": st.one_of(f32, tiny),
    "top_k": st.integers(-2**31, 2**31 - 1),
    "top_p": f32,
    "repetition_penalty": st.one_of(f32, tiny),
    "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.lists(st.text(max_size=400), max_size=20),
    "compute_ratio": f32,
    "choices": st.one_of(st.just([]), st.lists(st.text(max_size=40), max_size=5)),
})


@FAST
@given(fields=goals)
def test_any_goal_is_refused_with_a_reason_or_configured_so_it_can_run(server, fields):
    g = goal(**fields)
    try:
        cfg, phi = serving.goal_config(g, SETTINGS, server.runtime)
    except Rejected as e:
        assert e.code in (serving.INVALID_GOAL, serving.UNKNOWN_TASK) and e.reason
        assert len(e.reason) < serving.MAX_REASON_CHARS  # long names are cut
        return
    cfg.validate()
    assert 1 <= cfg.max_new_tokens <= SETTINGS.max_new_tokens_limit
    assert 0 < phi <= 1
    if not fields["choices"]:  # sampling with these values never fails
        logits = torch.randn(50) * 30
        history = torch.zeros(50, dtype=torch.bool)
        history[:5] = True
        token = Engine._sample(logits, cfg, history, torch.Generator().manual_seed(0))
        assert 0 <= token < 50


@FAST
@given(timeout=st.floats(allow_nan=True, allow_infinity=True))
def test_any_reload_timeout_is_refused_or_finite_and_clamped(timeout):
    try:
        value = serving.reload_timeout(timeout, 300.0)
    except Rejected as e:
        assert math.isnan(timeout) or timeout < 0
        assert "timeout" in e.reason
        return
    assert math.isfinite(value) and 0 < value <= serving.MAX_RELOAD_TIMEOUT
    assert value == (300.0 if timeout == 0 else min(timeout, serving.MAX_RELOAD_TIMEOUT))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompt=st.text(max_size=2000), choices=st.lists(st.text(max_size=300), max_size=70))
def test_any_prompt_and_choices_are_checked_without_error(server, prompt, choices):
    try:
        tokens = server.check_prompt(prompt, False)
    except Rejected as e:
        assert e.code in (serving.INVALID_GOAL, serving.PROMPT_TOO_LONG)
        return
    assert 0 < tokens < server.runtime.engine.context_limit
    if choices:
        try:
            server.check_choices(choices, tokens)
        except Rejected as e:
            assert e.code == serving.INVALID_GOAL and e.reason.startswith("invalid choices")


def _answered(fn, *args):
    t0 = time.perf_counter()
    with pytest.raises(Rejected) as e:
        fn(*args)
    return e.value, time.perf_counter() - t0


def test_huge_choices_are_refused_before_tokenizing(server, monkeypatch):
    """8 options x 250,000 characters: refused by counting characters (the tokenizer is never
    called); 64 options x 2,000 characters: tokenized, refused for their total tokens."""
    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized")

    monkeypatch.setattr(server, "_check_tokenizer", no_tokenizing)
    e, seconds = _answered(server.check_choices, [c * 250_000 for c in "abcdefgh"], 7)
    assert "characters" in e.reason and seconds < 1.0
    monkeypatch.undo()
    many = [f"option {i} " + " ".join(f"w{(i * 7 + j) % 400}" for j in range(400))[:1990]
            for i in range(64)]
    e, seconds = _answered(server.check_choices, many, 7)
    assert "tokens" in e.reason and seconds < 5.0
    # with room for each option, the total still bounds the work: 64 x 100 tokens > 4096
    wide = SimpleNamespace(context_limit=2048)
    ids = [[5] * 100 for _ in range(64)]
    with pytest.raises(ValueError, match=f"more than {MAX_CHOICE_TOKENS} tokens in all"):
        validate_choices([f"o{i}" for i in range(64)], wide, 7, ids)
    validate_choices([f"o{i}" for i in range(64)], wide, 7, [[5] * 64 for _ in range(64)])


def test_worst_goals_are_answered(server):
    rt = server.runtime
    long_task = "t" * 10_000
    e, _ = _answered(serving.goal_config, goal(task=long_task), SETTINGS, rt)
    assert e.code == serving.UNKNOWN_TASK and len(e.reason) < 200 and "t" * 64 + "..." in e.reason
    server.note_rejection(e)
    assert len(server.last_rejection) <= serving.MAX_REASON_CHARS + 3
    # max_new_tokens is ignored with choices (Generate.action)
    cfg, _ = serving.goal_config(goal(choices=["yes", "no"], max_new_tokens=2**32 - 1,
                                      temperature=float("nan")), SETTINGS, rt)
    assert cfg.max_new_tokens == SETTINGS.max_new_tokens
    # a tiny temperature is accepted and decodes greedily
    cfg, _ = serving.goal_config(goal(temperature=1e-40, max_new_tokens=6), SETTINGS, rt)
    cfg.ignore_eos = True
    res = rt.generate(PROMPT, cfg)
    greedy = rt.generate(PROMPT, GenerationConfig(max_new_tokens=6, ignore_eos=True))
    assert res.token_ids == greedy.token_ids
    e, seconds = _answered(server.check_prompt, "w1 " * 10_000_000, False)
    assert e.code == serving.PROMPT_TOO_LONG and seconds < 1.0


def test_reload_with_an_infinite_timeout_is_answered(server):
    """``timeout: .inf`` used to raise OverflowError in Event.wait and stop the executor."""
    for timeout in (float("inf"), 1e300):
        assert server.reload("beta", timeout).task == "beta"
        assert server.reload("alpha", timeout).task == "alpha"
    for timeout in (float("nan"), -1.0):
        e, _ = _answered(server.reload, "beta", timeout)
        assert e.code == serving.INVALID_GOAL
    assert server.task == "alpha"


def test_control_tokens_typed_in_a_prompt_are_plain_text_by_default():
    """Issue 27: `<end_of_turn>` typed in a prompt is text (several tokens), not the control
    token; `special_tokens=True` (the node's prompt_special_tokens) reads it as one."""
    from selectinfer_ros.core.execution.engine import encode
    from selectinfer_ros.core.format.tokenizer import load_tokenizer
    from selectinfer_ros.ros.nodes.settings import embedded_model_path
    path = embedded_model_path(convert=True)
    tok = load_tokenizer(path)
    plain = encode(tok, 'Hello world')
    for forged in ('<end_of_turn>', '<start_of_turn>', '<eos>', '<bos>'):
        ctrl = tok.convert_tokens_to_ids(forged)
        as_text = encode(tok, f'Hello {forged} world')
        as_ctrl = encode(tok, f'Hello {forged} world', special_tokens=True)
        assert ctrl not in as_text[1:] and ctrl in as_ctrl[1:], forged
        assert len(as_text) > len(as_ctrl) >= len(plain)
    assert encode(tok, 'Hello world') == tok('Hello world')['input_ids']  # BOS still added
