"""spec.environments[] and spec.rollout.multiTurn as the API, the operator and `kubedistill run`
take them: defaults, routing, the refusals (the broken manifests of tests/test_api.py carry the
rest), the environment pods and Services with config.json's endpoints.environments, and the local
processes. The driver's use of them (episodes, actionKey, observationKey, maxTurns, ...) is tested
with the driver."""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from k8s_offline import apply_defaults, cel_violations, crd_schema, schema_errors
from kubedistill.api.job import DistillationJob
from kubedistill.api.roleconfig import JobConfig, Role
from kubedistill.api.spec import DistillationJobSpec, EnvironmentProtocol, ObservationRole
from kubedistill.api.validate import row_problems, validate_file
from kubedistill.operator.observed import ChildRef, Observed, PodPhase, PodView
from kubedistill.operator.policy import JobView, plan
from kubedistill.operator.render import (
    CONFIG_KEY,
    KUEUE_ROLE_HASH_ANNOTATION,
    KUEUE_TOTAL_ANNOTATION,
    LABEL_ATTEMPT,
    LABEL_ENVIRONMENT,
    min_member,
    render_children,
    render_static,
    slots,
)
from kubedistill.runtime.entrypoints import local
from kubedistill.runtime.entrypoints.local import expand_references, local_processes
from kubedistill.runtime.entrypoints.supervisor import Observed as LocalObserved
from kubedistill.runtime.entrypoints.supervisor import Supervised, SupervisorStatus, decide
from operator_fixtures import BASE_SPEC, job_manifest
from pod_security import restricted_violations

SPEC: dict[str, Any] = {
    **copy.deepcopy(BASE_SPEC),
    "environments": [
        {
            "name": "calc",
            "image": "registry.example/calc-env:1",
            "command": ["uvicorn", "calc_env.server:app", "--host", "0.0.0.0", "--port", "$(PORT)"],
            "port": 9000,
            "replicas": 2,
            "match": {"dataSource": ["calculator"]},
            "overrides": {"resources": {"requests": {"cpu": "500m"}}},
        },
        {"name": "chat", "command": ["python", "-m", "chat_env"]},
    ],
    "rollout": {**BASE_SPEC["rollout"], "multiTurn": {"maxTurns": 6, "maxTraceTokens": 2048}},
}
"""BASE_SPEC with two environments: calc (its own image and port, rows of data_source calculator)
and chat (spec.image, port 8000, every other row)."""
T0 = "2026-01-01T00:00:00Z"


def _job(spec: dict[str, Any] | None = None, name: str = "j") -> DistillationJob:
    return DistillationJob.model_validate(job_manifest(name, copy.deepcopy(spec or SPEC)))


def test_a_job_with_environments_passes_the_schema_cel_and_python() -> None:
    doc = job_manifest("j", copy.deepcopy(SPEC))
    schema = crd_schema()
    defaulted = apply_defaults(doc, schema)
    assert schema_errors(defaulted, schema) == []
    assert list(cel_violations(defaulted, schema)) == []
    assert DistillationJob.model_validate(defaulted).spec == _job().spec


def test_defaults_of_an_environment_and_of_multi_turn() -> None:
    spec = DistillationJobSpec.model_validate(
        {
            **BASE_SPEC,
            "environments": [{"name": "calc", "command": ["calc"]}],
            "rollout": {"multiTurn": {}, "sampling": {"maxTokens": 100}},
        }
    )
    e = spec.environments[0]
    assert (e.image, e.port, e.replicas, e.match, e.protocol) == (None, 8000, 1, None, EnvironmentProtocol.openenv)
    assert (e.action_key, e.observation_key, e.timeout_seconds) == ("message", None, 30)
    mt = spec.rollout.multi_turn
    assert mt is not None and (mt.max_turns, mt.max_trace_tokens, mt.observation_role) == (
        4,
        None,
        ObservationRole.tool,
    )
    assert spec.max_trace_tokens == 400  # maxTurns x sampling.maxTokens while unset
    assert _job().spec.max_trace_tokens == 2048
    assert DistillationJobSpec.model_validate(BASE_SPEC).max_trace_tokens == 1024  # single-turn: maxTokens


def test_a_row_goes_to_the_environment_that_matches_it_else_to_the_one_without_match() -> None:
    spec = _job().spec
    assert spec.environment_for("calculator").name == "calc"
    assert spec.environment_for("anything else").name == "chat"
    only_matched = copy.deepcopy(SPEC)
    del only_matched["environments"][1]
    with pytest.raises(LookupError, match="no environment matches data_source='poetry'"):
        _job(only_matched).spec.environment_for("poetry")


