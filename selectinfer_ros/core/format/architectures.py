"""Gated-MLP model families SelectInfer supports, and how to find their FFN weights."""
from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED = ("llama", "qwen2", "gemma3_text")


@dataclass(frozen=True)
class Architecture:
    """Where a family keeps its FFN: ``<prefix>.layers.<l>.mlp.{gate,up,down}_proj.weight``."""

    model_type: str
    layer_prefix: str = "model.layers"

    def ffn_key(self, layer: int, proj: str) -> str:
        return f"{self.layer_prefix}.{layer}.mlp.{proj}_proj.weight"

    def is_ffn_key(self, key: str) -> bool:
        return re.fullmatch(
            re.escape(self.layer_prefix) + r"\.\d+\.mlp\.(gate|up|down)_proj\.weight", key) is not None


def activation_name(config) -> str:
    """The MLP activation of a config (``hidden_activation`` for Gemma, ``hidden_act`` otherwise)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


def architecture_for(config) -> Architecture:
    """The architecture of a transformers config; refuses families without a gated MLP we know."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(
            f"unsupported architecture {model_type!r}: SelectInfer packs gated-MLP models of the "
            f"families {', '.join(SUPPORTED)} (Llama, Qwen2, Gemma 3 text)")
    if getattr(config, "mlp_bias", False):
        raise ValueError(f"{model_type} with mlp_bias=True is not supported (neuron records hold no bias)")
    return Architecture(model_type)
