"""The selective FFN: loaded neurons as compact slot buffers, and per-request selection.

Slots hold loaded neurons; ``slot_ids[s]`` is the original neuron id in slot s. The first
``n_static`` slots hold the static (task base) neurons. A request computes the first
``n_active`` slots when decoding; at prefill it computes every loaded slot and, when
``n_active < n_loaded``, chooses the dynamic neurons and swaps them into slots
``[n_static, n_active)`` (only the rows that move are copied; nothing is reallocated). The
active neurons thus always sit in one contiguous prefix: gate/up rows ``gu[:n_active]`` and the
first ``n_active`` entries of every down row, so a decode step reads exactly the active bytes.

Requests that decode together (a batch's rows, each in its KV slot) share one prefix, the union
of their neurons (:meth:`SelectiveMLP.place`): a joining request's chosen neurons outside it are
swapped in right after it, and a float mask row per KV slot (``row_mask`` ``[slots, n_loaded]``)
marks the slots that request computes; its activations of the others are zeroed before the down
product. A leaving request's neurons leave the prefix (:meth:`SelectiveMLP.release_row`).

Slots hold float rows, int8 rows with a float32 scale each (``int8`` packed models), or the
4-bit neuron records whole (``q4`` packed models: ``rec[:n_active]`` is the active prefix; in
prompt mode on x86 CPUs held in the kernel's groups of 32 slots, ``grouped``, read and written a
record at a time through :func:`..format.q4.group_io`).

Per-token selection (``compute_mode`` ``token``, :class:`TokenRule`): no prompt-chosen set; each
decode token computes the gate row of every loaded neuron, the up row of the candidates whose
``|act(gate)|`` clears the layer's gate threshold, and the down column of those whose
``|act(gate) * up|`` clears its activation threshold (CATS-like, with a second stage on the
candidates). The thresholds come from the profile's calibration (:mod:`.token_rule`). int8
slots are then laid out for it (``token_layout``): gate and up rows planar (``gu`` ``[2, k, H]``:
the decode kernel's gate pass is one stream over ``gu[0]``, a candidate's up row is read where it
lies in ``gu[1]``) and the down projection neuron-major (``down`` ``[k, H]``: a kept neuron's down
column is one contiguous row).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..format import int8, q4


_CHUNK = 2048  # neurons per float product of neuron-major int8 down rows (bounds the temporary)
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_index(dst: torch.Tensor, dim: int, idx: torch.Tensor, src: torch.Tensor,
               src_idx: torch.Tensor) -> None:
    """``dst[idx] = src[src_idx]`` along ``dim`` (0 or 1; ``src`` may be ``dst``). On the CPU
    through numpy, whose gathers ran 1.4x (float32 columns) to 5x (int8) faster than torch's
    ``index_copy_`` here (a prefill's selection moves hundreds of neurons per layer)."""
    if dst.device.type != "cpu":
        dst.index_copy_(dim, idx, src.index_select(dim, src_idx))
        return
    as_int = _SAME_SIZE_INT[dst.element_size()]  # numpy has no bfloat16: move the bits
    d, s = dst.view(as_int).numpy(), src.view(as_int).numpy()
    if dim == 0:
        d[idx.numpy()] = s[src_idx.numpy()]  # the right side is gathered first
    else:
        d[:, idx.numpy()] = s[:, src_idx.numpy()]


def _gate_up_rows(slots: torch.Tensor) -> torch.Tensor:
    """The rows of slots' gate and up rows in ``gu`` viewed as ``[2k, H]``: 2i, 2i + 1."""
    return torch.stack([2 * slots, 2 * slots + 1], 1).flatten()


@dataclass
class Slots:
    """Storage of ``k`` neuron slots: ``gu`` ``[k, 2, H]``, ``down`` ``[H, k]`` (float, or int8 with
    ``gu_scale`` ``[k, 2]`` and ``down_scale`` ``[k]`` float32; int8 ``token_layout``, for
    per-token selection: ``gu`` ``[2, k, H]`` and ``gu_scale`` ``[2, k]`` planar, ``down``
    ``[k, H]`` neuron-major), or 4-bit records ``rec`` uint8 ``[k, record_bytes]`` as stored
    (:func:`..format.pack.q4_records`; no ``gu``, ``down``), or with ``grouped`` (prefix
    selection on CPUs whose kernel gains from it) those records in the kernel's groups of 32
    slots (``rec`` uint8 ``[si_q4g_bytes(k, H)]``, ``count`` k; :func:`..format.q4.group_io`).
    int8 ``tiled`` (the same): ``gu`` holds the ``[2k, H]`` rows and ``down`` the
    ``[H, k]`` rows as the kernel's tiles (:func:`..format.int8.tiles_of`), read and written a
    neuron at a time through :func:`..format.int8.tile_io`."""

    gu: torch.Tensor | None
    down: torch.Tensor | None
    gu_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    rec: torch.Tensor | None = None
    token_layout: bool = False  # int8 gu planar [2, k, H], down neuron-major [k, H] (per token)
    tiled: bool = False  # int8 gu and down as tiles
    hidden: int = 0  # H (tiled, grouped: the storage does not say)
    grouped: bool = False  # 4-bit records in groups of 32 slots
    count: int = 0  # slots held (grouped: the storage does not say)

    @classmethod
    def empty(cls, k: int, hidden: int, dtype: torch.dtype, quantized: bool,
              device: torch.device | str, record_bytes: int = 0, token_layout: bool = False,
              tiled: bool = False, grouped: bool = False) -> "Slots":
        """``record_bytes`` > 0: slots of 4-bit records of that size (``grouped``: in groups,
        CPU); ``token_layout``: int8 slots laid out for per-token selection; ``tiled``: int8
        slots as tiles (CPU)."""
        if record_bytes and grouped:
            return cls(None, None, rec=q4.empty_groups(k, hidden), hidden=hidden, grouped=True,
                       count=k)
        if record_bytes:
            return cls(None, None, rec=torch.empty(k, record_bytes, dtype=torch.uint8, device=device))
        if not quantized:
            return cls(torch.empty(k, 2, hidden, dtype=dtype, device=device),
                       torch.empty(hidden, k, dtype=dtype, device=device))
        i8, f32 = dict(dtype=torch.int8, device=device), dict(dtype=torch.float32, device=device)
        if token_layout:
            return cls(torch.empty(2, k, hidden, **i8), torch.empty(k, hidden, **i8),
                       torch.empty(2, k, **f32), torch.empty(k, **f32), token_layout=True)
        if tiled:
            return cls(int8.empty_tiles(2 * k, hidden), int8.empty_tiles(hidden, k),
                       torch.empty(k, 2, **f32), torch.empty(k, **f32), tiled=True, hidden=hidden)
        return cls(torch.empty(k, 2, hidden, **i8), torch.empty(hidden, k, **i8),
                   torch.empty(k, 2, **f32), torch.empty(k, **f32))

    @property
    def k(self) -> int:
        """Slots held."""
        if self.rec is not None:
            return self.count if self.grouped else self.rec.shape[0]
        return self.down_scale.shape[0] if self.quantized else self.gu.shape[0]  # tiles: bytes

    def records(self, slots: torch.Tensor | None = None) -> torch.Tensor:
        """4-bit records of ``slots`` (None: all) as stored in the pack, whatever their storage:
        uint8 ``[n, record bytes]``."""
        ids = torch.arange(self.k) if slots is None else slots.cpu()
        if self.grouped:
            return q4.group_io("get", self.rec, self.k, self.hidden, ids)
        return self.rec[ids.to(self.rec.device)]

    def unpacked(self, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 slots as rows whatever their storage: ``gu`` ``[n, 2, H]``, ``down`` ``[H, n]``
        of ``slots`` (None: all)."""
        ids = torch.arange(self.k) if slots is None else slots.cpu()
        if not self.tiled:
            gu = self.gu.transpose(0, 1) if self.token_layout else self.gu
            down = self.down.t() if self.token_layout else self.down
            return gu[ids], down[:, ids]
        H, k = self.hidden, self.k
        gu = int8.tile_io("rows", self.gu, 2 * k, H, _gate_up_rows(ids))
        return gu.view(-1, 2, H), int8.tile_io("cols", self.down, H, k, ids).t()

    def _put_tiles(self, dst: torch.Tensor, gu: torch.Tensor, down: torch.Tensor) -> None:
        """Tiled slots ``dst`` take rows ``gu`` ``[n, 2, H]`` and down columns ``down``
        ``[n, H]``."""
        dst = dst.cpu()
        H, k = self.hidden, self.k
        int8.tile_io("put_rows", self.gu, 2 * k, H, _gate_up_rows(dst),
                     gu.to(torch.int8).reshape(-1, H))
        int8.tile_io("put_cols", self.down, H, k, dst, down.to(torch.int8))

    @property
    def down_dim(self) -> int:
        """The axis of ``down`` that runs over slots."""
        return 0 if self.token_layout else 1

    @property
    def gu_dim(self) -> int:
        """The axis of ``gu`` and ``gu_scale`` that runs over slots."""
        return 1 if self.token_layout else 0

    @property
    def quantized(self) -> bool:
        return self.gu_scale is not None

    def put(self, dst: torch.Tensor, vals: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Write neuron records (``vals`` ``[n, 3, H]``, ``scales`` ``[n, 3]``; 4-bit: the records
        ``[n, record_bytes]``) into slots ``dst``."""
        every = torch.arange(vals.shape[0], device=vals.device)
        if self.grouped:
            q4.group_io("put", self.rec, self.k, self.hidden, dst, vals)
            return
        if self.rec is not None:
            copy_index(self.rec, 0, dst, vals.contiguous(), every)
            return
        if self.tiled:
            self._put_tiles(dst, vals[:, :2], vals[:, 2])
            copy_index(self.gu_scale, 0, dst, scales[:, :2].contiguous(), every)
            copy_index(self.down_scale, 0, dst, scales[:, 2].contiguous(), every)
            return
        gu, gu_scale = vals[:, :2], None if scales is None else scales[:, :2]  # [n, 2, H], [n, 2]
        down = vals[:, 2] if self.token_layout else vals[:, 2].t()
        if self.token_layout:
            gu, gu_scale = gu.transpose(0, 1), gu_scale.t()  # planar [2, n, H], [2, n]
        copy_index(self.gu, self.gu_dim, dst, gu.to(self.gu.dtype).contiguous(), every)
        copy_index(self.down, self.down_dim, dst, down.to(self.down.dtype).contiguous(), every)
        if self.quantized:
            copy_index(self.gu_scale, self.gu_dim, dst, gu_scale.contiguous(), every)
            copy_index(self.down_scale, 0, dst, scales[:, 2].contiguous(), every)

    def copy(self, dst: torch.Tensor, other: "Slots", src: torch.Tensor) -> None:
        """Slots ``dst`` of this storage take the contents of ``other``'s slots ``src``."""
        if self.grouped:  # read first: src and dst may overlap (swaps)
            self.put(dst, other.records(src), None)
            return
        if self.rec is not None and other.grouped:
            copy_index(self.rec, 0, dst, other.records(src), torch.arange(src.numel()))
            return
        if self.rec is not None:
            copy_index(self.rec, 0, dst, other.rec, src)
            return
        if self.tiled:  # read first: src and dst may overlap (swaps)
            gu, down = other.unpacked(src)
            self._put_tiles(dst, gu, down.t())
        else:
            copy_index(self.gu, self.gu_dim, dst, other.gu, src)
            copy_index(self.down, self.down_dim, dst, other.down, src)
        if self.quantized:
            copy_index(self.gu_scale, self.gu_dim, dst, other.gu_scale, src)
            copy_index(self.down_scale, 0, dst, other.down_scale, src)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.gu, self.down, self.gu_scale, self.down_scale, self.rec) if t is not None)


