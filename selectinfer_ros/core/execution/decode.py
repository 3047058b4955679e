"""The lean forward: prefill and one-token decode over a transformers model's own weights.

gpt-fast style: small functions over a preallocated (static) KV cache, no transformers module
graph, masks or cache objects per step. Each decoder layer is a handful of tensor operations:
norms, the attention projections (float or int8 modules as loaded), rotary embedding from
precomputed tables, one ``scaled_dot_product_attention`` over the cached prefix (grouped-query
attention by folding the query groups into the query axis), and the layer's MLP module as it is
(a :class:`SelectiveMLP` keeps choosing neurons at prefill). The logits are computed for the last
position only.

Supports the families of :mod:`.architectures` (Llama, Qwen2, Gemma 3 text) as transformers
builds them; :func:`unsupported` says why another model is left to the transformers forward.
With the same weights the logits equal the transformers model's (tested to 1e-5 in float32).
"""
from __future__ import annotations

import ctypes
import inspect
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..format import int8, q4
from ..format import kernel as native
from ..format.architectures import activation_name

_HAS_RMS_NORM = hasattr(F, "rms_norm")


def unsupported(model: nn.Module) -> str | None:
    """Why :class:`Decoder` cannot run ``model`` (None when it can)."""
    cfg = model.config
    if cfg.model_type not in ("llama", "qwen2", "gemma3_text"):
        return f"model type {cfg.model_type!r}"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = [v for v in rope.values() if isinstance(v, dict)] or [rope]  # Gemma 3: per layer type
    types = {p.get("rope_type", p.get("type")) for p in params}
    if types & {"dynamic", "longrope"}:
        return f"rotary scaling {sorted(t for t in types if t)} depends on the sequence length"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "no decoder stack at model.model.layers"
    return None