def _write_rows(path: Path, sources: list[str]) -> None:
    path.write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": "q"}], "data_source": s}) + "\n" for s in sources)
    )


def test_validate_refuses_a_row_no_environment_serves_and_an_environment_no_row_reaches(tmp_path: Path) -> None:
    spec = copy.deepcopy(SPEC)
    del spec["environments"][1]  # calc alone: rows of other sources route nowhere
    spec["environments"].append({"name": "search", "command": ["s"], "match": {"dataSource": ["hotpotqa"]}})
    spec["data"] = {"train": ["data/train.jsonl"], "val": ["data/val.jsonl"]}
    (tmp_path / "data").mkdir()
    _write_rows(tmp_path / "data/train.jsonl", ["calculator", "gsm8k", "calculator", "gsm8k"])
    _write_rows(tmp_path / "data/val.jsonl", ["calculator", "mbpp"])
    manifest = tmp_path / "job.yaml"
    manifest.write_text(json.dumps(job_manifest("j", spec)))
    lines = [str(p) for p in validate_file(manifest, data_base=tmp_path)]
    assert lines == [
        f"{manifest}: spec.data.train[0]: row 2: data_source 'gsm8k' routes to no environment (no"
        " spec.environments[].match.dataSource holds it, and every environment has a match)",
        f"{manifest}: spec.data.val[0]: row 2: data_source 'mbpp' routes to no environment (no"
        " spec.environments[].match.dataSource holds it, and every environment has a match)",
        f"{manifest}: spec.environments[1]: no row of spec.data.train routes to environment 'search'"
        " (match.dataSource ['hotpotqa'])",
    ]
    # Every row routed (chat takes the rest) and every environment reached: nothing to say.
    parsed = _job().spec.model_copy(update={"data": _job(spec).spec.data})
    _write_rows(tmp_path / "data/val.jsonl", ["calculator"])
    assert row_problems(parsed, "job.yaml", tmp_path) == []
    # An environment without match that no row falls to is named too.
    _write_rows(tmp_path / "data/train.jsonl", ["calculator"])
    assert [p.message for p in row_problems(parsed, "job.yaml", tmp_path)] == [
        "no row of spec.data.train routes to environment 'chat' (no match: every other row)"
    ]
    # Data files that are not on this machine (a cluster's paths) are not checked.
    assert row_problems(parsed, "job.yaml", tmp_path / "elsewhere") == []


def test_validate_reads_the_routing_column_of_parquet_files(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"data_source": ["calculator", "gsm8k"]}), tmp_path / "train.parquet")
    spec = copy.deepcopy(SPEC)
    del spec["environments"][1]
    spec["data"] = {"train": [str(tmp_path / "train.parquet")]}
    assert [p.message for p in row_problems(_job(spec).spec, "job.yaml", tmp_path)] == [
        "row 2: data_source 'gsm8k' routes to no environment (no spec.environments[].match.dataSource holds it,"
        " and every environment has a match)"
    ]


def test_environment_pods_and_services_and_the_configs_endpoints() -> None:
    children = render_children("j", "ml", _job().spec)
    pods = {o["metadata"]["name"]: o for o in children if o["kind"] == "Pod"}
    assert [n for n in pods if "-env-" in n] == ["j-env-calc-0", "j-env-calc-1", "j-env-chat-0"]
    calc, chat = pods["j-env-calc-1"], pods["j-env-chat-0"]
    c = calc["spec"]["containers"][0]
    assert calc["metadata"]["labels"]["kubedistill.io/role"] == "environment"
    assert calc["metadata"]["labels"][LABEL_ENVIRONMENT] == "calc"
    assert (calc["spec"]["hostname"], calc["spec"]["subdomain"], calc["spec"]["restartPolicy"]) == (
        "calc-1",
        "j-e-calc",
        "Never",
    )
    assert c["image"] == "registry.example/calc-env:1"
    assert c["command"] == ["uvicorn", "calc_env.server:app", "--host", "0.0.0.0", "--port", "$(PORT)"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PORT"] == "9000" and env["KUBEDISTILL_ENVIRONMENT"] == "calc" and env["HOME"] == "/tmp"
    assert c["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"}}  # its overrides over the cpu default
    assert LABEL_ATTEMPT not in calc["metadata"]["labels"]  # not in the trainer gang
    assert chat["spec"]["containers"][0]["image"] == _job().spec.image  # no image of its own: spec.image
    # No command: the image's own entrypoint (the spec needs it, with an image of its own).
    no_command = copy.deepcopy(SPEC)
    del no_command["environments"][0]["command"]
    pod = next(o for o in render_children("j", "ml", _job(no_command).spec) if o["metadata"]["name"] == "j-env-calc-0")
    assert "command" not in pod["spec"]["containers"][0]
    services = {o["metadata"]["name"]: o for o in children if o["kind"] == "Service"}
    assert services["j-e-calc"]["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert services["j-e-calc"]["spec"]["selector"] == {
        "kubedistill.io/job": "j",
        "kubedistill.io/role": "environment",
        LABEL_ENVIRONMENT: "calc",
    }
    assert services["j-e-chat"]["spec"]["clusterIP"] == "None"
    config_map = next(o for o in children if o["kind"] == "ConfigMap")
    config = JobConfig.model_validate_json(config_map["data"][CONFIG_KEY])
    assert config.endpoints.environments == {
        "calc": ["http://calc-0.j-e-calc.ml.svc:9000", "http://calc-1.j-e-calc.ml.svc:9000"],
        "chat": ["http://chat-0.j-e-chat.ml.svc:8000"],
    }
    # Valid Kubernetes objects, admitted by Pod Security "restricted".
    for obj in children:
        kubernetes_validate.validate(json.loads(json.dumps(obj)), "1.33.0", strict=True)
    assert all(restricted_violations(p) == [] for p in pods.values())
    # A job without environments keeps an empty map.
    assert (
        JobConfig.model_validate_json(
            next(
                o
                for o in render_static("j", "ml", DistillationJobSpec.model_validate(BASE_SPEC))
                if o["kind"] == "ConfigMap"
            )["data"][CONFIG_KEY]
        ).endpoints.environments
        == {}
    )


