"""The DistillationJob API: models, CRD, CEL rules, the validate command."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from k8s_offline import CRD_FILE, apply_defaults, cel_violations, crd_schema, read_manifest, schema_errors
from kubedistill.api import DistillationJob
from kubedistill.api.base import MAX_SAFE_INT
from kubedistill.api.crd import crd, crd_yaml
from kubedistill.api.rules import KUEUE_FIXED_SIZE_MESSAGE, NAME_RULES, ROLLOUT_MUTABLE
from kubedistill.api.spec import RolloutSpec
from kubedistill.api.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
BROKEN = sorted((ROOT / "tests/manifests/broken").glob("*.yaml"))
# The committed CRD as the API server reads it (Go's YAML), not the Python dict it came from.
SCHEMA = crd_schema()


def _expected(path: Path) -> list[str]:
    return [line[len("# expect: ") :] for line in path.read_text().splitlines() if line.startswith("# expect: ")]


def _load(path: Path) -> dict:
    return read_manifest(path)


def test_committed_crd_is_generated() -> None:
    committed = (ROOT / "crds/kubedistill.io_distillationjobs.yaml").read_text()
    assert committed == crd_yaml(), "run `kubedistill crd > crds/kubedistill.io_distillationjobs.yaml`"


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for key, prop in schema.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_crd_schema_is_structural() -> None:
    free_form = set()
    for path, node in _walk(SCHEMA):
        assert "type" in node, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "$ref" not in node and "anyOf" not in node, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            free_form.add(path)
        if "default" in node:
            # Defaults must validate against their own node.
            assert not schema_errors(node["default"], {k: v for k, v in node.items() if k != "default"}), path
    # Only Kubernetes objects we pass through untouched are free-form.
    assert free_form == {
        ".spec.volumes[]",
        ".spec.volumeMounts[]",
        ".spec.tolerations[]",
        ".spec.affinity",
        ".spec.securityContext",
        ".spec.containerSecurityContext",
        ".spec.env[].valueFrom",
        ".spec.teachers[].overrides.env[].valueFrom",
        ".spec.rollout.overrides.env[].valueFrom",
        ".spec.trainer.overrides.env[].valueFrom",
        ".spec.environments[].overrides.env[].valueFrom",
        *(
            f".spec.{role}.overrides.{field}[]"
            for role in ("teachers[]", "rollout", "trainer", "environments[]")
            for field in ("volumes", "volumeMounts")
        ),
    }


def test_every_integer_field_is_bounded() -> None:
    """pydantic's int has no bound and the API server's is int64: a field without a maximum lets
    pydantic take 2^63 and above, which the server refuses (tests/test_k8s_api_server.py)."""
    unbounded = [
        path
        for path, node in _walk(SCHEMA)
        if node["type"] == "integer" and not ("minimum" in node and node.get("maximum", 2**64) <= MAX_SAFE_INT)
    ]
    assert unbounded == []


def test_crd_identity_and_columns() -> None:
    c = crd()
    assert c["metadata"]["name"] == "distillationjobs.kubedistill.io"
    assert c["spec"]["names"]["shortNames"] == ["dj", "distjob"]
    version = c["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
    assert [col["name"] for col in version["additionalPrinterColumns"]] == [
        "Mode",
        "Phase",
        "Step",
        "Score",
        "Trainer",
        "Rollout",
        "Teachers",
        "Age",
        "Message",
    ]
    # The message is long: only `kubectl get -o wide` shows it.
    assert version["additionalPrinterColumns"][-1] == {
        "name": "Message",
        "type": "string",
        "jsonPath": ".status.message",
        "priority": 1,
    }


def test_docstrings_reach_the_crd() -> None:
    async_ = SCHEMA["properties"]["spec"]["properties"]["async"]
    assert "fullyAsync" in async_["description"]
    assert "triggerParameterSyncStep" in async_["properties"]["stalenessThreshold"]["description"]


def test_model_defaults_equal_crd_defaults() -> None:
    # What the API server stores after defaulting must parse to the same spec as the raw manifest.
    for path in EXAMPLES:
        doc = _load(path)
        defaulted = apply_defaults(doc, SCHEMA)
        assert DistillationJob.model_validate(defaulted).spec == DistillationJob.model_validate(doc).spec


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_everywhere(path: Path) -> None:
    assert validate_file(path) == []
    doc = apply_defaults(_load(path), SCHEMA)
    assert schema_errors(doc, SCHEMA) == []
    assert list(cel_violations(doc, SCHEMA)) == []


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.name)
def test_broken_manifest_gets_its_message(path: Path) -> None:
    expected = _expected(path)
    assert expected, f"{path.name} declares no '# expect:' line"
    assert [f"{p.field}: {p.message}" if p.field else p.message for p in validate_file(path)] == expected


def _name_rule_line(message: str) -> str:
    for r in NAME_RULES:
        if message == f"metadata.name {r.message}":
            return f"metadata.name: {r.message}"
    return message


PARSEABLE = [p for p in BROKEN + EXAMPLES if p.name != "bad-yaml.yaml"]


@pytest.mark.parametrize("path", PARSEABLE, ids=lambda p: p.name)
def test_cel_and_python_rules_agree(path: Path) -> None:
    """Where a manifest passes the structural schema, the CRD's CEL rules (what the API server
    enforces) report exactly the Python model's cross-field problems, with the same messages."""
    doc = _load(path)
    if (
        not isinstance(doc, dict)
        or doc.get("apiVersion") != "kubedistill.io/v1alpha1"
        or doc.get("kind") != "DistillationJob"
    ):
        return
    doc = apply_defaults(doc, SCHEMA)
    if schema_errors(doc, SCHEMA):
        # The API server refuses these on the schema alone; the Python side must refuse too.
        assert validate_file(path)
        return
    cel = sorted(f"{p}: {m}" if p else _name_rule_line(m) for p, m in cel_violations(doc, SCHEMA))
    python = sorted(f"{p.field}: {p.message}" for p in validate_file(path))
    assert cel == python