class _Norm:
    """RMS norm matching the module: Gemma ``(x_hat * (1 + w)).to(x)`` in float32, Llama/Qwen2
    ``w * x_hat.to(x)``. ``weight`` is the effective float32 weight (``1 + w`` for Gemma)."""

    def __init__(self, module: nn.Module, gemma: bool):
        self.eps = float(getattr(module, "eps", None) or getattr(module, "variance_epsilon"))
        self.gemma = gemma
        self.w = module.weight
        self.weight = (1.0 + module.weight.float() if gemma else module.weight.float()).contiguous()

    def _hat(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        if _HAS_RMS_NORM:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y * w if w is not None else y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            return self._hat(x, self.weight).type_as(x)
        return self.w * self._hat(x, None).to(x.dtype)


@dataclass
class _Layer:
    input_norm: _Norm
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    q_norm: _Norm | None
    k_norm: _Norm | None
    post_attn_norm: _Norm | None  # Gemma: after attention, before the residual
    pre_mlp_norm: _Norm
    post_mlp_norm: _Norm | None  # Gemma: after the MLP, before the residual
    mlp: nn.Module
    rope: str  # key into the rotary tables
    window: int | None  # sliding window (keys per query, itself included), None = full


class Decoder:
    """Prefill and decode over static KV caches, one per sequence slot.

    ``prefill(ids)`` starts a request and returns the logits after its last token;
    ``decode_one_token(token)`` appends one token and returns the logits after it. Both are
    ``[V]`` float tensors on the model's device and use slot 0. Several requests decode together:
    ``reserve(n, slots=B)``, ``prefill(ids, slot=s)`` for each, then ``decode_batch(tokens,
    slots)`` appends one token to each listed slot in one pass over the weights and returns their
    logits ``[B, V]``. ``timings``, when a dict, collects seconds spent per phase ("attention",
    "ffn", "output") in decode steps (synchronised on CUDA).
    """

    def __init__(self, model: nn.Module):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean decoder does not run this model: {reason}")
        cfg = model.config
        body = model.model
        self.model = model
        self.gemma = cfg.model_type == "gemma3_text"
        self.embed = body.embed_tokens
        self.final_norm = _Norm(body.norm, self.gemma)
        self.head = model.lm_head
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.n_heads // self.n_kv
        self.scaling = (cfg.query_pre_attn_scalar ** -0.5 if self.gemma
                        else self.head_dim ** -0.5)
        self.rotary = body.rotary_emb
        self.rotary_local = getattr(body, "rotary_emb_local", None)  # transformers 4.x Gemma 3
        self._rotary_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.layers = [self._layer(blk, cfg, i) for i, blk in enumerate(body.layers)]
        self.device = self.embed.weight.device
        self.dtype = self._compute_dtype()
        self.capacity = 0
        self.slots = 0  # sequences the caches hold
        self._k: list[torch.Tensor] = []  # per layer [slots, n_kv, capacity, head_dim]
        self._v: list[torch.Tensor] = []
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # [capacity, head_dim]
        self.lengths: list[int] = []  # tokens in each slot's cache
        self.timings: dict[str, float] | None = None
        self._step = torch.empty(1, 1, dtype=torch.long, device=self.device)
        reason = native_unsupported(self)
        # int8 models on the CPU decode in one kernel call for all layers
        self.native: NativeInt8Step | None = NativeInt8Step(self) if reason is None else None
        self.path = "int8 decode kernel" if reason is None else f"torch ops ({reason})"

    def _compute_dtype(self) -> torch.dtype:
        """The activations' dtype: a float embedding's weights', an int8 embedding's ``dtype``."""
        emb = self.embed
        return emb.weight.dtype if isinstance(emb, nn.Embedding) else emb.dtype

    def _layer(self, blk: nn.Module, cfg, i: int) -> _Layer:
        att = blk.self_attn
        g = self.gemma
        window = getattr(att, "sliding_window", None)
        if window is None and not g and getattr(cfg, "layer_types", None) and \
                cfg.layer_types[i] == "sliding_attention":
            window = cfg.sliding_window
        if self._rotary_by_type:
            rope = cfg.layer_types[i]
        else:
            rope = "local" if (window is not None and self.rotary_local is not None) else "global"
        return _Layer(
            input_norm=_Norm(blk.input_layernorm, g),
            q=att.q_proj, k=att.k_proj, v=att.v_proj, o=att.o_proj,
            q_norm=_Norm(att.q_norm, g) if hasattr(att, "q_norm") else None,
            k_norm=_Norm(att.k_norm, g) if hasattr(att, "k_norm") else None,
            post_attn_norm=_Norm(blk.post_attention_layernorm, g) if g else None,
            pre_mlp_norm=_Norm(blk.pre_feedforward_layernorm if g else blk.post_attention_layernorm, g),
            post_mlp_norm=_Norm(blk.post_feedforward_layernorm, g) if g else None,
            mlp=blk.mlp, rope=rope, window=window)

    # -- cache and rotary tables -------------------------------------------------------------
    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Slot 0's key cache per layer ``[n_kv, capacity, head_dim]`` (views)."""
        return [k[0] for k in self._k]

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return [v[0] for v in self._v]

    @property
    def pos(self) -> int:
        """Tokens in slot 0's cache."""
        return self.lengths[0] if self.lengths else 0

    @pos.setter
    def pos(self, value: int) -> None:
        if not self.lengths:
            self.lengths = [0]
        self.lengths[0] = value

    def reserve(self, n_tokens: int, slots: int = 1) -> None:
        """Room for ``n_tokens`` positions in each of ``slots`` sequences: allocated once, reused
        while large enough; growing keeps what the caches hold (other slots may be decoding)."""
        slots = max(slots, self.slots, 1)
        if n_tokens <= self.capacity and slots == self.slots:
            return
        cap = max(n_tokens, 2 * self.capacity) if n_tokens > self.capacity else self.capacity
        shape = (slots, self.n_kv, cap, self.head_dim)

        def grown(old: list[torch.Tensor]) -> list[torch.Tensor]:
            new = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
            for n, o in zip(new, old):
                n[:o.shape[0], :, :o.shape[2]] = o
            return new
        self._k, self._v = grown(self._k), grown(self._v)
        self.lengths += [0] * (slots - len(self.lengths))
        self.slots = slots
        if cap == self.capacity:
            if self.native is not None:
                self.native.stale = True
            return
        pos = torch.arange(cap, device=self.device)[None]  # [1, cap]
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        self.tables = {}
        for rope in {l.rope for l in self.layers}:
            if self._rotary_by_type:
                cos, sin = self.rotary(probe, pos, rope)
            else:
                cos, sin = (self.rotary_local if rope == "local" else self.rotary)(probe, pos)
            half = self.head_dim // 2
            # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]
            signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
            self.tables[rope] = (cos[0].contiguous(), signed.contiguous())
        self.capacity = cap
        if self.native is not None:
            self.native.stale = True

    def export_prefix(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of slot ``slot``'s keys and values of positions ``[0, n)``, per layer
        ``[n_kv, n, head_dim]`` (the prompt cache keeps them)."""
        return [(k[slot][:, :n].clone(), v[slot][:, :n].clone()) for k, v in zip(self._k, self._v)]

    def import_prefix(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Slot ``slot`` takes the keys and values of positions ``[0, n)`` from ``kv`` (as
        :meth:`export_prefix` gave them; room reserved before)."""
        if n > self.capacity or slot >= self.slots:
            raise ValueError(f"no room for {n} cached positions in slot {slot} (capacity "
                             f"{self.capacity}, {self.slots} slots): reserve first")
        for (k, v), kc, vc in zip(kv, self._k, self._v):
            kc[slot][:, :n].copy_(k[:, :n])
            vc[slot][:, :n].copy_(v[:, :n])
        self.lengths[slot] = n

    # -- forward --------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, torch.roll(x, self.head_dim // 2, dims=-1), sin)

    def _attention(self, l: _Layer, i: int, h: torch.Tensor, p: int, slot: int = 0
                   ) -> torch.Tensor:
        """Self-attention of the ``T`` tokens ``h`` ``[1, T, H]`` at positions ``[p, p+T)``."""
        T = h.shape[1]
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        q, k, v = l.q(h).view(T, nh, hd), l.k(h).view(T, nkv, hd), l.v(h).view(T, nkv, hd)
        return l.o(self._attend(l, i, q, k, v, p, slot).view(1, T, nh * hd))

    def _attention_rows(self, l: _Layer, i: int, h: torch.Tensor, pos: list[int],
                        slots: list[int]) -> torch.Tensor:
        """Self-attention of one token per row ``h`` ``[B, 1, H]``, row b at position ``pos[b]``
        of slot ``slots[b]``: the projections for all rows at once."""
        B = h.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        q, k, v = l.q(h).view(B, nh, hd), l.k(h).view(B, nkv, hd), l.v(h).view(B, nkv, hd)
        out = torch.cat([self._attend(l, i, q[b:b + 1], k[b:b + 1], v[b:b + 1], pos[b], slots[b])
                         for b in range(B)])  # [B, nh * hd]
        return l.o(out.view(B, 1, nh * hd))

    def _attend(self, l: _Layer, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                p: int, slot: int) -> torch.Tensor:
        """Queries ``q`` ``[T, nh, hd]`` over slot ``slot``'s cache after writing the keys and
        values ``[T, nkv, hd]`` at ``[p, p+T)``; ``[T, nh * hd]``."""
        T = q.shape[0]
        nh, nkv, hd, g = self.n_heads, self.n_kv, self.head_dim, self.groups
        if l.q_norm is not None:
            q, k = l.q_norm(q), l.k_norm(k)
        cos, sin = self.tables[l.rope]
        cos, sin = cos[p:p + T, None], sin[p:p + T, None]  # [T, 1, hd]
        q = self._rope(q, cos, sin)
        kc, vc = self._k[i][slot], self._v[i][slot]
        kc[:, p:p + T] = self._rope(k, cos, sin).transpose(0, 1)
        vc[:, p:p + T] = v.transpose(0, 1)
        end = p + T
        lo = 0 if l.window is None else max(0, end - l.window - T + 1)
        keys, values = kc[:, lo:end], vc[:, lo:end]  # [nkv, S, hd]
        if T == 1:
            q = q.view(nkv, g, hd)  # the query groups of one kv head, as query rows
            mask = None
        else:
            q = q.transpose(0, 1).reshape(nkv, g * T, hd)  # rows: group-major, then token
            qpos = torch.arange(p, end, device=q.device)[:, None]
            kpos = torch.arange(lo, end, device=q.device)[None]
            mask = kpos <= qpos
            if l.window is not None:
                mask &= kpos > qpos - l.window
            mask = mask.repeat(g, 1)  # [g*T, S]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
        return out.view(nh, T, hd).transpose(0, 1).reshape(T, nh * hd)

    def _layers(self, x: torch.Tensor, pos: list[int], slots: list[int]) -> torch.Tensor:
        """``x`` ``[B, T, H]``: one row of T tokens (a prefill, B = 1), or B rows of one token
        (row b at position ``pos[b]`` of slot ``slots[b]``)."""
        timed = self.timings is not None and x.shape[1] == 1
        if x.shape[1] == 1 and self.native is not None:
            return self.native.step(x, pos, slots, self.timings if timed else None)
        for i, l in enumerate(self.layers):
            t0 = self._now() if timed else 0.0
            h = l.input_norm(x)
            a = (self._attention(l, i, h, pos[0], slots[0]) if x.shape[0] == 1
                 else self._attention_rows(l, i, h, pos, slots))
            if l.post_attn_norm is not None:
                a = l.post_attn_norm(a)
            x = x + a
            t1 = self._now() if timed else 0.0
            m = l.mlp(l.pre_mlp_norm(x))
            if l.post_mlp_norm is not None:
                m = l.post_mlp_norm(m)
            x = x + m
            if timed:
                t2 = self._now()
                self.timings["attention"] += t1 - t0
                self.timings["ffn"] += t2 - t1
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        timed = self.timings is not None
        t0 = self._now() if timed else 0.0
        logits = self.head(self.final_norm(x[:, -1]))  # [B, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if timed:
            self.timings["output"] += self._now() - t0
        return logits

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def prefill(self, ids: list[int] | torch.Tensor, extra: int = 1, slot: int = 0,
                start: int = 0, logits: bool = True) -> torch.Tensor | None:
        """Start a request in ``slot`` with the prompt ``ids`` (room for ``extra`` more tokens);
        the logits ``[V]`` after its last token. ``start`` > 0: the next chunk of a prompt whose
        first ``start`` tokens are in the slot already; ``logits`` False: not computed (None)."""
        ids = torch.as_tensor(ids, device=self.device).view(1, -1)  # [1, T]
        self.reserve(start + ids.shape[1] + extra, slot + 1)
        self.lengths[slot] = start
        x = self._layers(self.embed(ids), [start], [slot])
        self.lengths[slot] = start + ids.shape[1]
        if self.native is not None:
            self.native.stale = True  # selection may have moved neurons and changed the prefix
        if not logits:
            return None
        timed, self.timings = self.timings, None  # prefill is not a decode step
        try:
            return self._logits(x)[0]
        finally:
            self.timings = timed

    @torch.inference_mode()
    def decode_one_token(self, token: int) -> torch.Tensor:
        """Append ``token`` to slot 0; the logits ``[V]`` after it."""
        self._step[0, 0] = token
        return self._decode(self._step, [0])[0]

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int], slots: list[int]) -> torch.Tensor:
        """Append ``tokens[b]`` to slot ``slots[b]`` for every b, in one pass over the weights;
        the logits ``[B, V]`` after them (row b equals a step of its slot alone, to float
        rounding of the output product)."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one step: {slots}")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)  # [B, 1]
        return self._decode(ids, slots)

    def _decode(self, ids: torch.Tensor, slots: list[int]) -> torch.Tensor:
        pos = [self.lengths[s] for s in slots]
        if max(pos) >= self.capacity:
            raise RuntimeError(f"KV cache full ({self.capacity} positions): reserve more at prefill")
        st = getattr(self.layers[0].mlp, "state", None)
        if st is not None:
            st.rows = slots  # the torch path's masks: row b computes the neurons of slot b's
        x = self._layers(self.embed(ids), pos, slots)
        for s in slots:
            self.lengths[s] += 1
        return self._logits(x)


# -- int8 models: one kernel call per decode step --------------------------------------------
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def native_unsupported(d: Decoder) -> str | None:
    """Why the int8 decode kernel cannot run ``d``'s model (None when it can): it needs int8 or
    4-bit attention projections (a float bias ``[N]`` each allowed: Qwen2) and int8 or 4-bit
    neuron slots in every layer, float32 activations on the CPU, and the compiled kernel."""
    from ..selection.selective_mlp import SelectiveMLP
    if d.device.type != "cpu" or d.dtype != torch.float32:
        return "int8 decode kernel: float32 on the CPU only"
    if activation_name(d.model.config) not in _ACTIVATIONS:
        return f"activation {activation_name(d.model.config)!r}"
    for l in d.layers:
        if not all(isinstance(m, (int8.Int8Linear, q4.Q4Linear)) for m in (l.q, l.k, l.v, l.o)):
            return "float attention projections"
        if any(m.bias is not None and tuple(m.bias.shape) != (m.out_features,)
               for m in (l.q, l.k, l.v, l.o)):
            return "attention projection biases of an unexpected shape"
        parts = getattr(l.mlp, "parts", ())
        if not parts or not all(isinstance(p, SelectiveMLP) for p in parts) or any(
                p.gu_scale is None and p.rec is None for p in parts):
            return "float neuron slots"
        if any(p.state.per_token and p.rec is None and not p.token_layout for p in parts):
            return "per-token selection over int8 slots not laid out for it (token_layout)"
        if any(p.state.per_token and p.grouped for p in parts):
            return "per-token selection over grouped 4-bit records (laid out for prompt mode)"
    if {l.input_norm.eps for l in d.layers} != {d.final_norm.eps}:
        return "norms with different eps"
    if int8.kernel() is None:
        return int8.kernel_status()
    return None


class NativeInt8Step:
    """The decoder layers of one decode step in the C kernel (``si_decode_layers``): the
    pointers of weights, slots, cache and rotary tables are gathered once per request.

    The MLP fields (active prefix, or per-token selection and its thresholds) also follow the
    selection state without a full refresh: every call compares a key of what they were filled
    from (:meth:`_mlp_key`: the prefill flag, and in per-token mode the tensors the kept and
    candidate counts go to and every layer's two thresholds; a few microseconds) and fills them again when it changed
    (``set_compute_ratio`` moves the thresholds, also in the middle of a request)."""

    def __init__(self, d: Decoder):
        self.d = d
        self.lib = int8.kernel()
        self.fn = self.lib.si_decode_batch
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.POINTER(native.ModelC), ctypes.POINTER(native.LayerC),
                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        self.layers = (native.LayerC * len(d.layers))()
        self.model = native.ModelC()
        self.stale = True
        self._keep: list[torch.Tensor] = []  # scratch the structures point into
        self._timing = (ctypes.c_double * 2)()
        self._key: tuple | None = None  # what the MLP fields were filled from (_mlp_key)
        self._token = False  # the layers select per token (counts to state.kept, .candidates)

    def _refresh(self) -> None:
        d, cfg = self.d, self.d.model.config
        H, hd = cfg.hidden_size, d.head_dim
        max_loaded = max(p.n_loaded for l in d.layers for p in l.mlp.parts)
        max_k = max(H, d.n_heads * hd, max_loaded)
        f32 = dict(dtype=torch.float32)
        teams = max(1, torch.get_num_threads())  # a scores row per thread
        batch = max(1, d.slots)
        dtypes = dict(xq=torch.int8, xs=torch.int32, idx=torch.int32, cnt=torch.int64,
                      cand=torch.int64, prep=torch.uint8)  # idx: per-token kept slots; cand:
        # candidates; prep: the activations prepared for the few-rows products
        bufs = {name: torch.empty(n, dtype=dtypes.get(name, torch.float32))
                for name, n in native.scratch_sizes(max_k, teams, d.capacity, batch).items()}
        self._keep = list(bufs.values())
        self._pos = torch.zeros(batch, dtype=torch.int64)  # per row: position,
        self._off = torch.zeros(batch, dtype=torch.int64)  # cache offset,
        self._slots = torch.zeros(batch, dtype=torch.int64)  # KV slot (its mask row)
        m = self.model
        m.batch = batch
        m.slots = self._slots.data_ptr()
        m.hidden, m.n_heads, m.n_kv, m.head_dim = H, d.n_heads, d.n_kv, hd
        m.cap, m.max_k, m.eps, m.scaling = d.capacity, max_k, d.final_norm.eps, d.scaling
        m.act = _ACTIVATIONS[activation_name(cfg)]
        m.teams = teams
        for name, t in bufs.items():
            setattr(m, name, t.data_ptr())
        for i, (l, c) in enumerate(zip(d.layers, self.layers)):
            for name in ("input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm",
                         "q_norm", "k_norm"):
                norm = getattr(l, name)
                setattr(c, "in_norm" if name == "input_norm" else name,
                        norm.weight.data_ptr() if norm is not None else None)
            for name in ("q", "k", "v", "o"):
                lin = getattr(l, name)
                w = lin.weight
                bias = None  # float32 [n] (Qwen2's q/k/v), kept alive in self._keep
                if lin.bias is not None:
                    b = lin.bias.float().contiguous()
                    self._keep.append(b)
                    bias = b.data_ptr()
                if isinstance(lin, q4.Q4Linear):  # nibbles [n, k / 2], heads [n, ceil(k / 256) * 16]
                    setattr(c, name, native.Mat(w.data_ptr(), None, w.shape[0], lin.in_features,
                                                w.stride(0), lin.scale.data_ptr(), lin.scale.stride(0),
                                                bias, 2 if lin.interleaved else 0))
                elif lin.tiled:  # int8 rows as tiles (uint8 [si_tile_bytes]), blocks a tile
                    setattr(c, name, native.Mat(w.data_ptr(), lin.scale.data_ptr(),
                                                lin.out_features, lin.in_features,
                                                -(-lin.in_features // 32), None, 0, bias, 1))
                else:
                    setattr(c, name, native.Mat(w.data_ptr(), lin.scale.data_ptr(), w.shape[0],
                                                w.shape[1], w.stride(0), None, 0, bias))
            c.k_cache, c.v_cache = d._k[i].data_ptr(), d._v[i].data_ptr()  # slot 0
            cos, sin = d.tables[l.rope]
            c.cos, c.sin = cos.data_ptr(), sin.data_ptr()
            c.window = l.window or 0
            c.gu = c.gu_scale = c.up = c.up_scale = c.down = c.down_scale = c.rec = None
            c.down_ld = c.rec_ld = c.tiled = c.rec_grouped = 0
            for mlp in l.mlp.parts:  # int8 slots, 4-bit records, or both (tiered)
                if mlp.grouped:  # 4-bit records in groups of 32 slots (prefix selection)
                    c.rec, c.rec_grouped = mlp.rec.data_ptr(), 1
                    continue
                if mlp.rec is not None:  # 4-bit records, read in place
                    if mlp.rec.stride(1) != 1 or H % 64:
                        raise ValueError(f"layer {i}: 4-bit records in an unexpected layout")
                    c.rec, c.rec_ld = mlp.rec.data_ptr(), mlp.rec.stride(0)
                    continue
                c.gu, c.gu_scale = mlp.gu.data_ptr(), mlp.gu_scale.data_ptr()
                c.down, c.down_scale = mlp.down.data_ptr(), mlp.down_scale.data_ptr()
                # gu [k, 2, H], down [H, k] (the active prefix of each row); per token: gu
                # planar [2, k, H] (gate rows, then up rows), down neuron-major [k, H]
                k = mlp.n_loaded
                c.tiled = int(mlp.tiled)
                if mlp.tiled:  # tiles of gu [2k, H] and down [H, k]
                    c.down_ld = k
                    continue
                if mlp.token_layout:
                    c.up, c.up_scale = mlp.gu[1].data_ptr(), mlp.gu_scale[1].data_ptr()
                gu_ok = (mlp.gu.stride() == ((k * H, H, 1) if mlp.token_layout else (2 * H, H, 1))
                         and mlp.gu_scale.is_contiguous())
                h_axis = 1 if mlp.token_layout else 0
                if not gu_ok or mlp.down.stride(1) != 1 or mlp.down.shape[h_axis] != H:
                    raise ValueError(f"layer {i}: neuron slots in an unexpected layout")
                c.down_ld = mlp.down.stride(0)
        self._fill_mlp(self._mlp_key())
        self.stale = False

    def _mlp_key(self) -> tuple:
        """What the MLP fields depend on beyond the slots' storage: the prefill flag and, when a
        decode token selects its own neurons, the kept and candidate counts' tensors and the
        thresholds."""
        st = self.d.layers[0].mlp.state
        if not st.per_token or st.prefill:
            return (st.prefill, st.version)
        return (False, st.kept.data_ptr(), st.kept.numel(), st.candidates.data_ptr(),
                st.candidates.numel(), [(l.mlp.gate_thr, l.mlp.act_thr) for l in self.d.layers])

    def _fill_mlp(self, key: tuple) -> None:
        """The per-layer MLP fields: the active prefix (prompt mode; every loaded slot at a
        prefill), or per-token selection over every loaded slot with the layer's thresholds, its
        kept count added to ``state.kept[layer]`` and its candidates (up row read) to
        ``state.candidates[layer]``. int8 slots laid out for per-token selection run the
        per-token path also where nothing is selected (thresholds 0, not counted: a one-token
        prompt's prefill in per-token mode)."""
        st = self.d.layers[0].mlp.state
        self._token = token = st.per_token and not st.prefill
        kept, cand = st.kept, st.candidates
        for name, t in (("kept", kept), ("candidates", cand)):
            if token and (t.dtype != torch.int64 or t.device.type != "cpu" or
                          not t.is_contiguous()):
                raise ValueError(f"per-token selection: state.{name} must be a contiguous int64 "
                                 "CPU tensor")
        for l, c in zip(self.d.layers, self.layers):
            parts = l.mlp.parts
            c.token = int(token or any(p.rec is None and p.token_layout for p in parts))
            c.gate_thr = c.act_thr = 0.0
            c.kept = c.candidates = None
            if token:
                c.gate_thr, c.act_thr = float(l.mlp.gate_thr), float(l.mlp.act_thr)
                layer = l.mlp.layer
                c.kept = kept.data_ptr() + 8 * layer if layer < kept.numel() else None
                c.candidates = cand.data_ptr() + 8 * layer if layer < cand.numel() else None
            c.mask = c.rec_mask = None
            c.mask_ld = c.rec_mask_ld = 0
            for mlp in parts:
                n = mlp.n_loaded if token or st.prefill else mlp.decode_width
                masked = mlp.masked and not st.prefill and not c.token
                mask = mlp.row_mask.data_ptr() if masked else None  # rows' own neurons
                mask_ld = mlp.row_mask.stride(0) if masked else 0
                if mlp.rec is not None:
                    c.rec_active, c.rec_mask, c.rec_mask_ld = n, mask, mask_ld
                else:
                    c.n_active, c.mask, c.mask_ld = n, mask, mask_ld
        self._key = key

    def _prepare(self) -> None:
        """The structures up to date for a call: refreshed when stale (or more threads than
        the scratch has room for), the MLP fields filled again when their key changed."""
        if (self.stale or torch.get_num_threads() > self.model.teams
                or self.d.slots > self.model.batch):
            self._refresh()
        else:
            key = self._mlp_key()
            if key != self._key:
                self._fill_mlp(key)

    def step(self, x: torch.Tensor, pos: list[int], slots: list[int],
             timings: dict[str, float] | None = None) -> torch.Tensor:
        """``x`` ``[B, 1, H]`` float32 (each row a token's embedding, row b at position
        ``pos[b]`` of slot ``slots[b]``) through every layer, in place; ``timings`` (if given)
        gets the seconds of attention and FFN added."""
        self._prepare()
        x = x.contiguous()
        B = x.shape[0]
        d = self.d
        slot_floats = d.n_kv * d.capacity * d.head_dim
        for b in range(B):
            self._pos[b], self._off[b] = pos[b], slots[b] * slot_floats
            self._slots[b] = slots[b]
        t = self._timing
        t[0] = t[1] = 0.0
        rc = self.fn(ctypes.byref(self.model), self.layers, len(self.layers), x.data_ptr(), B,
                     self._pos.data_ptr(), self._off.data_ptr(), torch.get_num_threads(),
                     t if timings is not None else None)
        if rc != 0:
            raise RuntimeError(f"int8 decode kernel failed (code {rc}) at positions {pos} "
                               f"(capacity {d.capacity}, {B} rows, room for {self.model.batch})")
        if self._token:  # as SelectiveMLP counts its decode tokens (with its first layer)
            st = self.d.layers[0].mlp.state
            if st.kept.numel() > 0:
                st.decoded += B
        if timings is not None:
            timings["attention"] += t[0]
            timings["ffn"] += t[1]
        return x
