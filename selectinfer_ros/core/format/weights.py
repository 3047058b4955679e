"""The records formats ``selectinfer pack --weights`` writes (one place for their names; no
torch import, so option parsers can use it)."""
from __future__ import annotations

WEIGHTS = ("float", "int8", "int8-ffn", "int8-q4emb", "q4", "q4-out8", "q4-all")
INT8_WEIGHTS = ("int8", "int8-ffn", "int8-q4emb")  # int8 neuron records
Q4_WEIGHTS = ("q4", "q4-out8", "q4-all")  # 4-bit neuron records (and their int8 high tier)
QUANTIZED_OTHER = ("int8", "int8-q4emb", "q4", "q4-out8", "q4-all")  # attention, embedding too
BENCH_WEIGHTS = ("float", "int8", "int8-q4emb", "q4")  # ``selectinfer bench``'s rows by default
