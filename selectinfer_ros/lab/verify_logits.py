"""``selectinfer verify`` on a model by name: the packed float model at gamma = phi = 1 against
transformers on the same weights (the converted checkpoint), logits and greedy tokens."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

PROMPTS = ("Question: What is the capital of France?\nAnswer:",
           "The robot is in the kitchen and the battery is at 4 percent, so it",
           "def fibonacci(n):\n    ")


@torch.inference_mode()
def check_logits(packed: Path, hf: Path, log: Callable[[str], None], new_tokens: int = 8) -> dict:
    """Max |logit difference| of the packed float model (every neuron loaded and computed; its
    prefill, then the decode path teacher-forced) against transformers' full forward of the
    checkpoint ``hf``, over :data:`PROMPTS` plus each one's greedy continuation; and whether the
    greedy tokens match. Returns the figures (``max_abs``, ``max_rel``, ``tokens``,
    ``greedy_equal``)."""
    from transformers import AutoModelForCausalLM

    from ..core.execution.engine import Engine, GenerationConfig
    from ..core.selection.loader import SelectiveModel
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    sm = SelectiveModel(packed, None, load_ratio=1.0, compute_ratio=1.0, dtype="float32")
    eng = Engine.from_selective(sm)
    worst = rel = 0.0
    tokens = 0
    greedy_equal = True
    for prompt in PROMPTS:
        ids = eng.encode(prompt)
        out = ref.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        cont = out[0, len(ids):].tolist()
        stop = ref.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [stop] if stop is not None else [])
        greedy = next((cont[:i] for i, t in enumerate(cont) if t in stop), cont)  # ours ends at EOS
        want = ref(torch.tensor([ids + cont[:-1]])).logits[0, len(ids) - 1:].float()
        got = eng.score(ids, cont)
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        rel = max(rel, diff / want.abs().max().item())
        tokens += len(cont)
        ours = eng.generate(ids, GenerationConfig(max_new_tokens=new_tokens)).token_ids
        same = ours == greedy
        greedy_equal &= same
        log(f"[verify] {prompt[:40]!r}: max |logit diff| {diff:.2e} over {len(cont)} tokens; "
            f"greedy {'equal' if same else 'DIFFERENT: ' + repr((ours, greedy))}")
    return {"max_abs": worst, "max_rel": rel, "tokens": tokens, "greedy_equal": greedy_equal}
