"""Engine.choose: the choice with the highest log-likelihood, one prefill shared by all choices,
agreeing with Engine.score computed directly; choice validation; the CLI's --choices."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from selectinfer_ros.core.execution import engine as engine_mod
from selectinfer_ros.core.execution.engine import MAX_CHOICES, Canceled, Engine, validate_choices
from selectinfer_ros.core.selection.loader import SelectiveModel
from selectinfer_ros.core.options import ModelOptions
from selectinfer_ros.core.serving.runtime import Runtime

NAV_PROMPT = ("Convert the instruction to a robot command.\nInstruction: Go to the kitchen.\n"
              "Command: goto(kitchen)\nInstruction: Would you mind driving over to the library?\n"
              "Command:")
NAV_CHOICES = ["goto(library)", "goto(lobby)", "pick(pen)", "dock()", "turn(left, 120)"]


def direct_logprobs(engine: Engine, prompt: str, choices: list[str]) -> list[float]:
    """Each choice's summed log-likelihood from Engine.score, one choice at a time."""
    ids = engine.encode(prompt)
    out = []
    for c in choices:
        cont = engine.choice_ids(prompt, c)
        lp = torch.log_softmax(engine.score(ids, cont), dim=-1)
        out.append(float(lp[torch.arange(len(cont)), torch.tensor(cont)].sum()))
    return out


@pytest.fixture(scope="module")
def embedded_rt(embedded, embedded_profiles):
    torch.set_num_threads(1)
    return Runtime(ModelOptions(model=str(embedded), profiles=str(embedded_profiles),
                                task="navigation", load_ratio=0.7, compute_ratio=0.5))


def test_choose_agrees_with_score_on_the_embedded_model(embedded_rt):
    rt = embedded_rt
    direct = direct_logprobs(rt.engine, NAV_PROMPT, NAV_CHOICES)
    res = rt.choose(NAV_PROMPT, NAV_CHOICES)
    assert res.logprobs == pytest.approx(direct, rel=1e-3, abs=2e-3)
    assert res.index == max(range(len(direct)), key=direct.__getitem__)
    assert res.choice == "goto(library)"  # the model knows this one
    assert res.token_counts[NAV_CHOICES.index("turn(left, 120)")] > 3  # multi-token, shared prefixes
    assert res.logprobs_normalized == pytest.approx(
        [lp / n for lp, n in zip(res.logprobs, res.token_counts)])
    assert res.prompt_tokens == len(rt.engine.encode(NAV_PROMPT))
    assert 0 < res.prefill_seconds < res.seconds
    norm = rt.choose(NAV_PROMPT, NAV_CHOICES, length_normalize=True)
    assert norm.length_normalize and norm.logprobs == pytest.approx(res.logprobs, abs=1e-4)
    assert norm.index == max(range(len(direct)), key=norm.logprobs_normalized.__getitem__)


def test_single_token_choices_cost_one_prefill(embedded_rt):
    res = embedded_rt.choose("The robot should dock to recharge. It drives to the", ["dock", "hall",
                                                                                     "kitchen"])
    assert res.token_counts == [1, 1, 1]
    assert res.choice == "dock"
    assert res.logprobs == pytest.approx(direct_logprobs(
        embedded_rt.engine, "The robot should dock to recharge. It drives to the",
        ["dock", "hall", "kitchen"]), abs=2e-3)


