"""The lean decoder against the transformers forward of the same weights."""
from __future__ import annotations

import ctypes

import pytest
import torch
from transformers import AutoModelForCausalLM

from selectinfer_ros.core.execution.decode import Decoder, native_unsupported, unsupported
from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
from selectinfer_ros.core.selection import token_rule
from selectinfer_ros.core.selection.loader import SelectiveModel, load_dense
from selectinfer_ros.core.format.pack import pack
from selectinfer_ros.core.format import int8, q4
from selectinfer_ros.lab.random_model import make_random_model

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")


def _teacher_forced(dec: Decoder, ids: list[int], n_prompt: int) -> torch.Tensor:
    """Logits after every position from ``n_prompt - 1`` on: prefill, then one token at a time."""
    out = [dec.prefill(ids[:n_prompt], extra=len(ids) - n_prompt)]
    out += [dec.decode_one_token(t) for t in ids[n_prompt:]]
    return torch.stack(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(tiny_models, family):
    hf, _ = tiny_models[family]
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.randint(4, 500, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    n_prompt = 11  # longer than tiny-gemma3's sliding window (8), and so is the whole sequence
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, n_prompt - 1:]
    got = _teacher_forced(Decoder(ref), ids, n_prompt)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cache_is_reused_across_requests(tiny_models):
    hf, _ = tiny_models["tiny-gemma3"]
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    dec = Decoder(ref)
    first = _teacher_forced(dec, list(range(5, 25)), 6)
    ptr, cap = dec.k_cache[0].data_ptr(), dec.capacity
    again = _teacher_forced(dec, list(range(5, 25)), 6)  # a second request of the same size
    assert dec.k_cache[0].data_ptr() == ptr and dec.capacity == cap
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="KV cache full"):
        dec.prefill([5, 6, 7], extra=0)
        for _ in range(cap):
            dec.decode_one_token(8)


