"""Selective model versus the unmodified transformers model: exactness and masking equivalence."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from selectinfer_ros.core.selection.loader import SelectiveModel, load_dense

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")


def _masked_dense(packed):
    """Dense model whose FFN neurons can be masked per layer (mask multiplies the down_proj input)."""
    model, _ = load_dense(packed)
    masks: list[torch.Tensor | None] = [None] * len(model.model.layers)

    def hook(layer):
        def pre(_m, args):
            return (args[0] * masks[layer],) if masks[layer] is not None else None
        return pre

    for i, blk in enumerate(model.model.layers):
        blk.mlp.down_proj.register_forward_pre_hook(hook(i))
    return model, masks


def _mask(ids: torch.Tensor, size: int) -> torch.Tensor:
    m = torch.zeros(size)
    m[ids] = 1.0
    return m


@pytest.mark.parametrize("family", FAMILIES)
def test_full_ratio_matches_transformers(tiny_models, family):
    hf, packed = tiny_models[family]
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    sm = SelectiveModel(packed, load_ratio=1.0)
    ids = torch.randint(4, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(sm.model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_embedded_model_full_ratio_matches_transformers(embedded):
    from selectinfer_ros.core.format.default_model import hf_dir
    ref = AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=torch.float32).eval()
    sm = SelectiveModel(embedded, load_ratio=1.0)
    ids = sm.tokenizer("A robot arm picks up the red cube and", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = sm.model(ids).logits, ref(ids).logits
    torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert torch.equal(a[0, -1].argmax(), b[0, -1].argmax())


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_only_equals_zeroed_dense(tiny_models, tiny_profiles, family):
    _, packed = tiny_models[family]
    sm = SelectiveModel(packed, tiny_profiles[family], "alpha", load_ratio=0.6, static_ratio=0.3)
    dense, masks = _masked_dense(packed)
    inter = sm.manifest.intermediate_size
    for layer, ids in enumerate(sm.loaded_neuron_ids()):
        assert len(ids) == round(0.6 * inter)
        masks[layer] = _mask(ids, inter)
    ids = torch.randint(4, 500, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(sm.model(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_selective_compute_equals_masking_chosen_neurons(tiny_models, tiny_profiles, family):
    """Prefill computes the loaded set; decode exactly the static + dynamic neurons chosen."""
    _, packed = tiny_models[family]
    sm = SelectiveModel(packed, tiny_profiles[family], "beta", load_ratio=0.7, static_ratio=0.2,
                        compute_ratio=0.45)
    dense, masks = _masked_dense(packed)
    inter = sm.manifest.intermediate_size
    loaded = [_mask(ids, inter) for ids in sm.loaded_neuron_ids()]
    base = [ids[:n].clone() for ids, n in zip(sm.loaded_neuron_ids(), [m.n_static for m in sm.mlps])]
    prompt = torch.randint(4, 500, (1, 19), generator=torch.Generator().manual_seed(2))
    cs, cd = DynamicCache(config=sm.model.config), DynamicCache(config=dense.config)
    with torch.no_grad():
        sm.state.prefill, sm.state.token_weight = True, None
        ls = sm.model(prompt, past_key_values=cs, use_cache=True).logits
        masks[:] = loaded
        ld = dense(prompt, past_key_values=cd, use_cache=True).logits
        torch.testing.assert_close(ls, ld, atol=1e-5, rtol=1e-5)
        sm.state.prefill = False
        active = sm.active_neuron_ids()
        for layer, ids in enumerate(active):
            assert len(ids) == round(0.45 * inter)
            assert set(base[layer].tolist()) <= set(ids.tolist())  # static neurons always computed
            assert set(ids.tolist()) <= set(sm.loaded_neuron_ids()[layer].tolist())
        masks[:] = [_mask(ids, inter) for ids in active]
        tok = ls[:, -1:].argmax(-1)
        for _ in range(4):
            ls = sm.model(tok, past_key_values=cs, use_cache=True).logits
            ld = dense(tok, past_key_values=cd, use_cache=True).logits
            torch.testing.assert_close(ls, ld, atol=1e-5, rtol=1e-5)
            tok = ls[:, -1:].argmax(-1)


def test_swap_keeps_loaded_set_and_buffers_consistent(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-llama"]
    sm = SelectiveModel(packed, tiny_profiles["tiny-llama"], "alpha", load_ratio=0.8,
                        static_ratio=0.1, compute_ratio=0.3)
    dense, _ = load_dense(packed)
    before = [set(ids.tolist()) for ids in sm.loaded_neuron_ids()]
    for seed in range(3):  # several requests: each selection permutes slots in place
        with torch.no_grad():
            sm.state.prefill = True
            sm.model(torch.randint(4, 500, (1, 15), generator=torch.Generator().manual_seed(seed)))
    for layer, mlp in enumerate(sm.mlps):
        assert set(mlp.slot_ids.tolist()) == before[layer]
        ref = dense.model.layers[layer].mlp
        torch.testing.assert_close(mlp.gu[:, 0], ref.gate_proj.weight[mlp.slot_ids])
        torch.testing.assert_close(mlp.gu[:, 1], ref.up_proj.weight[mlp.slot_ids])
        torch.testing.assert_close(mlp.down, ref.down_proj.weight[:, mlp.slot_ids])


def test_griffin_style_selection_runs_and_keeps_static(tiny_models, tiny_profiles):
    _, packed = tiny_models["tiny-qwen2"]
    sm = SelectiveModel(packed, tiny_profiles["tiny-qwen2"], "alpha", load_ratio=0.8,
                        static_ratio=0.2, compute_ratio=0.5)
    base = [ids[: m.n_static].clone() for ids, m in zip(sm.loaded_neuron_ids(), sm.mlps)]
    sm.state.method = "norm"
    with torch.no_grad():
        sm.model(torch.randint(4, 500, (1, 12)))
    for layer, ids in enumerate(sm.active_neuron_ids()):
        assert set(base[layer].tolist()) <= set(ids.tolist())


def test_profiled_choice_beats_random_at_half_loading(embedded, embedded_profiles):
    """The method's central claim on the real model: profiled neurons >> random neurons."""
    from selectinfer_ros.core.execution.engine import Engine
    from selectinfer_ros.core.format.paths import DATA_DIR
    from selectinfer_ros.core.profiling.profiler import read_jsonl
    texts = [r["text"] for r in read_jsonl(DATA_DIR / "eval" / "prose.jsonl")[:6]]
    dense, _ = load_dense(embedded)

    def agreement(sm) -> float:
        eng, ref = Engine.from_selective(sm), Engine(dense, sm.tokenizer)
        hit = total = 0
        for t in texts:
            ids = sm.tokenizer(t)["input_ids"]
            prefix, cont = ids[: len(ids) // 2], ids[len(ids) // 2:]
            a, b = eng.score(prefix, cont).argmax(-1), ref.score(prefix, cont).argmax(-1)
            hit, total = hit + int((a == b).sum()), total + len(cont)
        return hit / total

    profiled = agreement(SelectiveModel(embedded, embedded_profiles, "summarization", load_ratio=0.5))
    random = agreement(SelectiveModel(embedded, embedded_profiles, "summarization", load_ratio=0.5,
                                      selection="random"))
    assert profiled > random + 0.2, (profiled, random)
