"""spec.trainer.lora (LoRA students): defaults, bounds, and each rule refused alike by the Python
model, `kubedistill validate` and the CRD's CEL twin. The real API server judges the same
variants in tests/test_k8s_api_server.py."""

from __future__ import annotations

import ast
import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from k8s_offline import apply_defaults, cel_violations, crd_schema, read_manifest, schema_errors
from kubedistill.api import DistillationJob, kubeyaml
from kubedistill.api.enums import LORA_MAX_RANK, VLLM_MAX_LORA_RANKS, vllm_max_lora_rank
from kubedistill.api.rules import SPEC_RULES
from kubedistill.api.spec import LoraExport, LoraServeAs, LoraSpec, TrainerSpec
from kubedistill.api.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = crd_schema()
MODULES = "spec.trainer.lora.targetModules"


def _message(field: str, start: str) -> str:
    """The one rule message at `field` starting with `start` (the test fails on none or several)."""
    (message,) = [r.message for r in SPEC_RULES if r.path == field and r.message.startswith(start)]
    return message


ALONE = _message(MODULES, "all-linear must be the only entry")
NAMES = _message(MODULES, "each entry must be all-linear or a module's leaf name")
TWICE = _message(MODULES, "must not name a module twice")


def lora_job(lora: dict[str, Any] | None, **spec: Any) -> dict[str, Any]:
    """The one-GPU example (device cuda, vLLM) with `lora` as spec.trainer.lora and `spec`
    merged over its top-level spec fields."""
    doc: dict[str, Any] = read_manifest(ROOT / "examples/one-gpu.yaml")
    if lora is not None:
        doc["spec"]["trainer"]["lora"] = lora
    doc["spec"].update(spec)
    return doc


def cpu_hf_job(lora: dict[str, Any]) -> dict[str, Any]:
    """A CPU job whose rollout servers run the hf engine."""
    doc: dict[str, Any] = read_manifest(ROOT / "examples/quickstart-cpu.yaml")
    doc["spec"]["rollout"]["inference"] = {"engine": "hf"}
    doc["spec"]["trainer"]["lora"] = lora
    return doc


def validate_lines(doc: dict[str, Any], tmp_path: Path) -> list[str]:
    """`kubedistill validate`'s problems of the manifest a user would write, as `field: message`."""
    f = tmp_path / "job.yaml"
    f.write_text(kubeyaml.dump(doc))
    problems = validate_file(f)
    assert all("\n" not in str(p) for p in problems), "one line per problem"
    return [f"{p.field}: {p.message}" for p in problems]


def cel_lines(doc: dict[str, Any]) -> list[str]:
    """What the API server's CEL rules say about the (defaulted) manifest, which the schema takes."""
    defaulted = apply_defaults(doc, SCHEMA)
    assert schema_errors(defaulted, SCHEMA) == []
    return [f"{path}: {message}" for path, message in cel_violations(defaulted, SCHEMA)]


# -- defaults and bounds --------------------------------------------------------------------------


def test_lora_is_off_by_default() -> None:
    assert TrainerSpec().lora is None
    assert DistillationJob.model_validate(lora_job(None)).spec.trainer.lora is None


def test_lora_defaults() -> None:
    lora = LoraSpec()
    assert (lora.rank, lora.alpha, lora.dropout) == (8, 16, 0.0)
    assert lora.target_modules == ["all-linear"]
    assert lora.serve_as is LoraServeAs.merged and lora.export is LoraExport.merged
    # An empty lora: block turns LoRA on with those defaults, and the CRD's defaulting gives the
    # same spec as the model's.
    doc = lora_job({})
    assert DistillationJob.model_validate(doc).spec.trainer.lora == lora
    defaulted = apply_defaults(doc, SCHEMA)
    assert defaulted["spec"]["trainer"]["lora"] == lora.to_api()
    assert DistillationJob.model_validate(defaulted).spec == DistillationJob.model_validate(doc).spec


def test_lora_schema_bounds_match_the_model() -> None:
    lora = SCHEMA["properties"]["spec"]["properties"]["trainer"]["properties"]["lora"]
    assert "default" not in lora, "no lora block: full fine-tuning"
    props = lora["properties"]
    assert (props["rank"]["minimum"], props["rank"]["maximum"]) == (1, LORA_MAX_RANK) == (1, 512)
    assert props["dropout"]["exclusiveMaximum"] is True and props["dropout"]["maximum"] == 1.0
    assert (props["alpha"]["minimum"], props["alpha"]["maximum"]) == (1, 65536)
    assert props["targetModules"]["minItems"] == 1 and props["serveAs"]["enum"] == ["merged", "adapter"]
    assert props["export"]["enum"] == ["merged", "adapter"]


@pytest.mark.parametrize(
    "lora,field",
    [
        ({"rank": 0}, "rank"),
        ({"rank": LORA_MAX_RANK + 1}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"targetModules": []}, "targetModules"),
        ({"targetModules": [""]}, "targetModules[0]"),
        ({"targetModules": ["x" * 129]}, "targetModules[0]"),
        ({"serveAs": "lora"}, "serveAs"),
        ({"export": "peft"}, "export"),
        ({"r": 8}, "r"),
    ],
    ids=lambda v: str(v),
)
def test_out_of_bounds_is_refused_by_schema_and_validate(lora: dict[str, Any], field: str, tmp_path: Path) -> None:
    doc = lora_job(lora)
    errors = schema_errors(apply_defaults(doc, SCHEMA), SCHEMA)
    assert errors, "the API server's schema takes it"
    lines = validate_lines(doc, tmp_path)
    assert len(lines) == 1 and lines[0].startswith(f"spec.trainer.lora.{field}: "), lines


