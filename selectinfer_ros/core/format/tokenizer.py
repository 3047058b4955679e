"""Tokenizer loading for packed folders."""
from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(path: str | Path):
    """The folder's tokenizer. A plain ``PreTrainedTokenizerFast`` (random-weight models) is loaded
    as such: ``AutoTokenizer`` would swap in the model family's own tokenizer class."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    cfg = Path(path) / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") == "PreTrainedTokenizerFast":
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