@pytest.fixture(scope="module")
def tiny_engine(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-gemma3"]
    sm = SelectiveModel(packed, tiny_profiles["tiny-gemma3"], "alpha", load_ratio=0.8,
                        static_ratio=0.3, compute_ratio=0.5)
    return Engine.from_selective(sm, context_limit=32)


def test_chunked_rows_and_output_layer_give_the_same_scores(tiny_engine, monkeypatch):
    prompt = "w10 w11 w12 w13"
    choices = ["w5", "w6 w7 w8", "w6 w7 w9", "w9 w10", "w400 w401 w402 w403 w1"]
    whole = tiny_engine.choose(prompt, choices)
    assert whole.logprobs == pytest.approx(direct_logprobs(tiny_engine, prompt, choices), abs=1e-4)
    monkeypatch.setattr(engine_mod, "CHOICE_CACHE_BUDGET", 1)  # one row per forward
    monkeypatch.setattr(engine_mod, "CHOICE_LOGITS_BUDGET", 1)  # one prefix per output-layer call
    split = tiny_engine.choose(prompt, choices)
    assert split.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert split.index == whole.index
    monkeypatch.setattr(engine_mod, "CHOICE_CACHE_BUDGET", 2**30)
    monkeypatch.setattr(engine_mod, "CHOICE_TOKENS_PER_FORWARD", 2)  # rows cut along their length
    segmented = tiny_engine.choose(prompt, choices)
    assert segmented.logprobs == pytest.approx(whole.logprobs, abs=1e-4)


@pytest.mark.parametrize("after", [1, 2, 5, 9])
def test_cancel_inside_scoring_raises_canceled(tiny_engine, monkeypatch, after):
    """Cancel is polled in the prompt's prefill (per layer), between scoring forwards and between
    output-layer chunks: the request stops wherever it is."""
    monkeypatch.setattr(engine_mod, "CHOICE_TOKENS_PER_FORWARD", 2)
    monkeypatch.setattr(engine_mod, "CHOICE_LOGITS_BUDGET", 1)
    polls = []
    with pytest.raises(Canceled):
        tiny_engine.choose("w10 w11", ["w5 w6 w7 w8", "w6 w7", "w9 w9 w9"],
                           cancel=lambda: polls.append(1) or len(polls) > after)
    assert len(polls) == after + 1  # stopped at the first poll that said so
    assert tiny_engine.state.prefill
    assert tiny_engine.choose("w10 w11", ["w5", "w6"]).index in (0, 1)  # next request is fine


@pytest.mark.parametrize("choices, reason", [
    ([], "no choices given"),
    ([f"w{i}" for i in range(MAX_CHOICES + 1)], f"at most {MAX_CHOICES}"),
    (["w5", ""], "choice 1 is empty"),
    (["w5", "  "], "choice 1 is empty"),
    (["w5", "w6", "w5"], "choice 2 'w5' repeats choice 0"),
    (["w5", " ".join(["w7"] * 40)], "choice 1 has"),
])
def test_invalid_choices_are_refused_with_the_reason(tiny_engine, choices, reason):
    with pytest.raises(ValueError, match=reason):
        validate_choices(choices, tiny_engine, prompt_tokens=5)
    with pytest.raises(ValueError, match=reason):
        tiny_engine.choose("w10 w11 w12 w13", choices)


def test_choice_that_fits_only_without_the_prompt_is_refused(tiny_engine):
    choice = " ".join(["w7"] * 20)  # 20 tokens: fits 32, not after a 16-token prompt
    validate_choices([choice], tiny_engine, prompt_tokens=5)
    with pytest.raises(ValueError, match="after the prompt's 16 tokens"):
        validate_choices([choice], tiny_engine, prompt_tokens=16)


def test_cancel_before_scoring_raises_canceled(tiny_engine):
    with pytest.raises(Canceled):
        tiny_engine.choose("w10 w11", ["w5", "w6 w7"], cancel=lambda: True)
    assert tiny_engine.state.prefill  # the selection state is reset for the next request


def test_cli_choices_prints_the_choice_and_json(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-llama"]
    out = subprocess.run(
        [sys.executable, "-m", "selectinfer_ros.cli", "generate", "--model", str(packed),
         "--profiles", str(tiny_profiles["tiny-llama"]), "--task", "alpha", "--load-ratio", "0.7",
         "--compute-ratio", "0.5", "--json", "--choices", "w5, w6 w7,w8", "w10 w11 w12"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["choices"] == ["w5", "w6 w7", "w8"]
    assert res["text"] == res["choices"][res["choice_index"]]
    assert len(res["choice_logprobs"]) == 3 and max(res["choice_logprobs"]) < 0
    bad = subprocess.run(
        [sys.executable, "-m", "selectinfer_ros.cli", "generate", "--model", str(packed),
         "--dense", "--choices", "w5,,w6", "w10"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "choice 1 is empty" in bad.stderr


def test_free_text_parser_and_eval_rows(tiny_models, tmp_path):
    from selectinfer_ros.lab.choice_eval import DATA, parse_option, read_items, run_config, summarize
    opts = ["goto(library)", "pick(pen)", "dock()"]
    assert parse_option(" goto(library)\nInstruction:", opts) == "goto(library)"
    assert parse_option(" I would dock() now, then pick(pen).", opts) == "dock()"
    assert parse_option(" go(library)", opts) is None
    items = read_items(DATA)
    assert len(items) >= 40 and all(it["answer"] in it["options"] for it in items)
    assert {it["task"] for it in items} == {"navigation", "scene"}
    _, packed = tiny_models["tiny-llama"]
    rt = Runtime(ModelOptions(model=str(packed)), dense=True)
    few = [{"prompt": "w5 w6", "options": ["w7", "w8 w9"], "answer": "w7"},
           {"prompt": "w10 w11", "options": ["w12", "w13", "w14", "w15"], "answer": "w15"}]
    rows = run_config(rt, few, max_new_tokens=3, dense=True)
    assert [r["choice"] in it["options"] for r, it in zip(rows, few)] == [True, True]
    s = summarize(few, rows, rows)
    assert s["agreement_with_dense"] == 1.0 and s["items"] == 2
    assert s["choice_accuracy"] == sum(r["choice"] == it["answer"] for r, it in zip(rows, few)) / 2