class SelectionState:
    """Shared by every layer of a model for the request in flight."""

    def __init__(self) -> None:
        self.prefill = True
        self.alpha = 0.2
        self.method = "frequency"  # or "norm" (GRIFFIN-style prompt-wide activation norms)
        self.token_weight: torch.Tensor | None = None  # [T] 1.0 for tokens that vote, 0.0 (BOS) not
        self.select_seconds = 0.0  # time spent choosing dynamic neurons since the last reset
        self.per_token = False  # compute_mode "token": each decode token chooses its neurons
        # rows of a batch (prompt mode): the KV slot whose prefill places its neurons in the
        # shared prefix (None: a request alone, its neurons swapped into the prefix), whether this
        # forward is the prompt's last chunk (earlier chunks' votes are kept until it), the KV
        # slots of a decode step's rows (the torch path's masks) and a counter of the layers'
        # row changes (the decode kernel's fields follow it)
        self.row: int | None = None
        self.last_chunk = True
        self.rows: list[int] | None = None
        self.version = 0
        # the prompt cache: keep the prompt's votes (by neuron id) after its last chunk
        # (SelectiveMLP.kept_votes); a counter of changes to the resident neurons
        self.keep_votes = False
        self.residency = 0
        # token mode, cumulative (see SelectiveModel.read_shares):
        self.kept = torch.zeros(0, dtype=torch.int64)  # [L] neurons computed in decode
        self.candidates = torch.zeros(0, dtype=torch.int64)  # [L] of them candidates (up row read)
        self.decoded = 0  # decode tokens counted in ``kept``

    def start_prefill(self, token_weight: torch.Tensor | None) -> None:
        """A new request: the next forward is its prefill (selection runs there)."""
        self.prefill, self.token_weight, self.select_seconds = True, token_weight, 0.0


