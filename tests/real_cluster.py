"""The operator as the Helm chart deploys it, on the real control plane (tests/control_plane.py):
the chart's objects applied by kubectl, and `kubedistill operator` run as a process whose only
credential is its ServiceAccount's token, so the chart's RBAC and the operator's own
authentication are what the test exercises."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from control_plane import ControlPlane, stop_process
from k8s_offline import tool

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kubedistill"
RELEASE = "kd"
CRD_NAME = "distillationjobs.kubedistill.io"


def chart_objects(
    release_namespace: str, watch: list[str], *extra: str, release: str = RELEASE
) -> list[dict[str, Any]]:
    """`helm template` of the chart watching `watch`, CRD included. `release` names the cluster-scoped
    objects (ClusterRole...): two installs in one cluster need two release names."""
    args = [tool("helm"), "template", release, str(CHART), "-n", release_namespace, "--include-crds"]
    for i, ns in enumerate(watch):
        args += ["--set", f"watch.namespaces[{i}]={ns}"]
    r = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"helm template failed:\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def install_chart(
    plane: ControlPlane, release_namespace: str, watch: list[str], release: str = RELEASE
) -> list[dict[str, Any]]:
    """Apply the chart's objects (namespaces created first) and wait for the CRD to be served."""
    for ns in {release_namespace, *watch}:
        plane.namespace(ns)
    docs = chart_objects(release_namespace, watch, release=release)
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    plane.apply(crds)
    plane.wait_established(CRD_NAME)
    plane.apply([d for d in docs if d["kind"] != "CustomResourceDefinition"])
    return docs


def service_account(docs: list[dict[str, Any]]) -> str:
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    return str(sa["metadata"]["name"])


@contextlib.contextmanager
def operator_process(
    kubeconfig: Path, namespaces: list[str], log: Path, resync_seconds: float = 0.5, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`kubedistill operator --namespace ...` as the chart's Deployment runs it, authenticated
    by `kubeconfig` alone (no liveness or metrics port: tests run several)."""
    args = [sys.executable, "-m", "kubedistill.cli", "operator", "--liveness", "", "--metrics-port", "0"]
    for ns in namespaces:
        args += ["--namespace", ns]
    args += ["--resync-seconds", str(resync_seconds)]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    child_env.update({"KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1", **(env or {})})
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=child_env, cwd=ROOT)
    try:
        yield proc
    finally:
        stop_process(proc, grace=15)


def wait_for(
    check: Any, timeout: float, what: str, interval: float = 0.2, explain: Callable[[], str] = lambda: ""
) -> Any:
    """Poll `check()` until it returns something truthy; fail with its last value (and `explain()`)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value: {last!r}\n{explain()}")
