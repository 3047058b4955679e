"""Random-weight checkpoints with real model shapes, for shape, speed and memory work.

Weights are drawn tensor by tensor and streamed to disk (a 3B checkpoint never sits in memory),
with a word-level tokenizer that covers the whole vocabulary (``w0 w1 ...``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..core.format.safetensors_io import StreamWriter

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_theta": 500000.0}

PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE),
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=256,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=192,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True),
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=16, vocab_size=512, max_position_embeddings=256,
                        sliding_window=8, tie_word_embeddings=True),
}


def make_config(preset: str):
    from transformers import AutoConfig
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    kw = dict(PRESETS[preset])
    kw.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``<pad> <bos> <eos> <unk> w4 ... w{V-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the family's own tokenizer class
    cfg_path.write_text(json.dumps(cfg, indent=2))


def make_random_model(preset: str, out: str | Path, dtype: torch.dtype = torch.float32,
                      seed: int = 0, std: float = 0.02, bias_std: float = 0.0) -> Path:
    """Write a random-weight Hugging Face checkpoint of ``preset``'s shapes to ``out``; biases
    (Qwen2's q/k/v projections) are zero, or drawn with ``bias_std`` when it is nonzero."""
    from transformers import AutoModelForCausalLM
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(preset)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(seed)
    w = StreamWriter(out / "model.safetensors", {k: (dtype, s) for k, s in shapes.items()},
                     {"format": "pt"})
    for name, shape in shapes.items():
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.zeros(shape) if config.model_type == "gemma3_text" else torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.empty(shape).normal_(0.0, bias_std, generator=g) if bias_std else \
                torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, std, generator=g)
        w.write(name, t.to(dtype))
    w.close()
    config.dtype = dtype
    config.save_pretrained(out)
    write_tokenizer(out, config.vocab_size)
    (out / "SOURCE").write_text(json.dumps({"random": preset, "seed": seed}) + "\n")
    return out
