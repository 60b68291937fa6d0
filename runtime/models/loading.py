"""Loading HF-format models (safetensors directories at local paths) and checking that the
student and its teachers share one tokenizer.

Distillation compares log-probs token id by token id (teacher top-k ids index the student's
vocabulary), so every teacher must map text to the same ids as the student.
:func:`check_shared_vocabulary` refuses a job whose tokenizers differ and names the teacher and
the first difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kubedistill.api.spec import DistillationJobSpec

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def require_model_dir(path: str | Path, what: str) -> Path:
    """A local HF model directory (config.json + safetensors), else a one-line error."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{what}: {p} is not a HF model directory (no config.json)")
    if not any(p.glob("*.safetensors")):
        raise FileNotFoundError(f"{what}: {p} has no *.safetensors weights")
    return p


def is_vision_language(config: Any) -> bool:
    """Whether an HF config is a vision-language model's (Qwen-VL style: it has a vision_config)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """The transformers Auto class that builds a model of `config`: AutoModelForImageTextToText
    for a vision-language model (its ...ForConditionalGeneration: vision tower + language model +
    LM head, under the names of its checkpoint), AutoModelForCausalLM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_causal_lm(
    path: str | Path, *, dtype: str = "float32", what: str = "model", trust_remote_code: bool = False
) -> PreTrainedModel:
    """An AutoModelForCausalLM from a local safetensors directory, never from a hub; for a
    vision-language model (auto_model_class) its AutoModelForImageTextToText, which returns
    log-probs of text as a causal LM does, given the images."""
    import torch
    from transformers import AutoConfig

    if dtype not in _DTYPES:
        raise ValueError(f"{what}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    p = require_model_dir(path, what)
    config = AutoConfig.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
    model: PreTrainedModel = auto_model_class(config).from_pretrained(
        str(p), config=config, dtype=getattr(torch, dtype), local_files_only=True, trust_remote_code=trust_remote_code
    )
    return model


def load_tokenizer(
    path: str | Path, *, what: str = "tokenizer", trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{what}: {p} is not a directory")
    return AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)


def vocabulary_difference(student_tok: PreTrainedTokenizerBase, teacher_tok: PreTrainedTokenizerBase) -> str | None:
    """None when both tokenizers map every token to the same id, else what differs (one phrase)."""
    a, b = student_tok.get_vocab(), teacher_tok.get_vocab()
    if a == b:
        for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
            sa, sb = getattr(student_tok, attr, None), getattr(teacher_tok, attr, None)
            if sa is not None and sb is not None and sa != sb:
                return f"{attr} is {sa} for the student but {sb} for the teacher"
        return None
    if len(a) != len(b):
        head = f"vocabulary size {len(a)} (student) vs {len(b)} (teacher)"
    else:
        head = f"same size {len(a)} but different ids"
    for token in sorted(a.keys() | b.keys(), key=lambda t: (a.get(t, b.get(t, 0)), t)):
        ia, ib = a.get(token), b.get(token)
        if ia != ib:
            return f"{head}; first difference: token {token!r} is id {ia} in the student, {ib} in the teacher"
    return head  # unreachable in practice: different dicts differ at some token


def check_shared_vocabulary(
    student: str | Path, teachers: Mapping[str, str | Path], trust_remote_code: Mapping[str, bool] | None = None
) -> None:
    """Raise ValueError if any teacher's tokenizer differs from the student's (names the teacher).

    ``student`` and the ``teachers`` values are tokenizer directories (usually the model
    directories; spec.*.tokenizer when set); ``trust_remote_code`` by teacher name, and "" for the
    student.
    """
    trust = trust_remote_code or {}
    student_tok = load_tokenizer(student, what="student tokenizer", trust_remote_code=trust.get("", False))
    problems = []
    for name, path in teachers.items():
        teacher_tok = load_tokenizer(path, what=f"teacher {name!r} tokenizer", trust_remote_code=trust.get(name, False))
        diff = vocabulary_difference(student_tok, teacher_tok)
        if diff is not None:
            problems.append(f"teacher {name!r} ({path}): {diff}")
    if problems:
        raise ValueError("student and teachers must share one tokenizer: " + "; ".join(problems))


def check_job_vocabulary(spec: DistillationJobSpec) -> None:
    """check_shared_vocabulary for a DistillationJobSpec (tokenizer paths default to model paths);
    the trainer's rank 0 runs it when the job starts (runtime/entrypoints/trainer.py)."""
    student = spec.student.tokenizer or spec.student.model
    trust = {"": spec.student.trust_remote_code, **{t.name: t.trust_remote_code for t in spec.teachers}}
    check_shared_vocabulary(student, {t.name: t.tokenizer or t.model for t in spec.teachers}, trust)
