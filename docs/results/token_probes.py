"""Agreement probes of per-token selection variants on the frontier's held-out tokens (torch path,
int8 records, every loaded neuron, the general profile): per-layer shares, and the union of a
prompt-chosen set with per-token neurons. Quality only (no speed); see README.md in this folder,
"Per-token selection".

    python docs/results/token_probes.py budgets           # Gemma 3 270M (the embedded model)
    python docs/results/token_probes.py union
    python docs/results/token_probes.py budgets --model qwen2.5-1.5b --tokens 504
    python docs/results/token_probes.py groups --model qwen2.5-0.5b --tokens 1020 --groups 1 4 16

budgets: an average share 0.5 as one share for every layer, as shares that equalize each layer's
marginal |a| relative to its mean (from the profile's threshold tables), and as those times the
profile's measured layer sensitivity (where it has one). union: a prompt-chosen set of a share p
of the neurons (frequency vote over the prompt, alpha 0.2) computed for every decode token, plus
the neurons outside it that the per-token rule keeps at share s. groups: per token the top
share of groups of G slots (G adjacent rows read as one stream), the slots in profile order or
clustered on calibration text (the profiling records, not the held-out set): balanced k-means of
the neurons' |a| columns ("co-firing") or of their gate rows; a group's key is the sum over it of
|act(gate)| x the neuron's mean |up| on calibration (realizable: every gate row is read anyway)
or of |a| (oracle); printed: the share of each token's sum |a| inside the chosen groups, then
agreement for the profile order.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from selectinfer_ros.core.execution.engine import Engine
from selectinfer_ros.core.format import int8
from selectinfer_ros.core.format.models import resolve
from selectinfer_ros.core.format.paths import DATA_DIR, default_profiles_dir
from selectinfer_ros.core.format.pack import read_manifest
from selectinfer_ros.core.format.tokenizer import load_tokenizer
from selectinfer_ros.core.profiling.profiler import read_prompts, record_text
from selectinfer_ros.core.selection import token_rule
from selectinfer_ros.core.selection.loader import SelectiveModel, load_dense
from selectinfer_ros.core.selection.selective_mlp import SelectiveMLP
from selectinfer_ros.lab import frontier as F


def layer_shares(act: torch.Tensor, share: float, weight: torch.Tensor) -> torch.Tensor:
    """[L] shares averaging ``share``: the top bins of weight x act / (the layer's mean act),
    each layer keeping at least half of ``share``."""
    L, P = act.shape
    key = weight[:, None] * act / act.mean(1, keepdim=True)
    key[:, :max(1, round(share * P / 2))] = float("inf")
    chosen = torch.zeros(L * P)
    chosen[torch.topk(key.flatten(), round(share * L * P)).indices] = 1
    return chosen.view(L, P).sum(1) / P


def set_shares(sm: SelectiveModel, shares: torch.Tensor) -> None:
    gate, act = sm.token_tables
    for m in sm.mlps:
        s = float(shares[m.layer])
        if s <= 0:
            m.gate_thr = m.act_thr = float("inf")
        else:
            m.gate_thr = float(token_rule._at(gate, token_rule.candidate_share(s))[m.layer])
            m.act_thr = float(token_rule._at(act, s)[m.layer])


def union_forward(prefix_share: dict):
    """SelectiveMLP.forward (int8 slots in the token layout) computing, per decode token, the
    prompt-chosen set plus the per-token rule's neurons."""
    def forward(self, x):
        st, k = self.state, self.n_loaded
        out = int8.linear(x, self.gu.reshape(2 * k, self.hidden), self.gu_scale.reshape(2 * k))
        out = out.view(*x.shape[:-1], 2, k).transpose(-1, -2)
        g = self.act_fn(out[..., 0].contiguous())
        h = g * out[..., 1]
        if st.prefill:
            a = h.reshape(-1, k).abs().float()
            top = torch.topk(a, max(1, int(0.2 * k)), dim=1).indices
            votes = torch.zeros(k).index_add_(0, top.flatten(), torch.ones(top.numel()))
            key = votes + 0.5 * a.sum(0) / a.sum(0).max().clamp_min(1e-30)
            self._prefix = torch.zeros(k, dtype=torch.bool)
            n = int(prefix_share["p"] * k)
            if n:
                self._prefix[torch.topk(key, n).indices] = True
        else:
            cand = g.abs() >= self.gate_thr
            keep = self._prefix | (cand & (h.abs() >= self.act_thr))
            h = h * keep
            st.kept[self.layer] += int(keep.sum())
            st.candidates[self.layer] += int(cand.sum())
            if self.layer == 0:
                st.decoded += keep[..., 0].numel()
        return self._down(h, k).to(x.dtype)
    return forward


def balanced_kmeans(f: torch.Tensor, G: int, iters: int = 12) -> torch.Tensor:
    """Groups ``[k / G, G]`` of the columns of ``f`` ``[D, k]`` (spherical k-means, every group
    exactly G: each round the unplaced columns propose to their nearest open group, which takes
    its best proposals up to its room)."""
    x = f - f.mean(0, keepdim=True)
    x = x / x.norm(dim=0, keepdim=True).clamp_min(1e-9)
    k, ng = x.shape[1], x.shape[1] // G
    u, s, _ = torch.pca_lowrank(x.T, q=4, center=False)
    assign = torch.empty(k, dtype=torch.long)
    assign[torch.argsort(u[:, 0])] = torch.arange(k) // G  # start: slices along the first axis
    for _ in range(iters):
        c = torch.zeros(x.shape[0], ng).index_add_(1, assign, x)
        sim = x.T @ (c / c.norm(dim=0, keepdim=True).clamp_min(1e-9))  # [k, ng]
        assign.fill_(-1)
        room = torch.full((ng,), G)
        while (assign < 0).any():
            open_sim = sim.masked_fill((assign >= 0)[:, None] | (room == 0)[None, :], -1e9)
            idx = torch.nonzero(assign < 0)[:, 0]
            best = open_sim[idx].argmax(1)
            val = open_sim[idx, best]
            order = torch.argsort(-val)
            idx, best = idx[order], best[order]
            srt = torch.argsort(best, stable=True)
            rank = torch.empty_like(best)
            rank[srt] = torch.arange(len(best)) - torch.searchsorted(best[srt], best[srt])
            ok = rank < room[best]
            assign[idx[ok]] = best[ok]
            room -= torch.bincount(best[ok], minlength=ng)
    return torch.argsort(assign, stable=True).view(ng, G)


def record_forward(store: dict):
    """SelectiveMLP.forward (int8 slots, token layout, every neuron computed) that keeps each
    layer's |a|, |act(gate)| and |up| per token in ``store[layer]`` when ``store["on"]``, and
    masks decode tokens to ``store["keep"](layer, a, gate_act)`` when that is set."""
    def forward(self, x):
        k = self.n_loaded
        out = int8.linear(x, self.gu.reshape(2 * k, self.hidden), self.gu_scale.reshape(2 * k))
        out = out.view(*x.shape[:-1], 2, k).transpose(-1, -2)
        g = self.act_fn(out[..., 0].contiguous())
        h = g * out[..., 1]
        if store.get("on"):
            store.setdefault(self.layer, []).append(
                torch.stack([h.abs(), g.abs(), out[..., 1].abs()]).reshape(3, -1, k).half())
        elif store.get("keep") and not self.state.prefill:
            h = h * store["keep"](self.layer, h.reshape(-1, k), g.reshape(-1, k)).view(h.shape)
        return self._down(h, k).to(x.dtype)
    return forward


def group_probe(args, sm, eng, tok, chunks, base, refs) -> None:
    store: dict = {}
    SelectiveMLP.forward = record_forward(store)

    def record(token_chunks) -> dict:
        store["on"] = True
        with torch.inference_mode():
            for c in token_chunks:
                eng.model(torch.tensor([c.tolist()]))
        store["on"] = False
        return {m.layer: torch.cat(store.pop(m.layer), 1).float() for m in sm.mlps}  # [3, T, k]

    texts = [record_text(r) for p in sorted((DATA_DIR / "profiling").glob("*.jsonl"))
             for r in read_prompts(p)]
    random.Random(0).shuffle(texts)
    cal = record(F.make_chunks(tok, texts, 512, 4096)[:8])
    held = record(chunks)
    w_up = {l: c[2].mean(0) for l, c in cal.items()}  # [k] mean |up| per neuron
    k = sm.mlps[0].n_loaded
    orders = {}
    for G in args.groups:
        orders[("profile order", G)] = {l: torch.arange(k).view(-1, G) for l in cal}
        if G == 1:
            continue
        orders[("co-firing", G)] = {l: balanced_kmeans(c[0].sqrt(), G) for l, c in cal.items()}
        orders[("gate rows", G)] = {
            m.layer: balanced_kmeans((m.gu[0].float() * m.gu_scale[0].float()[:, None]).T, G)
            for m in sm.mlps}
    for share in (0.5, 0.7):
        for (name, G), groups in [(("one neuron", 1), {l: torch.arange(k).view(-1, 1) for l in cal})] \
                + list(orders.items()):
            for key in ("gate", "oracle"):
                mass = []
                for l, (a, g, _) in held.items():
                    sums = (a if key == "oracle" else g * w_up[l])[:, groups[l]].sum(-1)  # [T, ng]
                    top = torch.topk(sums, round(share * groups[l].shape[0]), dim=1).indices
                    mass.append(float(a[:, groups[l]].sum(-1).gather(1, top).sum() / a.sum()))
                print(f"share {share}, {name}, G {G}, key {key}: |a| kept {sum(mass) / len(mass):.3f} "
                      f"(lowest layer {min(mass):.3f})", flush=True)
    for G in args.groups:
        for share in (0.5, 0.7):
            groups = orders[("profile order", G)]

            def keep(layer, a, g, groups=groups, share=share):
                sums = (g.abs() * w_up[layer])[:, groups[layer]].sum(-1)
                top = torch.topk(sums, round(share * groups[layer].shape[0]), dim=1).indices
                m = torch.zeros_like(sums).scatter_(1, top, 1.0)
                return torch.zeros_like(a).index_copy_(
                    1, groups[layer].flatten(), m.repeat_interleave(G, 1)).to(a.dtype)
            store["keep"] = keep
            q = F.score_engine(eng, base, refs)
            print(f"share {share}, profile order, G {G}, key gate: agreement {q['agreement']:.4f} "
                  f"[{q['agreement_ci_low']:.3f}, {q['agreement_ci_high']:.3f}] on {q['tokens']} "
                  f"tokens", flush=True)
    store["keep"] = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", choices=("budgets", "union", "groups"))
    ap.add_argument("--model", default="", help="model name or packed folder; '' = embedded")
    ap.add_argument("--tokens", type=int, default=2040, help="held-out tokens scored")
    ap.add_argument("--share", type=float, default=0.5, help="budgets: the average share")
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 16], help="groups: sizes G")
    args = ap.parse_args()
    fpath, ipath = resolve(args.model, "float", print), resolve(args.model, "int8", print)
    profiles = default_profiles_dir(read_manifest(fpath).model_id)
    tok = load_tokenizer(fpath)
    chunks = F.make_chunks(tok, F.heldout_texts(None, "general")[0], 512, args.tokens)
    dense, _ = load_dense(fpath)
    base = F.write_base(Engine(dense, tok), chunks, Path(tempfile.mkdtemp()) / "dense.kld", print)
    del dense
    refs = [F.Reference.of(lp) for lp in base.chunks()]
    sm = SelectiveModel(ipath, profiles, "general", load_ratio=1.0, static_ratio=0.0,
                        compute_ratio=1.0, compute_mode="token")
    sm.tokenizer = tok
    eng = Engine.from_selective(sm)
    L = len(sm.mlps)
    if args.probe == "groups":
        return group_probe(args, sm, eng, tok, chunks, base, refs)
    if args.probe == "budgets":
        act = sm.token_tables[1]
        runs = {"uniform": torch.full((L,), args.share),
                "relative mass": layer_shares(act, args.share, torch.ones(L))}
        sens = sm.catalog.get("general").extra.get("sensitivity")
        if sens is not None:
            runs["sensitivity x relative mass"] = layer_shares(act, args.share,
                                                               sens.float() / sens.float().mean())
        plan = [(name, shares, None) for name, shares in runs.items()]
    else:
        prefix = {"p": 0.0}
        SelectiveMLP.forward = union_forward(prefix)
        pairs = [(0.5, 0.0), (0.4, 0.15), (0.3, 0.2), (0.3, 0.3), (0.2, 0.3), (0.0, 0.35), (0.0, 0.45)]
        plan = [(f"prefix {p} + per-token {s}", torch.full((L,), s), (prefix, p)) for p, s in pairs]
    for name, shares, pre in plan:
        if pre is not None:
            pre[0]["p"] = pre[1]
        set_shares(sm, shares)
        before, t0 = sm.counts(), time.perf_counter()
        q = F.score_engine(eng, base, refs)
        computed = sm.read_shares(before).get("computed_share", 0.0)
        print(f"{name}: agreement {q['agreement']:.4f} [{q['agreement_ci_low']:.3f}, "
              f"{q['agreement_ci_high']:.3f}] on {q['tokens']} tokens, computed {computed:.3f}, "
              f"layer shares {[round(float(x), 2) for x in shares]} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
