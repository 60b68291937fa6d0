"""Model loading, the shared-vocabulary check, and the SmolLM2 GGUF -> safetensors conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kubedistill.runtime.models.loading import check_shared_vocabulary, load_causal_lm, require_model_dir

torch.set_num_threads(1)


def test_student_and_teacher_sharing_a_tokenizer_pass(tiny_models: dict[str, Path]) -> None:
    check_shared_vocabulary(tiny_models["student"], {"math": tiny_models["teacher"]})


def test_different_tokenizer_names_the_teacher_and_the_difference(
    tiny_models: dict[str, Path], tiny_bpe_model: Path
) -> None:
    with pytest.raises(ValueError) as err:
        check_shared_vocabulary(tiny_models["student"], {"math": tiny_models["teacher"], "prose": tiny_bpe_model})
    msg = str(err.value)
    assert "teacher 'prose'" in msg and "'math'" not in msg
    assert "vocabulary size 16 (student) vs 300 (teacher)" in msg
    assert "first difference: token" in msg


def test_same_size_different_ids_is_refused(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    from kubedistill.demo.tiny import char_tokenizer

    char_tokenizer("1023456789+=", out_dir=tmp_path / "swapped")
    with pytest.raises(
        ValueError,
        match=r"same size 16 but different ids; first difference: token '0' is id 4 in the student, 5 in the teacher",
    ):
        check_shared_vocabulary(tiny_models["student"], {"t": tmp_path / "swapped"})


def test_load_refuses_a_non_model_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="spec.student.model: .* is not a HF model directory"):
        require_model_dir(tmp_path, "spec.student.model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_causal_lm(tmp_path, what="spec.student.model")


def test_tiny_bpe_model_loads(tiny_bpe_model: Path) -> None:
    model = load_causal_lm(tiny_bpe_model)
    assert model.config.model_type == "llama" and model.config.head_dim == 64
    assert model.config.vocab_size == 300


def test_smollm2_converted_from_gguf_is_a_working_hf_model(smollm2: Path, tiny_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    assert json.loads((smollm2 / "config.json").read_text())["num_hidden_layers"] == 30
    assert "quantization_config" not in json.loads((smollm2 / "config.json").read_text())
    model = load_causal_lm(smollm2)
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert len(tok) == model.config.vocab_size == 49152
    # Dequantised weights still know things: "Paris" is the likeliest next token.
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert tok.decode(int(logits.argmax())).strip() == "Paris"
    # And its tokenizer is not the tiny models' one.
    with pytest.raises(ValueError, match="vocabulary size 49152 \\(student\\) vs 16 \\(teacher\\)"):
        check_shared_vocabulary(smollm2, {"tiny": tiny_models["student"]})


def test_the_trainer_refuses_teachers_of_another_tokenizer_when_it_starts(
    tiny_models: dict[str, Path], tiny_bpe_model: Path
) -> None:
    """Rank 0 checks the job's tokenizers before it loads a model; the failure is one line."""
    from kubedistill.api.progress import TrainerProgress
    from kubedistill.api.roleconfig import Endpoints, JobConfig
    from kubedistill.api.spec import DistillationJobSpec
    from kubedistill.runtime.entrypoints.trainer import _build
    from kubedistill.runtime.metrics import RoleMetrics

    spec = DistillationJobSpec.model_validate(
        {
            "device": "cpu",
            "student": {"model": str(tiny_models["student"])},
            "teachers": [
                {"name": "math", "model": str(tiny_models["teacher"]), "match": {"dataSource": ["math"]}},
                {"name": "prose", "model": str(tiny_bpe_model), "match": {"dataSource": ["prose"]}},
            ],
            "trainer": {"miniBatchSize": 4},
            "data": {"train": ["/dev/null"]},
        }
    )
    endpoints = Endpoints(trainer="http://127.0.0.1:1", master_addr="127.0.0.1", rollout=[], teachers={})
    config = JobConfig(job="vocab", spec=spec, endpoints=endpoints)
    with pytest.raises(ValueError) as err:
        _build(config, RoleMetrics("vocab", "trainer", 0), TrainerProgress(total_steps=1), lambda: [])
    assert str(err.value).startswith("student and teachers must share one tokenizer: teacher 'prose'")
    assert "\n" not in str(err.value)