def test_schema_catches_structural_errors() -> None:
    doc = apply_defaults(_load(ROOT / "tests/manifests/broken/unknown-field.yaml"), SCHEMA)
    assert any("minibatchSize" in e for e in schema_errors(doc, SCHEMA))
    doc = apply_defaults(_load(ROOT / "tests/manifests/broken/out-of-range.yaml"), SCHEMA)
    assert any("temperature" in e for e in schema_errors(doc, SCHEMA))


def test_immutable_fields_refuse_changes() -> None:
    old = apply_defaults(_load(ROOT / "examples/quickstart-cpu.yaml"), SCHEMA)
    new = apply_defaults(_load(ROOT / "examples/quickstart-cpu.yaml"), SCHEMA)
    new["spec"]["mode"] = "sync"
    new["spec"]["trainer"]["totalSteps"] = 99
    new["spec"]["suspend"] = True  # mutable
    new["spec"].pop("async")  # optional without a default: removing (or adding) it is a change too
    found = sorted(p for p, _ in cel_violations(new, SCHEMA, old=old))
    assert found == ["spec.async", "spec.mode", "spec.trainer"]
    assert "spec.async" in [p for p, _ in cel_violations(old, SCHEMA, old=new)]
    assert list(cel_violations(old, SCHEMA, old=old)) == []


def _node_at(path: str) -> dict:
    """The committed schema's node at a JSON path such as .spec.rollout.replicas."""
    node = SCHEMA
    for key in path.lstrip(".").split("."):
        node = node["properties"][key]
    return node


def test_scale_subresource_points_at_the_rollout_replicas() -> None:
    (version,) = read_manifest(CRD_FILE)["spec"]["versions"]
    scale = version["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.rollout.replicas",
        "statusReplicasPath": ".status.rolloutReplicas",
        "labelSelectorPath": ".status.rolloutSelector",
    }
    # The API server requires the spec path under .spec, the others under .status, and reads an
    # integer at both replicas paths and a string selector.
    assert scale["specReplicasPath"].startswith(".spec.") and scale["statusReplicasPath"].startswith(".status.")
    assert _node_at(scale["specReplicasPath"])["type"] == "integer"
    assert _node_at(scale["statusReplicasPath"])["type"] == "integer"
    assert _node_at(scale["labelSelectorPath"])["type"] == "string"