@pytest.mark.parametrize("family", FAMILIES)
def test_selective_generation_equals_transformers_path(tiny_models, tiny_profiles, family):
    """phi < gamma: selection at prefill and decode on the active prefix, both paths alike."""
    _, packed = tiny_models[family]
    sm = SelectiveModel(packed, tiny_profiles[family], "alpha", load_ratio=0.7, static_ratio=0.3,
                        compute_ratio=0.5)
    lean, slow = Engine.from_selective(sm), Engine(sm.model, sm.tokenizer, sm, lean=False)
    assert lean.decode_path.startswith("lean decoder") and slow.decode_path.startswith("transformers")
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompt = torch.randint(4, 500, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    a = lean.generate(prompt, cfg)
    active = [ids.clone() for ids in sm.active_neuron_ids()]
    b = slow.generate(prompt, cfg)
    assert a.token_ids == b.token_ids
    assert all(torch.equal(x.sort().values, y.sort().values)
               for x, y in zip(active, sm.active_neuron_ids()))


def test_int8_records_equal_transformers_path(tiny_models, tiny_profiles, tmp_path):
    hf, _ = tiny_models["tiny-gemma3"]
    packed = pack(hf, tmp_path / "int8", weights="int8", log=lambda s: None).path
    model, _ = load_dense(packed)
    ids = torch.randint(4, 500, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, 9:]
    got = _teacher_forced(Decoder(model), ids, 10)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_embedded_model_greedy_equals_transformers_path(embedded):
    model, _ = load_dense(embedded)
    from selectinfer_ros.core.format.tokenizer import load_tokenizer
    tok = load_tokenizer(embedded)
    cfg = GenerationConfig(max_new_tokens=16)
    prompt = "Question: What is the capital of France?\nAnswer:"
    a = Engine(model, tok).generate(prompt, cfg)
    b = Engine(model, tok, lean=False).generate(prompt, cfg)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_unsupported_models_fall_back(tiny_models):
    hf, _ = tiny_models["tiny-llama"]
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert unsupported(ref) is None
    ref.config.model_type = "mistral"
    assert "model type 'mistral'" in unsupported(ref)
    with pytest.raises(ValueError, match="does not run this model"):
        Decoder(ref)


@torch.inference_mode()
def _kernel_vs_torch_ops(sm: SelectiveModel, ids: list[int], n_prompt: int):
    """Per decode step from the same cache: (max |kernel - torch ops| / std of the logits, top-1
    equal). The torch-ops decoder fills the cache; the kernel then redoes each step from a copy of
    it (the kernel's own cache entries differ in the last bits, which later steps would amplify)."""
    e = Engine.from_selective(sm)
    d, native = e.decoder, e.decoder.native
    assert d.path == "int8 decode kernel"
    d.native = None
    e._start(torch.tensor([ids[:n_prompt]]))
    d.prefill(ids[:n_prompt], extra=len(ids) - n_prompt)
    e._end_prefill()
    want = [d.decode_one_token(t) for t in ids[n_prompt:]]
    cache = [c.clone() for c in d.k_cache + d.v_cache]
    d.native, native.stale = native, True
    diffs, same = [], []
    for p, (t, w) in enumerate(zip(ids[n_prompt:], want), start=n_prompt):
        for c, saved in zip(d.k_cache + d.v_cache, cache):
            c.copy_(saved)
        d.pos = p
        got = d.decode_one_token(t)
        diffs.append(float((got - w).abs().max() / w.std()))
        same.append(int(got.argmax()) == int(w.argmax()))
    return sorted(diffs), sum(same) / len(same)


@pytest.mark.parametrize("weights", ["int8", "int8-q4emb"])
def test_int8_decode_kernel_equals_torch_ops(tiny_models, tiny_profiles, tmp_path, weights):
    """The one-call int8 decode step against the same decoder on torch ops, with selection
    (phi < gamma); int8-q4emb: with the embedding / output layer as 4-bit rows (Gemma: tied,
    Llama: a separate output layer). The two agree up to the noise of the int8 activation
    quantization: a last-bit difference of a float (C's exp/tanh, summation order) can move an
    activation across a rounding step, which moves the logits of that step. So: most steps
    equal to float rounding, the others within int8 noise."""
    ids = torch.randint(4, 500, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    for family in ("tiny-llama", "tiny-gemma3"):
        hf, _ = tiny_models[family]
        packed = pack(hf, tmp_path / family, weights=weights, log=lambda s: None).path
        sm = SelectiveModel(packed, tiny_profiles[family], "alpha", load_ratio=0.7,
                            static_ratio=0.3, compute_ratio=0.5)
        diffs, top1 = _kernel_vs_torch_ops(sm, ids, 10)
        assert diffs[len(diffs) // 2] < 1e-5 and diffs[-1] < 0.2, (family, diffs)


def test_embedded_int8_kernel_equals_torch_ops(embedded, embedded_profiles):
    """On the embedded model, teacher-forced on its own greedy continuation: a deeper model
    meets more rounding steps (3 to 10 of 24 steps equal to float rounding, depending on the
    continuation), so the bound is on the spread and the top token."""
    from selectinfer_ros.lab.bench import pack_of
    sm = SelectiveModel(pack_of(embedded, "int8", lambda s: None), embedded_profiles, "qa",
                        load_ratio=0.7, static_ratio=0.3, compute_ratio=0.5)
    prompt = sm.tokenizer("Question: Which planet is known as the red planet?\nAnswer:")["input_ids"]
    cont = Engine.from_selective(sm).generate(prompt, GenerationConfig(max_new_tokens=24,
                                                                       ignore_eos=True)).token_ids
    diffs, top1 = _kernel_vs_torch_ops(sm, prompt + cont, len(prompt))
    assert diffs[len(diffs) // 2] < 0.2 and top1 >= 0.9, (diffs, top1)


def _q8(x: torch.Tensor) -> torch.Tensor:
    """The kernel's quantization of activations, in torch: per block of 32, ``d = amax / 127``,
    ``q = rint(x * (1 / d))``; returns ``q * d``."""
    K = x.shape[-1]
    b = x.float().reshape(-1, K // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape).to(x.dtype)


def _dense_q4_reference(packed, sm):
    """The dense model of a q4 pack over its dequantized weights (transformers forward); the
    gate and up products see the activations as the kernel quantizes them (the int8 or 4-bit
    attention and output rows run the kernel's products) and the down product is the kernel's
    (``q4.down_reference``) over the records of ``sm``'s slots, in their order."""
    model, _ = load_dense(packed)
    H = model.config.hidden_size
    for blk, mlp in zip(model.model.layers, sm.mlps):
        for lin in (blk.mlp.gate_proj, blk.mlp.up_proj):
            lin.register_forward_pre_hook(lambda m, args: (_q8(args[0]),))
        order = mlp.slot_ids  # slot i holds neuron order[i]

        def down(m, args, out, rec=mlp.slots.records(), order=order):
            a = args[0][..., order]
            y = q4.down_reference(a.reshape(-1, a.shape[-1]), *q4.record_parts(rec, H, 2))
            return y.view(*a.shape[:-1], H).to(out.dtype)
        blk.mlp.down_proj.register_forward_hook(down)
    return model


def _layer_by_layer(ref, model, ids: list[int]) -> list[float]:
    """Teacher-forced: every decoder layer of ``model`` and its final norm run on the input the
    same module of ``ref`` got, so that an 8-bit rounding step that a last-bit difference moves
    on one side stays in its layer and position (unforced, one moved in the k or v of an early
    position reaches every later position through attention, whatever the instruction set's
    summation order). Sorted, per layer output and position, then per position of the logits:
    max |model - ref| / std(ref)."""
    def stages(m):
        return [*m.model.layers, m.model.norm]

    def first(t):
        return t[0] if isinstance(t, tuple) else t
    seen = []
    hooks = [s.register_forward_hook(lambda m, args, out: seen.append((args[0], first(out))))
             for s in stages(ref)]
    want = ref(torch.tensor([ids])).logits
    for h in hooks:
        h.remove()
    got, hooks = [], []
    for s, (x, _) in zip(stages(model), seen):
        hooks.append(s.register_forward_pre_hook(lambda m, args, x=x: (x, *args[1:])))
        hooks.append(s.register_forward_hook(lambda m, args, out: got.append(first(out))))
    got.append(model(torch.tensor([ids])).logits)  # after the stages' outputs
    for h in hooks:
        h.remove()
    pairs = list(zip(got[:-2], [out for _, out in seen[:-1]])) + [(got[-1], want)]  # no norm
    return sorted(float(r) for g, w in pairs for r in ((g - w).abs().amax(-1) / w.std()).flatten())


@pytest.mark.parametrize("family,weights", [("tiny-llama", "q4-all"), ("tiny-gemma3", "q4"),
                                            ("tiny-gemma3", "q4-all")])
def test_q4_records_selective_and_decode_kernel_equal_dense_q4(tiny_models, tmp_path, family,
                                                               weights):
    """4-bit records: SelectiveModel at gamma = phi = 1 (torch ops: the records' gate/up and down
    products read in place) equals the dense q4 model over the dequantized weights to float
    rounding, layer by layer (teacher-forced), and so does the decode kernel step by step (int8
    or, q4-all, 4-bit attention)."""
    hf, _ = tiny_models[family]
    packed = pack(hf, tmp_path / "q4", weights=weights, log=lambda s: None).path
    ids = torch.randint(4, 500, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        sm = SelectiveModel(packed, load_ratio=1.0)
        rel = _layer_by_layer(_dense_q4_reference(packed, sm), sm.model, ids)
    # a last-bit difference can move one 8-bit activation across a rounding step (in one layer
    # and position)
    assert rel[len(rel) // 2] < 1e-5 and rel[-1] < 0.05, rel
    # the decode kernel, step by step from the torch-ops decoder's cache (which equals the
    # transformers forward): a last-bit difference can move one activation across an 8-bit
    # rounding step, so most steps equal to float rounding, the others within that noise
    diffs, top1 = _kernel_vs_torch_ops(sm, ids, 10)
    assert diffs[len(diffs) // 2] < 1e-5 and diffs[-1] < 0.2 and top1 >= 0.9, (family, diffs)


@pytest.fixture(scope="module")
def biased_qwen2(tmp_path_factory):
    """A tiny Qwen2 checkpoint whose q/k/v projection biases are large and random (the shared
    fixture's are zero, as transformers initialises them)."""
    return make_random_model("tiny-qwen2", tmp_path_factory.mktemp("qwen2-bias") / "hf", std=0.1,
                             bias_std=0.5)


@pytest.mark.parametrize("weights", ["int8", "q4-all"])
def test_qwen2_attention_biases_on_quantized_packs_and_in_the_decode_kernel(biased_qwen2,
                                                                           tmp_path, weights):
    """Qwen2's q/k/v biases stay float in an int8 / 4-bit pack, load into the quantized
    projections under their names, matter (the model follows the float one far better than
    the float one without biases does), and the decode kernel adds them: its step equals the
    torch-ops step to float rounding (as for Llama / Gemma above)."""
    from safetensors.torch import load_file
    packed = pack(biased_qwen2, tmp_path / weights, weights=weights, log=lambda s: None).path
    sm = SelectiveModel(packed, load_ratio=1.0)
    src = load_file(str(biased_qwen2 / "model.safetensors"))
    cls = q4.Q4Linear if weights == "q4-all" else int8.Int8Linear
    for i, blk in enumerate(sm.model.model.layers):
        att = blk.self_attn
        assert all(isinstance(m, cls) for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj))
        for name in ("q_proj", "k_proj", "v_proj"):
            b = getattr(att, name).bias
            want = src[f"model.layers.{i}.self_attn.{name}.bias"]
            assert b.dtype == torch.float32 and torch.equal(b, want) and float(want.abs().max()) > 0.5
        assert att.o_proj.bias is None
    ids = torch.randint(4, 500, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = AutoModelForCausalLM.from_pretrained(biased_qwen2, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        got = sm.model(torch.tensor([ids])).logits[0]
        for blk in ref.model.layers:
            for m in (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj):
                m.bias.zero_()
        unbiased = ref(torch.tensor([ids])).logits[0]
    err = float((got - want).abs().max() / want.std())
    assert err < 0.5 * float((unbiased - want).abs().max() / want.std()), err
    e = Engine.from_selective(sm)
    assert native_unsupported(e.decoder) is None and e.decoder.path == "int8 decode kernel"
    diffs, top1 = _kernel_vs_torch_ops(sm, ids, 10)
    assert diffs[len(diffs) // 2] < 1e-5 and diffs[-1] < 0.2 and top1 >= 0.9, (weights, diffs)


# -- per-token selection (compute_mode "token") in the decode kernel ---------------------------
TOKEN_PACKS = [("tiny-llama", "int8"), ("tiny-gemma3", "int8"), ("tiny-llama", "q4-all"),
               ("tiny-gemma3", "q4")]


@pytest.fixture(scope="module")
def token_packs(tiny_models, tmp_path_factory):
    """Per (family, weights): the pack, and per-token threshold tables ``(gate, act)`` ``[L,
    SHARES]`` calibrated (:class:`token_rule.Calibration`) on the dense model's ``|act(gate)|``
    and ``|act(gate) * up|`` over random tokens."""
    root = tmp_path_factory.mktemp("token")
    ids = torch.randint(4, 500, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    out = {}
    for family, weights in TOKEN_PACKS:
        hf, _ = tiny_models[family]
        packed = pack(hf, root / f"{family}-{weights}", weights=weights, log=lambda s: None).path
        model, _ = load_dense(packed)
        cal = token_rule.Calibration(model.config.num_hidden_layers)
        gates = {}
        for i, blk in enumerate(model.model.layers):
            blk.mlp.gate_proj.register_forward_hook(
                lambda m, args, y, i=i, f=blk.mlp.act_fn: gates.__setitem__(i, f(y)))
            blk.mlp.down_proj.register_forward_pre_hook(
                lambda m, args, i=i: cal.add(i, gates.pop(i)[0], args[0][0]))
        with torch.no_grad():
            model(torch.tensor([ids]))
        out[family, weights] = packed, cal.tables()
    return out


def _token_model(token_packs, monkeypatch, family: str, weights: str,
                 share: float) -> SelectiveModel:
    """The pack loaded whole in per-token mode, computing about ``share`` of the neurons per token
    (thresholds from the fixture's tables; the loader wants them from a profile)."""
    packed, tables = token_packs[family, weights]
    monkeypatch.setattr(SelectiveModel, "_token_tables", lambda self, task: tables)
    sm = SelectiveModel(packed, load_ratio=1.0, static_ratio=0.0, compute_ratio=share,
                        compute_mode="token")
    assert sm.state.per_token and all(m.n_active == m.n_loaded for m in sm.mlps)
    assert all((m.gate_thr > 0) == (share < 1) for m in sm.mlps)
    assert all(m.token_layout == (m.rec is None) for m in sm.mlps)  # int8: gate/up planar, down neuron-major
    return sm


def _torch_layer(d: Decoder, i: int, x: torch.Tensor, p: int) -> torch.Tensor:
    """Decoder layer ``i`` on torch ops, as :meth:`Decoder._layers` runs it."""
    l = d.layers[i]
    a = d._attention(l, i, l.input_norm(x), p)
    if l.post_attn_norm is not None:
        a = l.post_attn_norm(a)
    x = x + a
    m = l.mlp(l.pre_mlp_norm(x))
    if l.post_mlp_norm is not None:
        m = l.post_mlp_norm(m)
    return x + m


@torch.inference_mode()
def _decode_layer_by_layer(sm: SelectiveModel, ids: list[int], n_prompt: int):
    """Teacher-forced decode steps after a prefill, every layer of the kernel (one layer a call)
    on the input and cache the torch-ops layer got: sorted max |kernel - torch| / std(torch) per
    step and layer, and the neurons kept and the candidates (up row read) per step and layer
    ``[2, steps, L]`` (kept, candidates) by kernel and torch."""
    e = Engine.from_selective(sm)
    d, native = e.decoder, e.decoder.native
    assert d.path == "int8 decode kernel"
    d.native = None
    e._start(torch.tensor([ids[:n_prompt]]))
    d.prefill(ids[:n_prompt], extra=len(ids) - n_prompt)
    e._end_prefill()
    native.stale = True
    st = sm.state

    def counts() -> torch.Tensor:  # [2, L]: kept, candidates so far
        return torch.stack([st.kept.clone(), st.candidates.clone()])

    rel, by_kernel, by_torch = [], [], []
    for p, t in enumerate(ids[n_prompt:], start=n_prompt):
        d._step[0, 0] = t
        x = d.embed(d._step)
        for i in range(len(d.layers)):
            saved = d.k_cache[i].clone(), d.v_cache[i].clone()
            native._prepare()
            got, before = x.clone().contiguous(), counts()
            pos, off = torch.tensor([p]), torch.tensor([0])
            assert native.fn(ctypes.byref(native.model), ctypes.byref(native.layers[i]), 1,
                             got.data_ptr(), 1, pos.data_ptr(), off.data_ptr(),
                             torch.get_num_threads(), None) == 0
            by_kernel.append((counts() - before)[:, i])
            d.k_cache[i].copy_(saved[0])
            d.v_cache[i].copy_(saved[1])
            before = counts()
            want = _torch_layer(d, i, x, p)
            by_torch.append((counts() - before)[:, i])
            rel.append(float((got - want).abs().max() / want.std()))
            x = want
    L = len(d.layers)
    return (sorted(rel), torch.stack(by_kernel, 1).view(2, -1, L),
            torch.stack(by_torch, 1).view(2, -1, L))


def _compacted_records_down(real):
    """``q4.records_down`` over the kept neurons only (the nonzero activations of each row, in
    slot order), as the kernel reads them: its integer down product quantizes the coefficients
    per group of 32 neurons of the list, which the torch path (zeroed neurons in place) groups
    otherwise."""
    def down(a: torch.Tensor, rec: torch.Tensor, hidden: int) -> torch.Tensor:
        rows = [real(r[i][None], rec[i], hidden)[0] if (i := r.nonzero().flatten()).numel()
                else r.new_zeros(hidden) for r in a.reshape(-1, a.shape[-1])]
        return torch.stack(rows).view(*a.shape[:-1], hidden)
    return down


@pytest.mark.parametrize("family,weights,share", [(f, w, 0.5) for f, w in TOKEN_PACKS] +
                         [(f, w, 0.25) for f, w in TOKEN_PACKS if w == "int8"])
def test_token_selection_in_the_decode_kernel_equals_torch_ops(token_packs, monkeypatch, family,
                                                               weights, share):
    """compute_mode token, about ``share`` of the neurons per token (0.5: candidates more than half
    of the rows, the int8 kernel streams every up row; 0.25, int8: it reads the candidates' up
    rows where they lie): every decode layer of the kernel
    equals the torch-ops layer (SelectiveMLP in token mode) from the same input, to float
    rounding at most steps and within int8 noise at the others (as the prompt-mode tests above),
    and keeps the same neurons and counts the same candidates (up row read), up to the few that
    an int8 rounding step moves across a threshold. 4-bit: against the torch path whose down
    product takes the kept neurons as the kernel groups them; the torch path as it is differs by
    that grouping (the coefficients' 8-bit noise) only."""
    sm = _token_model(token_packs, monkeypatch, family, weights, share)
    ids = torch.randint(4, 500, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    if weights.startswith("q4"):
        rel, _, _ = _decode_layer_by_layer(sm, ids, 10)
        assert rel[len(rel) // 2] < 0.05 and rel[-1] < 0.2, rel
        monkeypatch.setattr(q4, "records_down", _compacted_records_down(q4.records_down))
    rel, by_kernel, by_torch = _decode_layer_by_layer(sm, ids, 10)
    assert rel[len(rel) // 2] < 1e-5 and rel[-1] < 0.2, (family, weights, rel)
    n = sm.mlps[0].n_loaded
    kept, cand = by_torch
    assert 0.6 * share * n < float(kept.float().mean()) < 1.4 * share * n, kept
    assert (cand >= kept).all() and int(cand.sum()) > int(kept.sum()) and (cand < n).any(), \
        (cand, kept)
    for what, got, want in zip(("kept", "candidates"), by_kernel, by_torch):
        diff = (got - want).abs()
        assert int(diff.max()) <= 4 and int(diff.sum()) <= 0.01 * int(want.sum()), (what, got,
                                                                                     want)


@pytest.mark.parametrize("family,weights", TOKEN_PACKS)
def test_token_selection_with_thresholds_0_equals_every_loaded_neuron(token_packs, monkeypatch,
                                                                      family, weights):
    """Thresholds 0 (share 1): the kernel's token path computes every loaded neuron, as the
    prompt mode at gamma = phi = 1 does: 4-bit identically (the same records and products; the
    prompt mode's records held as rows here, not in groups), int8 to the noise of the prompt mode's int8 activations into the down projection (token
    mode sums it in float); every neuron is counted as kept and as a candidate, and every decode
    token. The thresholds follow set_compute_ratio within a request (no prefill between)."""
    ids = torch.randint(4, 500, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = {}
    for mode in ("prompt", "token"):
        if mode == "token":
            sm = _token_model(token_packs, monkeypatch, family, weights, 1.0)
        else:
            with monkeypatch.context() as mp:
                mp.setattr(q4, "groups_pay", lambda device: False)
                sm = SelectiveModel(token_packs[family, weights][0], load_ratio=1.0)
        e = Engine.from_selective(sm)
        assert e.decoder.path == "int8 decode kernel"
        with torch.inference_mode():
            e._start(torch.tensor([ids[:10]]))
            out = [e.decoder.prefill(ids[:10], extra=len(ids) - 8)]  # 2 more tokens below
            e._end_prefill()
            out += [e.decoder.decode_one_token(t) for t in ids[10:]]
        logits[mode] = torch.stack(out)
    got, want = logits["token"], logits["prompt"]
    if weights.startswith("q4"):
        assert torch.equal(got, want)
    else:
        rel = (got - want).abs().amax(-1) / want.std(-1)
        same = (got.argmax(-1) == want.argmax(-1)).float().mean()
        assert float(rel.max()) < 0.2 and float(same) >= 0.9, (rel, same)
    steps, n = len(ids) - 10, sm.mlps[0].n_loaded
    st = sm.state
    assert st.decoded == steps and st.kept.tolist() == [steps * n] * len(sm.mlps)
    assert st.candidates.tolist() == [steps * n] * len(sm.mlps)
    # half the neurons from the next token on, without a prefill in between, then all again
    d = e.decoder
    with torch.inference_mode():
        for share in (0.5, 1.0):
            sm.set_compute_ratio(share)
            assert not d.native.stale  # the kernel's structures follow the thresholds anyway
            before, cand_before = st.kept.clone(), st.candidates.clone()
            d.decode_one_token(ids[-1])
            step, cand = st.kept - before, st.candidates - cand_before
            assert (step < 0.8 * n).all() if share < 1 else (step == n).all(), (share, step)
            assert (cand >= step).all() and ((cand < n).any() if share < 1 else
                                             (cand == n).all()), (share, cand, step)
    assert st.decoded == steps + 2


def _batch_vs_alone(d: Decoder, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Rows of ``decode_batch`` against each slot stepped alone, ``steps`` tokens teacher-forced
    from prompts of different lengths (so the rows sit at different positions): the largest
    difference of the logits and of the rows' last hidden state is what it returns, as
    (max |logit diff|, the same relative to the logits' spread)."""
    B = len(prompts)
    d.reserve(max(map(len, prompts)) + steps + 1, B)
    for s, p in enumerate(prompts):
        d.prefill(p, extra=steps, slot=s)
    start = list(d.lengths[:B])
    g = torch.Generator().manual_seed(11)
    toks = torch.randint(4, 500, (steps, B), generator=g).tolist()
    alone = []
    for t in toks:  # every slot alone, one token each
        alone.append(torch.stack([d.decode_batch([t[s]], [s])[0] for s in range(B)]))
    d.lengths[:B] = start  # the batch writes the same cache positions again
    together = torch.stack([d.decode_batch(t, list(range(B))) for t in toks])
    diff = float((together - torch.stack(alone)).abs().max())
    return diff, diff / float(torch.stack(alone).std())


@pytest.mark.parametrize("family,weights", [("tiny-llama", "int8"), ("tiny-gemma3", "int8-q4emb"),
                                            ("tiny-qwen2", "q4-all"), ("tiny-llama", "float")])
def test_a_batch_step_equals_each_row_stepped_alone(tiny_models, tmp_path, family, weights):
    """decode_batch: each row at its own position in its own KV slot, one pass over the weights;
    with 3 rows every row's logits equal its slot stepped alone exactly (the kernel runs each
    row's products and attention as a step alone does; the output layer takes the row path for
    fewer than 4 rows); with 5 rows (the output layer's blocked product) to float rounding. The
    torch path (float weights) batches the projections and MLP as one matrix product: float
    rounding."""
    hf, float_pack = tiny_models[family]
    packed = float_pack if weights == "float" else pack(hf, tmp_path / weights, weights=weights,
                                                        log=lambda s: None).path
    sm = SelectiveModel(packed, load_ratio=1.0)
    d = Engine.from_selective(sm).decoder
    assert (d.native is not None) == (weights != "float"), d.path
    sm.state.prefill = False
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (5, 9, 2, 12, 7)]
    exact, _ = _batch_vs_alone(d, prompts[:3], 6)
    assert exact == 0.0 if weights != "float" else exact < 1e-4, exact
    _, rel = _batch_vs_alone(d, prompts, 6)
    assert rel < 1e-5, rel


def test_growing_the_slots_keeps_what_the_caches_hold(tiny_models):
    """A request that joins a running batch may grow the caches (more slots, a longer context):
    the running slots' keys and values survive, so their next tokens are unchanged."""
    _, packed = tiny_models["tiny-llama"]
    d = Engine.from_selective(SelectiveModel(packed, load_ratio=1.0)).decoder
    ids = list(range(10, 30))
    d.prefill(ids[:6], extra=4)
    before = d.k_cache[0][:, :6].clone()
    d.reserve(4 * d.capacity, 3)  # longer and more slots
    assert d.slots == 3 and d.lengths[0] == 6
    assert torch.equal(d.k_cache[0][:, :6], before)
    want = Engine.from_selective(SelectiveModel(packed, load_ratio=1.0)).decoder
    want.prefill(ids[:6], extra=4)
    assert torch.equal(d.decode_one_token(ids[6]), want.decode_one_token(ids[6]))
