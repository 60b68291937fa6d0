"""The Helm chart (helm/kubedistill): lint, render, validate every object, and check what the
operator needs — one replica, Recreate, liveness, locked-down pod, least-privilege RBAC equal to
tests/operator_rbac.py, monitoring objects only where the Prometheus Operator's API exists.

helm comes from scripts/install-helm.sh (run by scripts/install.sh) at .venv/tools/helm."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from k8s_offline import tool
from pod_security import restricted_violations

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kubedistill"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
NAMESPACED_VALUES = CHART / "ci" / "namespaced-values.yaml"
MONITORING_APIS = [
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
]
# kubernetes-validate's lowest and a current supported version (Chart.yaml: kubeVersion >=1.28).
KUBE_VERSIONS = ["1.28.0", "1.33.0"]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, f"helm {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


def render(*extra: str, monitoring_api: bool = False, namespace: str = "kubedistill") -> list[dict[str, Any]]:
    api: list[str] = []
    if monitoring_api:
        for a in MONITORING_APIS:
            api += ["--api-versions", a]
    out = helm("template", "kd", str(CHART), "-n", namespace, "--include-crds", *api, *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def full_docs() -> list[dict[str, Any]]:
    return render("-f", str(FULL_VALUES), monitoring_api=True)


@pytest.fixture(scope="module")
def namespaced_docs() -> list[dict[str, Any]]:
    return render("-f", str(NAMESPACED_VALUES), monitoring_api=True, namespace="kd-system")


# --- The CRD ---------------------------------------------------------------------------------


def test_chart_crd_is_the_generated_crd() -> None:
    from kubedistill.api.crd import crd_yaml

    generated = crd_yaml()
    assert (ROOT / "crds" / "kubedistill.io_distillationjobs.yaml").read_text() == generated
    chart_copy = CHART / "crds" / "kubedistill.io_distillationjobs.yaml"
    assert chart_copy.read_text() == generated, (
        "helm/kubedistill/crds/ is stale: "
        "`kubedistill crd > helm/kubedistill/crds/kubedistill.io_distillationjobs.yaml`"
    )
    assert [p.name for p in (CHART / "crds").iterdir()] == ["kubedistill.io_distillationjobs.yaml"]


def test_crd_is_rendered_only_from_crds_folder(default_docs: list[dict[str, Any]]) -> None:
    # crds/: installed once, never upgraded or deleted by helm (uninstall keeps every job).
    crd = one(default_docs, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "distillationjobs.kubedistill.io"
    plain = [d for d in yaml.safe_load_all(helm("template", "kd", str(CHART)).stdout) if d]
    assert not by_kind(plain, "CustomResourceDefinition")


# --- lint and schema -------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, FULL_VALUES, NAMESPACED_VALUES], ids=["default", "full", "namespaced"])
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    out = helm(*args).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


@pytest.mark.parametrize(
    "setting, complaint",
    [
        (["--set", "watch.allNamespaces=maybe"], "allNamespaces"),
        (["--set", "replicaCount=2"], "replicaCount"),
        (["--set", "watch.namespaces[0]=Not_A_Namespace"], "namespaces"),
        (["--set", "metrics.prometheusRule.staleDropRatio=2"], "staleDropRatio"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "metrics.serviceMonitor.interval=often"], "interval"),
        (["--set", "gangSchedulers.kueue=true"], "gangSchedulers"),
        (["--set", "gangSchedulers.volcano=maybe"], "volcano"),
    ],
)
def test_values_schema_refuses_bad_values(setting: list[str], complaint: str) -> None:
    r = helm("template", "kd", str(CHART), *setting, check=False)
    assert r.returncode != 0
    assert complaint in r.stderr


# --- every object validates ------------------------------------------------------------------

# Kinds kubernetes-validate has no schema for. They are checked below against the fields of the
# Prometheus Operator's monitoring.coreos.com/v1 CRDs that this chart uses (unknown fields refused).
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
_DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
    },
}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": "string"},
        "for": _DURATION,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _cr(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": spec,
        },
    }


MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _cr(
        "ServiceMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        },
    ),
    "PodMonitor": _cr(
        "PodMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        },
    ),
    "PrometheusRule": _cr(
        "PrometheusRule",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "interval": _DURATION,
                            "rules": {"type": "array", "minItems": 1, "items": _RULE},
                        },
                    },
                }
            },
        },
    ),
}


def validation_errors(doc: dict[str, Any]) -> list[str]:
    if doc["kind"] in MONITORING_SCHEMAS:
        v = jsonschema.Draft7Validator(MONITORING_SCHEMAS[doc["kind"]])
        return [f"{doc['kind']} {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc['kind']} {doc['metadata']['name']} (k8s {version}): {e.message}")
    return errors


@pytest.mark.parametrize("docs_fixture", ["default_docs", "full_docs", "namespaced_docs"])
def test_every_rendered_object_validates(docs_fixture: str, request: pytest.FixtureRequest) -> None:
    docs = request.getfixturevalue(docs_fixture)
    assert len(docs) >= 7
    problems = [p for d in docs for p in validation_errors(d)]
    assert not problems, "\n".join(problems)


def test_validation_catches_mistakes(full_docs: list[dict[str, Any]]) -> None:
    """The checks above are not vacuous: an unknown field or a wrong type is reported."""
    deploy = copy.deepcopy(one(full_docs, "Deployment"))
    deploy["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    assert validation_errors(deploy)
    deploy = copy.deepcopy(one(full_docs, "Deployment"))
    deploy["spec"]["replicas"] = "one"
    assert validation_errors(deploy)
    pm = copy.deepcopy(one(full_docs, "PodMonitor"))
    pm["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True
    assert validation_errors(pm)
    rule = copy.deepcopy(one(full_docs, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "a while"
    assert validation_errors(rule)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(one(full_docs, "PodMonitor"), KUBE_VERSIONS[-1], strict=True)


# --- the operator Deployment -----------------------------------------------------------------


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("docs_fixture", ["default_docs", "full_docs"])
def test_operator_deployment_runs_one_locked_down_replica(docs_fixture: str, request: pytest.FixtureRequest) -> None:
    docs = request.getfixturevalue(docs_fixture)
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]["spec"]
    assert restricted_violations({"spec": pod}) == []
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    c = _container(docs)
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    # A read-only root still has a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    # kopf's identity from the pod's name: without POD_ID kopf asks the passwd database for the
    # user's name and crashes where the UID has none (found on a real kubelet: tests/test_real_node.py).
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]


def _arg(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_operator_args_probe_and_ports_agree(
    full_docs: list[dict[str, Any]], default_docs: list[dict[str, Any]]
) -> None:
    for docs, health, metrics in [(default_docs, 8080, 9090), (full_docs, 8081, 9091)]:
        c = _container(docs)
        args = c["args"]
        assert args[0] == "operator"
        assert _arg(args, "--liveness") == [f"http://0.0.0.0:{health}/healthz"]
        assert _arg(args, "--metrics-port") == [str(metrics)]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"health": health, "metrics": metrics}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        svc = one(docs, "Service")
        assert svc["spec"]["ports"][0]["port"] == metrics and svc["spec"]["ports"][0]["targetPort"] == "metrics"
        assert (
            svc["spec"]["selector"].items() <= one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
        )
    assert "--all-namespaces" in _container(full_docs)["args"]
    assert _container(full_docs)["args"][-1] == "--verbose"
    assert _arg(_container(default_docs)["args"], "--namespace") == ["kubedistill"]
    assert "--all-namespaces" not in _container(default_docs)["args"]
    assert _container(full_docs)["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert _container(default_docs)["image"] == "ghcr.io/kubedistill/kubedistill-operator:0.1.0"


# --- RBAC ------------------------------------------------------------------------------------


def _norm(rules: list[dict[str, Any]]) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    return sorted(
        (tuple(sorted(r["apiGroups"])), tuple(sorted(r["resources"])), tuple(sorted(r["verbs"]))) for r in rules
    )


def test_rbac_is_namespaced_by_default(default_docs: list[dict[str, Any]]) -> None:
    import operator_rbac as rbac

    expected = rbac.rules(all_namespaces=False)
    role = one(default_docs, "Role")
    assert role["metadata"]["namespace"] == "kubedistill"
    assert _norm(role["rules"]) == _norm(expected["role"])
    assert _norm(one(default_docs, "ClusterRole")["rules"]) == _norm(expected["clusterRole"])
    binding = one(default_docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = one(default_docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    # No write access outside the watched namespace.
    writes = {"create", "update", "patch", "delete", "deletecollection", "*"}
    assert not [r for r in one(default_docs, "ClusterRole")["rules"] if writes & set(r["verbs"])]


def test_rbac_one_role_per_watched_namespace(namespaced_docs: list[dict[str, Any]]) -> None:
    roles = by_kind(namespaced_docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(namespaced_docs, "RoleBinding")) == ["team-a", "team-b"]
    args = _container(namespaced_docs)["args"]
    assert _arg(args, "--namespace") == ["team-a", "team-b"]


def test_rbac_cluster_wide_by_value(full_docs: list[dict[str, Any]]) -> None:
    import operator_rbac as rbac

    expected = rbac.rules(all_namespaces=True, gang_schedulers=["volcano", "coscheduling"])
    assert not by_kind(full_docs, "Role") and not by_kind(full_docs, "RoleBinding")
    assert _norm(one(full_docs, "ClusterRole")["rules"]) == _norm(expected["clusterRole"])
    crb = one(full_docs, "ClusterRoleBinding")
    assert crb["subjects"][0]["name"] == "kd-operator"


@pytest.mark.parametrize("enabled", [[], ["volcano"], ["coscheduling"], ["volcano", "coscheduling"]])
def test_pod_group_rbac_only_for_enabled_gang_schedulers(enabled: list[str]) -> None:
    import operator_rbac as rbac

    docs = render(*[a for g in enabled for a in ("--set", f"gangSchedulers.{g}=true")])
    role = one(docs, "Role")
    assert _norm(role["rules"]) == _norm(rbac.rules(all_namespaces=False, gang_schedulers=enabled)["role"])
    groups = {g for r in role["rules"] if "podgroups" in r["resources"] for g in r["apiGroups"]}
    assert groups == {{"volcano": "scheduling.volcano.sh", "coscheduling": "scheduling.x-k8s.io"}[g] for g in enabled}
    # Created once, patched after a rollout scale, deleted by the job's owner reference: never
    # listed, watched or deleted.
    assert all(set(r["verbs"]) == {"get", "create", "patch"} for r in role["rules"] if "podgroups" in r["resources"])


def test_rbac_grants_no_wildcards(full_docs: list[dict[str, Any]], default_docs: list[dict[str, Any]]) -> None:
    for d in by_kind(full_docs + default_docs, "ClusterRole") + by_kind(default_docs, "Role"):
        for r in d["rules"]:
            assert "*" not in r["verbs"] + r["resources"] + r["apiGroups"]
            assert "secrets" not in r["resources"]


# --- monitoring objects ----------------------------------------------------------------------


def test_monitoring_objects_need_the_prometheus_operator_api() -> None:
    values = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true"]
    without = render(*values)
    assert not [d for d in without if d["apiVersion"].startswith("monitoring.coreos.com")]
    notes = helm("install", "kd", str(CHART), "--dry-run=client", *values).stdout
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert f"WARNING: no {kind} was created" in notes
    with_api = render(*values, monitoring_api=True)
    assert {d["kind"] for d in with_api if d["apiVersion"] == "monitoring.coreos.com/v1"} == {
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
    }
    # Off by default even where the API exists.
    assert not [d for d in render(monitoring_api=True) if d["apiVersion"].startswith("monitoring.coreos.com")]


def test_pod_monitor_scrapes_every_job_pod(
    full_docs: list[dict[str, Any]], namespaced_docs: list[dict[str, Any]]
) -> None:
    pm = one(full_docs, "PodMonitor")["spec"]
    assert pm["selector"] == {"matchExpressions": [{"key": "kubedistill.io/job", "operator": "Exists"}]}
    (ep,) = pm["podMetricsEndpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics"
    # The runtime's own `job` label (the DistillationJob) must win over Prometheus' scrape job.
    assert ep["honorLabels"] is True
    assert pm["namespaceSelector"] == {"any": True}
    assert one(namespaced_docs, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    sm = one(full_docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= one(full_docs, "Service")["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_grafana_dashboard_configmap(default_docs: list[dict[str, Any]], full_docs: list[dict[str, Any]]) -> None:
    cm = [d for d in by_kind(default_docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(cm) == 1
    dashboard = json.loads(cm[0]["data"]["kubedistill.json"])
    assert dashboard == json.loads((CHART / "files" / "dashboard.json").read_text())
    assert dashboard["uid"] == "kubedistill"
    full_cm = one(full_docs, "ConfigMap")
    assert full_cm["metadata"]["namespace"] == "monitoring"
    assert full_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    off = render("--set", "metrics.grafanaDashboard.enabled=false")
    assert not by_kind(off, "ConfigMap")


def test_alert_thresholds_come_from_values(full_docs: list[dict[str, Any]]) -> None:
    rules = {r["alert"]: r for g in one(full_docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert {
        "KubedistillJobFailed",
        "KubedistillTrainerStalled",
        "KubedistillStalenessOverBound",
        "KubedistillWeightSyncSlow",
    } <= set(rules)
    assert "[45m]" in rules["KubedistillTrainerStalled"]["expr"]
    assert rules["KubedistillStalenessOverBound"]["expr"].rstrip().endswith("> 0.1")
    assert rules["KubedistillWeightSyncSlow"]["expr"].rstrip().endswith("> 90")


@pytest.mark.parametrize("docs_fixture", ["default_docs", "full_docs", "namespaced_docs"])
def test_operator_command_line_is_accepted_by_the_cli(docs_fixture: str, request: pytest.FixtureRequest) -> None:
    from kubedistill.cli import build_parser

    docs = request.getfixturevalue(docs_fixture)
    args = build_parser().parse_args(_container(docs)["args"])
    assert args.command == "operator"
    health = [p["containerPort"] for p in _container(docs)["ports"] if p["name"] == "health"][0]
    assert args.liveness == f"http://0.0.0.0:{health}/healthz"
    assert args.metrics_port == [p["containerPort"] for p in _container(docs)["ports"] if p["name"] == "metrics"][0]
    cluster_wide = docs_fixture == "full_docs"
    assert args.all_namespaces is cluster_wide
    assert bool(args.namespace) is not cluster_wide


def test_operator_pod_passes_job_network_policies(default_docs: list[dict[str, Any]]) -> None:
    from kubedistill.operator.render import SCRAPER_LABEL

    labels = one(default_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels[SCRAPER_LABEL] == "true"