def _running(path: str = "examples/quickstart-cpu.yaml") -> dict:
    return apply_defaults(_load(ROOT / path), SCHEMA)


def test_rollout_replicas_may_change_on_a_running_job() -> None:
    old = _running()
    for replicas in (3, 1024, 1):
        new = _running()
        new["spec"]["rollout"]["replicas"] = replicas
        assert list(cel_violations(new, SCHEMA, old=old)) == [], replicas


def test_other_rollout_fields_stay_immutable() -> None:
    old = _running()
    # The CEL twin types a number by its JSON form (1 is an int, unlike the API server, which
    # types it by the schema): both temperatures are written as floats.
    old["spec"]["rollout"]["sampling"]["temperature"] = 0.9
    only = "only spec.rollout.replicas may change on a running job; delete and recreate the job to change it"
    new = copy.deepcopy(old)
    new["spec"]["rollout"]["replicas"] = 2
    new["spec"]["rollout"]["sampling"]["temperature"] = 0.7
    assert list(cel_violations(new, SCHEMA, old=old)) == [
        ("spec.rollout.sampling", f"spec.rollout.sampling is immutable: {only}")
    ]
    # gpus is optional without a default: adding it (or removing it) is refused at spec.rollout,
    # where both objects have the field to compare.
    new = copy.deepcopy(old)
    new["spec"]["rollout"]["gpus"] = 0
    assert list(cel_violations(new, SCHEMA, old=old)) == [
        ("spec.rollout.gpus", f"spec.rollout.gpus cannot be added or removed: {only}")
    ]
    assert [p for p, _ in cel_violations(old, SCHEMA, old=new)] == ["spec.rollout.gpus"]
    changed = copy.deepcopy(new)
    changed["spec"]["rollout"]["gpus"] = 1  # also wrong on device cpu, which a rule says too
    assert ("spec.rollout.gpus", f"spec.rollout.gpus is immutable: {only}") in cel_violations(changed, SCHEMA, old=new)


def test_every_rollout_field_but_replicas_has_a_transition_rule() -> None:
    rollout = _node_at(".spec.rollout")
    presence = {r.get("fieldPath") for r in rollout.get("x-kubernetes-validations", [])}
    for name, info in RolloutSpec.model_fields.items():
        key = info.alias or name
        rules = [r["rule"] for r in rollout["properties"][key].get("x-kubernetes-validations", [])]
        if key in ROLLOUT_MUTABLE:
            assert rules == [], key
            continue
        assert rules == ["self == oldSelf"], key
        if "default" not in rollout["properties"][key]:
            assert f".{key}" in presence, key


def test_kueue_refuses_scaling_the_rollout() -> None:
    old = _running("examples/gang-kueue.yaml")
    new = _running("examples/gang-kueue.yaml")
    new["spec"]["rollout"]["replicas"] = 3
    assert list(cel_violations(new, SCHEMA, old=old)) == [("spec.rollout.replicas", KUEUE_FIXED_SIZE_MESSAGE)]
    for path in ("examples/gang-volcano.yaml", "examples/gang-coscheduling.yaml"):
        old = _running(path)
        new = _running(path)
        new["spec"]["rollout"]["replicas"] += 1
        assert list(cel_violations(new, SCHEMA, old=old)) == [], path


def test_routing() -> None:
    job = DistillationJob.model_validate(_load(ROOT / "examples/multi-teacher-6gpu.yaml"))
    assert job.spec.teacher_for("gsm8k").name == "math"
    assert job.spec.teacher_for("geo3k").name == "vision"
    with pytest.raises(LookupError, match="data_source='mbpp'"):
        job.spec.teacher_for("mbpp")
    single = DistillationJob.model_validate(_load(ROOT / "examples/one-gpu.yaml"))
    assert single.spec.teacher_for("anything").name == "teacher"