def test_environment_pods_count_in_the_gang_schedulers_groups() -> None:
    spec = copy.deepcopy(SPEC)
    spec["scheduling"] = {"gangScheduler": "kueue", "queue": "ml"}
    pods = {o["metadata"]["name"]: o for o in render_children("j", "ml", _job(spec).spec) if o["kind"] == "Pod"}
    assert len(pods) == 2 + 2 + 1 + 3
    assert {p["metadata"]["annotations"][KUEUE_TOTAL_ANNOTATION] for p in pods.values()} == {"8"}
    assert pods["j-env-calc-0"]["metadata"]["annotations"][KUEUE_ROLE_HASH_ANNOTATION] == "e-calc"
    assert pods["j-teacher-math-0"]["metadata"]["annotations"][KUEUE_ROLE_HASH_ANNOTATION] == "t-math"
    spec["scheduling"] = {"gangScheduler": "volcano", "minMember": 8}  # every pod, environments too
    assert min_member(_job(spec).spec) == 8


def _world(job: JobView) -> Observed:
    spec = DistillationJobSpec.model_validate(dict(job.spec))
    others = {ChildRef(o["kind"], o["metadata"]["name"]) for o in render_static("j", "ml", spec)}
    pods = {}
    for s in slots(spec):
        pods[s.pod_name("j")] = PodView(
            name=s.pod_name("j"),
            role=s.role,
            replica=s.replica,
            teacher=s.teacher,
            environment=s.environment,
            attempt=0 if s.role is Role.trainer else None,
            phase=PodPhase.running,
            ready=True,
        )
    return Observed(pods=pods, others=others)


def test_a_failed_environment_pod_is_replaced_alone_and_the_job_waits_for_one_ready() -> None:
    from datetime import datetime

    now = datetime.fromisoformat(T0.replace("Z", "+00:00"))
    job = JobView(
        name="j", namespace="ml", generation=1, spec=copy.deepcopy(SPEC), status={"phase": "Running", "startTime": T0}
    )
    world = _world(job)
    p = plan(job, world, now)
    assert p.status.phase.value == "Running" and p.status.roles["environment/calc"].ready == 2
    world.pods["j-env-calc-0"] = PodView(
        **{**world.pods["j-env-calc-0"].__dict__, "phase": PodPhase.failed, "ready": False}
    )
    p = plan(job, world, now)
    assert {r.name for r in p.delete if r.kind == "Pod"} == {"j-env-calc-0"}
    assert [e.reason for e in p.events] == ["ServerReplaced"] and p.status.restarts == 0
    assert "environment/calc pod j-env-calc-0 failed" in p.events[0].message
    assert p.status.phase.value == "Running"  # calc-1 still serves
    # Its only pod not ready, chat holds the job back from Running, as a teacher would.
    world.pods["j-env-chat-0"] = PodView(**{**world.pods["j-env-chat-0"].__dict__, "ready": False})
    del world.pods["j-env-calc-0"]
    p = plan(job, world, now)
    assert [o["metadata"]["name"] for o in p.create] == ["j-env-calc-0"]
    assert p.status.phase.value == "Pending"
    assert "environments 1/3" in next(c.message for c in p.status.conditions if c.type.value == "Ready")