class SelectiveMLP(nn.Module):
    """Gated MLP over a subset of neurons: ``down(act(gate(x)) * up(x))`` restricted to slots."""

    def __init__(self, hidden: int, act: str, state: SelectionState, layer: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.hidden, self.layer, self.state = hidden, layer, state
        self.act_fn = ACT2FN[act]
        self.dense = False  # a dense layer computes every loaded slot, also in decode
        self.n_static = 0
        self.n_active = 0
        # down_proj columns of the loaded neurons, [H, k]: F.linear reads it as dot products, which
        # on CPU ran as fast as a row layout in float32 and 7x faster in bfloat16 (h @ [k, H]).
        empty = Slots.empty(0, hidden, dtype, False, device)
        self.register_buffer("gu", empty.gu)  # [k, 2, H]
        self.register_buffer("down", empty.down)  # [H, k]
        self.register_buffer("gu_scale", None)  # [k, 2] float32, int8 slots only
        self.register_buffer("down_scale", None)  # [k] float32, int8 slots only
        self.register_buffer("rec", None)  # [k, record_bytes] uint8, 4-bit records only
        self.grouped = False  # ``rec`` holds the records in the kernel's groups (Slots.grouped)
        self.register_buffer("slot_ids", torch.empty(0, dtype=torch.long, device=device))  # [k]
        self.token_layout = False  # int8 ``gu`` [2, k, H], ``down`` [k, H] (per-token selection)
        self.tiled = False  # int8 ``gu`` and ``down`` as tiles (Slots.tiled)
        self.gate_thr = 0.0  # per-token mode: |act(gate)| a candidate clears
        self.act_thr = 0.0  # per-token mode: |act(gate) * up| a computed neuron clears
        # Rows of a batch that compute different neurons (see place / release_row): each KV
        # slot's mask over the slots, float32 [rows, n_loaded] (1: the row computes that slot);
        # the rows placed; the shared prefix they compute (None: n_active); whether they differ
        self.row_mask: torch.Tensor | None = None
        self.live: set[int] = set()
        self.width: int | None = None
        self.masked = False
        # per KV slot (None: a request alone), the votes of its prompt's chunks so far, by neuron id
        self._votes_of: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kept_votes: tuple[torch.Tensor, torch.Tensor] | None = None  # state.keep_votes
        self.counts_tokens = True  # counts decode tokens in state.decoded (a tier's second: no)
        self.source = "main"  # the record file it loads from (the loader's: "high" for int8 tiers)

    @property
    def parts(self) -> tuple["SelectiveMLP", ...]:
        """The slot stores of the layer: this one (a :class:`TieredMLP` has two)."""
        return (self,)

    def set_thresholds(self, gate: float, act: float) -> None:
        """Per-token mode: the layer's gate and activation thresholds."""
        self.gate_thr, self.act_thr = gate, act

    @property
    def slots(self) -> Slots:
        return Slots(self.gu, self.down, self.gu_scale, self.down_scale, self.rec,
                     self.token_layout, self.tiled, self.hidden, self.grouped, self.n_loaded)

    @property
    def n_loaded(self) -> int:
        return self.slot_ids.numel()

    def set_slots(self, slots: Slots, slot_ids: torch.Tensor, n_static: int) -> None:
        """Install loaded neurons (``slots`` of ``k`` neurons, their ids ``[k]``)."""
        self.gu, self.down = slots.gu, slots.down
        self.gu_scale, self.down_scale = slots.gu_scale, slots.down_scale
        self.rec = slots.rec
        self.token_layout, self.tiled, self.grouped = slots.token_layout, slots.tiled, slots.grouped
        self.slot_ids = slot_ids
        self.n_static = n_static
        self.n_active = slot_ids.numel()
        self.row_mask, self.live, self.width, self.masked = None, set(), None, False
        self._votes_of, self.kept_votes = {}, None
        self.state.residency += 1

    def set_active(self, n_active: int) -> None:
        """Neurons computed per decode step (static + dynamic), clamped to [n_static, n_loaded]."""
        self.n_active = self.n_loaded if self.dense else max(self.n_static, min(n_active, self.n_loaded))

    @property
    def decode_width(self) -> int:
        """Slots a decode step computes: the active prefix (rows of a batch: their union)."""
        return self.width if self.width is not None else self.n_active

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, H]
        per_token = self.state.per_token and not self.state.prefill  # dense layers: thresholds 0
        k = self.n_loaded if self.state.prefill or per_token or self.token_layout \
            else self.decode_width
        if self.grouped:  # 4-bit records in groups: the active prefix's groups, in place
            out = q4.grouped_linear(x, self.rec, k, self.hidden)  # [B, T, k, 2]
        elif self.rec is not None:  # 4-bit records: the active prefix, read in place
            out = q4.records_linear(x, self.rec[:k], self.hidden)  # [B, T, k, 2]
        elif self.tiled:  # rows 2i, 2i + 1: neuron i's gate and up
            out = int8.tile_linear(x, self.gu, self.gu_scale[:k].view(2 * k), 2 * k
                                   ).view(*x.shape[:-1], k, 2)
        else:
            # [2k, H]: rows of neurons' gate and up (token_layout: every gate row, then every up
            # row; k is then every loaded slot)
            gu = self.gu.reshape(2 * k, self.hidden) if self.token_layout else \
                self.gu[:k].view(2 * k, self.hidden)
            if self.gu_scale is not None:  # int8 slots
                out = int8.linear(x, gu, self.gu_scale.reshape(2 * k) if self.token_layout
                                  else self.gu_scale[:k].view(2 * k))  # [B, T, 2k]
            else:
                out = nn.functional.linear(x, gu)  # [B, T, 2k]
            out = (out.view(*x.shape[:-1], 2, k).transpose(-1, -2) if self.token_layout
                   else out.view(*x.shape[:-1], k, 2))
        g = self.act_fn(out[..., 0].contiguous())  # [B, T, k]; strided GELU: 6x slower
        h = g * out[..., 1]  # [B, T, k]
        if per_token:  # the torch path computes every row and zeroes the neurons not kept
            cand = g.abs() >= self.gate_thr  # [B, T, k]
            keep = cand & (h.abs() >= self.act_thr)
            h = h * keep
            if self.layer < self.state.kept.numel():
                self.state.kept[self.layer] += int(keep.sum())
                self.state.candidates[self.layer] += int(cand.sum())
                if self.layer == 0 and self.counts_tokens:
                    self.state.decoded += keep[..., 0].numel()
        elif self.masked and not self.state.prefill:  # rows computing different neurons
            h = h * self.row_mask[self.state.rows, :k].unsqueeze(-2)  # [B, 1, k]
        if per_token and self.rec is not None:  # 4-bit records: the kept list's product, as the
            y = self._down_kept(h, keep).to(x.dtype)  # kernel groups it (its rounding too)
        else:
            y = self._down(h, k).to(x.dtype)  # [B, T, H]
        if self.state.prefill and not self.state.per_token and (
                self.n_active < self.n_loaded or self.state.row is not None):
            t0 = time.perf_counter()
            self._select(h)
            self.state.select_seconds += time.perf_counter() - t0
        return y

    def _down(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """``h`` ``[B, T, k]`` through the down columns of slots ``[0, k)`` -> ``[B, T, H]``."""
        if self.grouped:
            return q4.grouped_down(h, self.rec, k, self.hidden)
        if self.rec is not None:
            return q4.records_down(h, self.rec[:k], self.hidden)
        if self.down_scale is None:
            return nn.functional.linear(h, self.down[:, :k])
        h = h * self.down_scale[:k].to(h.dtype)  # the down column scales fold into the activations
        if self.tiled:
            return int8.tile_linear(h, self.down, None, self.hidden, self.n_loaded)
        if not self.token_layout:
            return int8.linear(h, self.down[:, :k], None)
        y = None  # neuron-major rows [k, H]: float products over chunks of neurons
        for c in range(0, k, _CHUNK):
            part = h[..., c:c + _CHUNK] @ self.down[c:min(k, c + _CHUNK)].to(h.dtype)
            y = part if y is None else y.add_(part)
        return y

    def _down_kept(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``h`` ``[B, T, k]`` through the down columns of the records each position kept
        (``keep``), over the kept list in slot order (the decode kernel's groups of 32 of it) ->
        ``[B, T, H]``."""
        if self.grouped:
            raise ValueError("per-token selection over grouped records (they are for prompt mode)")
        rows, flags = h.reshape(-1, h.shape[-1]), keep.reshape(-1, keep.shape[-1])
        y = rows.new_zeros(rows.shape[0], self.hidden)
        for r in range(rows.shape[0]):
            idx = flags[r].nonzero().flatten()
            if idx.numel():
                y[r] = q4.records_down(rows[r:r + 1, idx], self.rec[idx], self.hidden)[0]
        return y.view(*h.shape[:-1], self.hidden)

    def _votes(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's (or chunk's) votes per slot ``[k]``: counts of tokens whose top-alpha holds
        the slot and summed |a| (method "norm": the prompt-wide norm, and zeros); both add up
        over chunks."""
        a = h.reshape(-1, h.shape[-1]).abs().float()  # [T, k]
        w = self.state.token_weight
        w = (torch.ones(a.shape[0], device=a.device) if w is None or w.numel() != a.shape[0]
             else w.to(a.device))  # a batch's prefill marks its tokens on the host
        k = self.n_loaded
        if self.state.method == "norm":
            a = a / a.norm(dim=1, keepdim=True).clamp_min(1e-12)
            return (a.square() * w[:, None]).sum(0), torch.zeros(k, device=a.device)  # GRIFFIN
        k_alpha = max(1, int(self.state.alpha * k))
        top = torch.topk(a, k_alpha, dim=1, sorted=False).indices  # [T, k_alpha]
        counts = torch.zeros(k, device=a.device).index_add_(
            0, top.flatten(), w[:, None].expand_as(top).flatten())
        return counts, (a * w[:, None]).sum(0)

    @property
    def needs_votes(self) -> bool:
        """Whether a prompt's votes choose this layer's decode neurons (prompt mode, phi < gamma)."""
        return not self.state.per_token and self.n_active < self.n_loaded

    def prompt_votes(self, row: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The votes of KV slot ``row``'s prompt chunks so far (by neuron id), or None."""
        return self._votes_of.get(row)

    def start_votes(self, row: int | None, votes: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """A new prompt in ``row``: its votes start from ``votes`` (a reused prefix's, copied), or
        from none."""
        if votes is None:
            self._votes_of.pop(row, None)
        else:
            self._votes_of[row] = (votes[0].clone(), votes[1].clone())

    def _select(self, h: torch.Tensor) -> None:
        """Choose ``n_active - n_static`` dynamic neurons from the prompt and put them in the
        prefix (:meth:`place`). A prompt prefilled in chunks (``state.last_chunk`` False until
        its last), or whose prefix came from the prompt cache, chooses at its last chunk from the
        votes of all, kept by neuron id meanwhile (other rows may move slots between chunks)."""
        k, s = self.n_loaded, self.n_static
        e = self.n_active - s
        st = self.state
        if e >= k - s:  # every loaded slot
            if st.last_chunk:
                self.place(torch.arange(s, k, device=self.slot_ids.device))
            return
        counts, mass = self._votes(h)
        acc = self._votes_of.get(st.row)
        if acc is not None or not st.last_chunk or st.keep_votes:
            ids = self.slot_ids
            if acc is None:
                n = int(ids.max()) + 1 if ids.numel() else 0
                acc = self._votes_of[st.row] = (torch.zeros(n, device=ids.device),
                                                torch.zeros(n, device=ids.device))
            acc[0].index_add_(0, ids, counts)
            acc[1].index_add_(0, ids, mass)
            if not st.last_chunk:
                return
            del self._votes_of[st.row]
            if st.keep_votes:
                self.kept_votes = acc
            counts, mass = acc[0][ids], acc[1][ids]
        key = counts + 0.5 * mass / mass.max().clamp_min(1e-30)  # ties broken by summed |a|
        key[:s] = -1.0
        self.place(torch.topk(key, e, sorted=False).indices)

    # ---- rows of a batch that compute different neurons --------------------------------
    def share_rows(self, rows: int) -> None:
        """Room for the masks of ``rows`` KV slots (kept when there is)."""
        m = self.row_mask
        if m is not None and m.shape[0] >= rows and m.shape[1] == self.n_loaded:
            return
        new = torch.zeros(rows, self.n_loaded, device=self.slot_ids.device)
        if m is not None and m.shape[1] == self.n_loaded:
            new[:m.shape[0]] = m
        else:
            self.live, self.width, self.masked = set(), None, False
        self.row_mask = new

    def place(self, chosen: torch.Tensor) -> None:
        """The dynamic neurons ``chosen`` (slots >= n_static) become those of the request in
        prefill (a batch's row: of KV slot ``state.row``): the chosen slots already in the prefix
        the other rows share stay where they are, the others are swapped in right after it
        (alone, or the first row: after the static slots), and the prefix grows by them; a row's
        mask marks its own slots."""
        s, row = self.n_static, self.state.row
        u = self.width if row is not None and self.live - {row} else s  # the shared prefix
        inside, outside = chosen[chosen < u], chosen[chosen >= u]
        self._swap_in(outside, u, outside.numel())
        width = u + outside.numel()
        if row is None:
            return
        mask = self.row_mask[row]
        mask.zero_()
        mask[:s] = 1.0
        mask[inside] = 1.0
        mask[u:width] = 1.0
        self.live.add(row)
        self.width = width
        self._note_rows()

    def release_row(self, row: int) -> None:
        """KV slot ``row`` left the batch: its mask is cleared and the prefix shrinks to the
        remaining rows' neurons (slots beyond the new prefix that a row computes are swapped into
        the holes, the masks follow)."""
        self._votes_of.pop(row, None)
        if row not in self.live:
            return
        self.live.discard(row)
        self.row_mask[row].zero_()
        if not self.live:
            self.width, self.masked = None, False
            return
        if not self.masked:  # every row computed the whole prefix: the rest still do
            return
        live = torch.tensor(sorted(self.live), device=self.row_mask.device)
        used = (self.row_mask[live, :self.width] > 0).any(0)  # [width]
        used[:self.n_static] = True
        n = int(used.sum())
        holes = (~used[:n]).nonzero().flatten()  # free slots inside the new prefix
        movers = used[n:].nonzero().flatten() + n  # used slots beyond it (as many)
        if holes.numel():
            dst, src = torch.cat([holes, movers]), torch.cat([movers, holes])
            self.slots.copy(dst, self.slots, src)
            copy_index(self.slot_ids, 0, dst, self.slot_ids, src)
            copy_index(self.row_mask, 1, dst, self.row_mask, src)
        self.width = n
        self._note_rows()

    def _note_rows(self) -> None:
        """Whether the live rows' masks differ from the whole prefix (then applied)."""
        live = sorted(self.live)
        self.masked = bool(live) and bool((self.row_mask[live, :self.width] == 0).any())
        self.state.version += 1

    def _swap_in(self, chosen: torch.Tensor, s: int, e: int) -> None:
        """Move the slots ``chosen`` into ``[s, s+e)`` by pairwise swaps, with no host sync."""
        k = self.n_loaded
        n_out = k - s - e
        if e == 0 or n_out == 0:
            return
        mark = torch.zeros(k, dtype=torch.int8, device=chosen.device)
        mark[chosen] = 1
        # Inside the window, unchosen slots first; outside it, chosen slots first.
        inside = s + torch.argsort(mark[s:s + e], stable=True)
        outside = s + e + torch.argsort(1 - mark[s + e:], stable=True)
        pairs = min(e, n_out)
        moving = mark[s + e:].sum()  # how many chosen slots lie outside the window
        a = inside[:pairs]
        if chosen.device.type == "cpu":  # a host read is free here: swap only the moving pairs
            pairs = int(moving)
            a, b = a[:pairs], outside[:pairs]
        else:  # no host sync on accelerators: surplus pairs swap a slot with itself
            b = torch.where(torch.arange(pairs, device=chosen.device) < moving, outside[:pairs], a)
        if pairs == 0:
            return
        dst, src = torch.cat([a, b]), torch.cat([b, a])
        self.slots.copy(dst, self.slots, src)
        copy_index(self.slot_ids, 0, dst, self.slot_ids, src)

    def weight_bytes(self) -> int:
        return self.slots.nbytes()

    def neuron_bytes(self) -> int:
        """Resident bytes of one loaded neuron (its rows and scales)."""
        return self.weight_bytes() // max(1, self.n_loaded)


class TieredMLP(nn.Module):
    """One layer's MLP over tiered records: the high tier ``hi`` (int8 slots: the layer's most
    valued resident neurons) and the low tier ``lo`` (4-bit records: the rest), each a
    :class:`SelectiveMLP` with its own slots, static prefix, active prefix and selection; the
    output is the sum of both. A neuron lies in exactly one tier."""

    def __init__(self, hi: SelectiveMLP, lo: SelectiveMLP):
        super().__init__()
        self.hi, self.lo = hi, lo
        lo.counts_tokens = False

    @property
    def parts(self) -> tuple[SelectiveMLP, SelectiveMLP]:
        return (self.hi, self.lo)

    @property
    def layer(self) -> int:
        return self.hi.layer

    @property
    def state(self) -> SelectionState:
        return self.hi.state

    @property
    def n_loaded(self) -> int:
        return self.hi.n_loaded + self.lo.n_loaded

    @property
    def n_active(self) -> int:
        return self.hi.n_active + self.lo.n_active

    @property
    def dense(self) -> bool:
        return self.hi.dense

    @dense.setter
    def dense(self, value: bool) -> None:
        self.hi.dense = self.lo.dense = value

    @property
    def gate_thr(self) -> float:
        return self.hi.gate_thr

    @property
    def act_thr(self) -> float:
        return self.hi.act_thr

    def set_thresholds(self, gate: float, act: float) -> None:
        for p in self.parts:
            p.gate_thr, p.act_thr = gate, act

    @property
    def slot_ids(self) -> torch.Tensor:
        """Every resident neuron's id: the high tier's slots, then the low tier's."""
        return torch.cat([self.hi.slot_ids, self.lo.slot_ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, H]
        held = [p for p in self.parts if p.n_loaded]  # int8_ratio = load_ratio: no 4-bit tier
        y = held[0](x)
        return y + held[1](x) if len(held) > 1 else y

    def share_rows(self, rows: int) -> None:
        for p in self.parts:
            p.share_rows(rows)

    def release_row(self, row: int) -> None:
        for p in self.parts:
            p.release_row(row)

    def weight_bytes(self) -> int:
        return self.hi.weight_bytes() + self.lo.weight_bytes()

    def neuron_bytes(self) -> int:
        """Resident bytes of one loaded neuron, on average over the tiers."""
        return self.weight_bytes() // max(1, self.n_loaded)