def test_gpu_defaults_follow_device() -> None:
    cpu = DistillationJob.model_validate(_load(ROOT / "examples/quickstart-cpu.yaml")).spec
    gpu = DistillationJob.model_validate(_load(ROOT / "examples/multi-teacher-6gpu.yaml")).spec
    assert cpu.gpus_of(cpu.rollout.gpus) == 0 and gpu.gpus_of(gpu.rollout.gpus) == 1


def test_validate_cli_exit_codes_and_lines(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "kubedistill.cli", "validate"]
    ok = subprocess.run([*cli, *map(str, EXAMPLES)], capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run([*cli, *map(str, BROKEN)], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stdout + bad.stderr
    lines = bad.stdout.splitlines()
    assert len(lines) == sum(len(_expected(p)) for p in BROKEN)
    missing = tmp_path / "nope.yaml"
    r = subprocess.run([*cli, str(missing)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout.startswith(f"{missing}: cannot read file")


def test_multi_document_file_names_the_document(tmp_path: Path) -> None:
    good = (ROOT / "examples/one-gpu.yaml").read_text()
    bad = (ROOT / "tests/manifests/broken/bad-enum.yaml").read_text()
    f = tmp_path / "two.yaml"
    f.write_text(good + "\n---\n" + bad)
    assert [str(p) for p in validate_file(f)] == [
        f"{f} (document 2): spec.mode: Input should be 'sync', 'oneStepOff' or 'fullyAsync' (got 'turbo')"
    ]


def test_api_reference_is_current() -> None:
    from kubedistill.api.reference import api_reference

    assert (ROOT / "docs/api.md").read_text() == api_reference(), "run `kubedistill api-docs > docs/api.md`"


def test_async_settings_give_the_defaults_of_an_unset_async() -> None:
    from kubedistill.api.spec import AsyncSpec

    doc = _load(ROOT / "examples/quickstart-cpu.yaml")
    doc["spec"].pop("async", None)
    doc["spec"]["mode"] = "sync"
    assert DistillationJob.model_validate(doc).spec.async_settings == AsyncSpec()
    doc["spec"]["mode"] = "fullyAsync"
    doc["spec"]["async"] = {"requireBatches": 3, "stalenessThreshold": 0.5}
    settings = DistillationJob.model_validate(doc).spec.async_settings
    assert (settings.require_batches, settings.staleness_threshold, settings.oversample) == (3, 0.5, 1.0)


@pytest.mark.parametrize(
    ("mode", "threshold", "accepted"),
    [("sync", 0.0, True), ("sync", 1.0, False), ("oneStepOff", 1.0, True), ("oneStepOff", 0.0, False)],
)
def test_a_staleness_threshold_outside_fully_async_must_be_the_one_the_mode_fixes(
    mode: str, threshold: float, accepted: bool
) -> None:
    """sync runs at staleness 0 and oneStepOff at 1: writing that value out is honoured, any
    other (an explicit 0 in oneStepOff included) is refused by the model and by the CEL rule."""
    doc = _load(ROOT / "tests/manifests/broken/staleness-threshold-in-one-step-off.yaml")
    doc["spec"]["mode"] = mode
    doc["spec"]["async"] = {"stalenessThreshold": threshold, "requireBatches": 2}
    cel = list(cel_violations(apply_defaults(copy.deepcopy(doc), SCHEMA), SCHEMA))
    assert (cel == []) is accepted, cel
    try:
        DistillationJob.model_validate(doc)
        python_accepted = True
    except ValueError:
        python_accepted = False
    assert python_accepted is accepted
    # Unset, as the API server leaves it (no default in the schema), is the mode's own value.
    doc["spec"]["async"] = {"requireBatches": 2}
    assert list(cel_violations(apply_defaults(copy.deepcopy(doc), SCHEMA), SCHEMA)) == []
    assert DistillationJob.model_validate(doc).spec.async_settings.staleness_threshold is None