def test_run_starts_each_environment_replica_on_its_own_port(tmp_path: Path) -> None:
    config, procs = local_processes(_job(), tmp_path / "config.json")
    envs = [p for p in procs if p.identity.role is Role.environment]
    assert [p.name for p in envs] == ["env-calc-0", "env-calc-1", "env-chat-0"]
    assert procs[: len(envs)] == envs  # started first, before the servers and the trainer
    ports = [p.port for p in envs]
    assert len(set(ports)) == 3 and all(p.env["PORT"] == str(p.port) for p in envs)
    assert envs[1].argv == ["uvicorn", "calc_env.server:app", "--host", "0.0.0.0", "--port", str(ports[1])]
    assert envs[2].argv == ["python", "-m", "chat_env"] and envs[2].gpus == 0
    assert envs[0].env["KUBEDISTILL_ENVIRONMENT"] == "calc"
    assert config.endpoints.environments == {
        "calc": [f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"],
        "chat": [f"http://127.0.0.1:{ports[2]}"],
    }


def test_run_refuses_an_environment_without_a_command_in_one_line(tmp_path: Path) -> None:
    spec = copy.deepcopy(SPEC)
    del spec["environments"][0]["command"]  # calc has an image: fine on Kubernetes
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job_manifest("j", spec)))
    lines: list[str] = []
    assert local.prepare(path, tmp_path / "run", lines.append) is None
    assert lines == [
        f"{path}: spec.environments[0].command: required by `kubedistill run`, which runs the environment"
        " server as a local process (the image's own entrypoint serves only on Kubernetes)"
    ]


def test_an_environment_process_that_exits_ends_the_run_as_a_servers_does() -> None:
    job = Supervised(("trainer-0",), backoff_limit=3, active_deadline_seconds=None, started=0.0)
    actions = decide(LocalObserved(job, SupervisorStatus(), {"trainer-0": None, "env-calc-0": 1}), None, 1.0)
    assert actions.finish is not None and actions.finish.reason == "ProcessFailed"
    assert actions.finish.result == "env-calc-0 exited with 1" and actions.restart_gang is None


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        ("--port=$(PORT)", "--port=8123"),
        ("$(PORT)$(HOST)", "8123$(HOST)"),  # an unset variable stays as written
        ("$$(PORT) costs $$5", "$(PORT) costs $5"),  # $$ is a literal $
        ("$(PORT", "$(PORT"),
        ("plain", "plain"),
    ],
)
def test_command_references_expand_as_kubernetes_expands_them(text: str, expanded: str) -> None:
    assert expand_references(text, {"PORT": "8123"}) == expanded


HEALTH_SERVER = """
import http.server, sys, time, pathlib
time.sleep(1.0)  # a server that takes a moment to come up
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        pathlib.Path(sys.argv[2]).write_text(str(time.time()))
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_run_starts_the_trainer_once_the_environments_answer_health(tmp_path: Path) -> None:
    """`kubedistill run` starts the environment servers in a wave of their own and the rest once
    they answer GET /health (Supervisor.start_waves), the same processes it plans for the job."""
    from kubedistill.runtime.entrypoints.launch import ProcessLauncher

    spec = copy.deepcopy(SPEC)
    del spec["environments"][0]
    answered, started = tmp_path / "answered", tmp_path / "started"
    spec["environments"][0]["command"] = [sys.executable, "-c", HEALTH_SERVER, "$(PORT)", str(answered)]
    job = _job(spec)
    config, procs = local_processes(job, tmp_path / "config.json")
    trainer = next(p for p in procs if p.identity.role is Role.trainer)
    trainer.argv = [
        sys.executable,
        "-c",
        f"import time, pathlib; pathlib.Path({str(started)!r}).write_text(str(time.time()))",
    ]
    processes = [procs[0], trainer]  # the environment and one stand-in for everything else
    (tmp_path / "logs").mkdir()
    launch = ProcessLauncher(tmp_path / "logs", [])
    loop = local.Supervisor(
        local.LocalJob(tmp_path / "job.yaml", job, tmp_path, config, processes), launch, {}, print, False
    )
    try:
        assert loop.start_waves()
        deadline = time.monotonic() + 30
        while not (started.exists() and started.read_text()):
            assert time.monotonic() < deadline, (tmp_path / "logs" / f"{trainer.name}.log").read_text()
            time.sleep(0.05)
    finally:
        loop.http.close()
        launch.close()
    assert float(started.read_text()) > float(answered.read_text())
