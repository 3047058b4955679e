"""Agreement probes of per-token selection variants on the frontier's held-out tokens (torch path,
int8 records, every loaded neuron, the general profile): per-layer shares, and the union of a
prompt-chosen set with per-token neurons. Quality only (no speed); see README.md in this folder,
"Per-token selection".

    python docs/results/token_probes.py budgets           # Gemma 3 270M (the embedded model)
    python docs/results/token_probes.py union
    python docs/results/token_probes.py budgets --model qwen2.5-1.5b --tokens 504

budgets: an average share 0.5 as one share for every layer, as shares that equalize each layer's
marginal |a| relative to its mean (from the profile's threshold tables), and as those times the
profile's measured layer sensitivity (where it has one). union: a prompt-chosen set of a share p
of the neurons (frequency vote over the prompt, alpha 0.2) computed for every decode token, plus
the neurons outside it that the per-token rule keeps at share s.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from selectinfer_ros.core.execution.engine import Engine
from selectinfer_ros.core.format import int8
from selectinfer_ros.core.format.models import resolve
from selectinfer_ros.core.format.paths import default_profiles_dir
from selectinfer_ros.core.format.pack import read_manifest
from selectinfer_ros.core.format.tokenizer import load_tokenizer
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", choices=("budgets", "union"))
    ap.add_argument("--model", default="", help="model name or packed folder; '' = embedded")
    ap.add_argument("--tokens", type=int, default=2040, help="held-out tokens scored")
    ap.add_argument("--share", type=float, default=0.5, help="budgets: the average share")
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