def test_rank_bound_is_vllms_largest_max_lora_rank() -> None:
    assert LORA_MAX_RANK == max(VLLM_MAX_LORA_RANKS)
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 33, 257, 300, 321, 512)] == [
        1, 8, 8, 16, 16, 64, 320, 320, 512, 512,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="rank 512 at most"):
        vllm_max_lora_rank(513)


def test_vllm_max_lora_ranks_are_vllms() -> None:
    # Read from vLLM's source rather than imported: importing vLLM takes seconds and sets up its
    # logging and environment.
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations))) / "config" / "lora.py"
    ranks = next(
        node.value.slice
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MaxLoRARanks" for t in node.targets)
        if isinstance(node.value, ast.Subscript)
    )
    assert list(ast.literal_eval(ranks)) == list(VLLM_MAX_LORA_RANKS)


# -- valid LoRA specs ----------------------------------------------------------------------------------

VALID: dict[str, dict[str, Any]] = {
    "defaults": {},
    "attention-as-adapter": {
        "rank": 16,
        "alpha": 32,
        "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "serveAs": "adapter",
        "export": "adapter",
    },
    "largest-rank-all-linear": {"rank": LORA_MAX_RANK, "targetModules": ["all-linear"], "serveAs": "adapter"},
    # Dropout is allowed: the trainer's log-probs then differ from the rollout engine's (documented).
    "dropout": {"rank": 1, "dropout": 0.05, "targetModules": ["_private", "W_pack", "c_attn"]},
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_lora_spec_is_accepted_everywhere(name: str, tmp_path: Path) -> None:
    doc = lora_job(VALID[name])
    assert validate_lines(doc, tmp_path) == []
    assert cel_lines(doc) == []
    lora = DistillationJob.model_validate(doc).spec.trainer.lora
    assert lora is not None and lora.to_api() == {**LoraSpec().to_api(), **VALID[name]}


@pytest.mark.parametrize("serve_as", ["merged", "adapter"])
def test_lora_runs_on_the_hf_engine_either_way(serve_as: str, tmp_path: Path) -> None:
    doc = cpu_hf_job({"serveAs": serve_as})
    assert validate_lines(doc, tmp_path) == [] and cel_lines(doc) == []


# -- rules: Python (validate) and CEL say the same line ---------------------------------------------------

# (manifest, the lines both must say, in rule order)
BROKEN: dict[str, tuple[dict[str, Any], list[str]]] = {
    "all-linear-with-a-name": (lora_job({"targetModules": ["all-linear", "q_proj"]}), [f"{MODULES}: {ALONE}"]),
    "name-with-all-linear": (lora_job({"targetModules": ["q_proj", "all-linear"]}), [f"{MODULES}: {ALONE}"]),
    # Only the repetition is wrong here, and only it is reported.
    "all-linear-twice": (lora_job({"targetModules": ["all-linear", "all-linear"]}), [f"{MODULES}: {TWICE}"]),
    "dotted-path": (lora_job({"targetModules": ["model.layers.0.self_attn.q_proj"]}), [f"{MODULES}: {NAMES}"]),
    "leading-digit": (lora_job({"targetModules": ["0_proj"]}), [f"{MODULES}: {NAMES}"]),
    "hyphen": (lora_job({"targetModules": ["q-proj"]}), [f"{MODULES}: {NAMES}"]),
    "space": (lora_job({"targetModules": ["q_proj "]}), [f"{MODULES}: {NAMES}"]),
    "trailing-newline": (lora_job({"targetModules": ["q_proj\n"]}), [f"{MODULES}: {NAMES}"]),
    "regex": (lora_job({"targetModules": [".*_proj"]}), [f"{MODULES}: {NAMES}"]),
    "all-linear-upper-case": (lora_job({"targetModules": ["ALL-LINEAR"]}), [f"{MODULES}: {NAMES}"]),
    "duplicate": (lora_job({"targetModules": ["q_proj", "v_proj", "q_proj"]}), [f"{MODULES}: {TWICE}"]),
    "everything-at-once": (
        lora_job({"targetModules": ["all-linear", "a.b", "a.b"]}),
        [f"{MODULES}: {ALONE}", f"{MODULES}: {NAMES}", f"{MODULES}: {TWICE}"],
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_lora_rule_is_refused_alike_by_python_and_cel(name: str, tmp_path: Path) -> None:
    doc, expected = BROKEN[name]
    assert validate_lines(doc, tmp_path) == expected
    assert cel_lines(doc) == expected


def test_lora_rules_hold_without_lora(tmp_path: Path) -> None:
    """No lora block: the rules read nothing (CEL guards every one with has(self.trainer.lora))."""
    doc = cpu_hf_job({})
    del doc["spec"]["trainer"]["lora"]
    assert validate_lines(doc, tmp_path) == [] and cel_lines(doc) == []


def test_lora_rules_and_messages_are_documented() -> None:
    api_md = (ROOT / "docs/api.md").read_text()
    for message in (ALONE, NAMES, TWICE):
        assert message in api_md
    assert "targetModules: [q_proj, k_proj, v_proj, o_proj]" in api_md  # the example


def test_documented_example_is_valid(tmp_path: Path) -> None:
    """The YAML snippet under spec.trainer.lora in docs/api.md, merged into a job, is valid."""
    api_md = (ROOT / "docs/api.md").read_text()
    section = api_md.split("## `spec.trainer.lora`", 1)[1]
    snippet = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    lora = kubeyaml.load_all(snippet)[0]["spec"]["trainer"]["lora"]
    doc = lora_job(copy.deepcopy(lora))
    assert validate_lines(doc, tmp_path) == [] and cel_lines(doc) == []
