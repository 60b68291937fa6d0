"""A real Prometheus scrapes the runtime's and the operator's metric registries (the same
exposition code the pods serve) and answers every dashboard query with data; every alert fires
on data made to trigger it. Prometheus is Debian's, installed by scripts/install-promtool.sh."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client import start_http_server

from ports import free_port
from test_monitoring_queries import dashboard_queries, render_alert_groups

SCRAPE_MS = 500
SCRAPE_SECONDS = SCRAPE_MS / 1000
# Grafana's $__rate_interval is at least 4 scrape intervals; keep it short so the test is fast.
RATE_WINDOW = "5s"


def query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


class FakeJob:
    """The metrics one trainer, one rollout and one teacher process and the operator would have
    mid-run, with the values that make every alert fire. Counters keep moving while it runs."""

    def __init__(self) -> None:
        from kubedistill.operator.metrics import OperatorMetrics
        from kubedistill.runtime.metrics import RoleMetrics

        self.trainer = RoleMetrics("demo", "trainer", 0)
        self.rollout = RoleMetrics("demo", "rollout", 0)
        self.teacher = RoleMetrics("demo", "teacher", 0)
        self.operator = OperatorMetrics()
        t = self.trainer
        t["step"].set(5)  # and it never moves: KubedistillTrainerStalled
        t["weight_version"].set(5)
        self.rollout["weight_version"].set(5)
        t["buffer_size"].set(12)
        t["trainer_idle_ratio"].set(0.3)
        for kind, v in [("distill", 0.4), ("pg", 0.1), ("total", 0.5)]:
            t["loss"].labels(kind=kind).set(v)
        t["reward_mean"].set(0.7)
        t["grad_norm"].set(1.5)
        t["learning_rate"].set(1e-6)
        t["tokens_per_second"].set(900.0)
        t["kl_student_teacher"].set(0.2)
        t["eval_step"].set(4)
        for source, teacher, score in [("gsm8k", "math", 0.6), ("geo3k", "vision", 0.3)]:
            t["eval_score"].labels(data_source=source, teacher=teacher).set(score)
            t["eval_response_length"].labels(data_source=source, teacher=teacher).set(120.0)
            t["eval_reverse_kl"].labels(data_source=source, teacher=teacher).set(0.15)
        for m in (self.rollout, self.teacher):
            m["requests_in_flight"].set(2)
        self.operator.jobs.labels(phase="Failed").set(1)  # KubedistillJobFailed
        self.operator.role_ready.labels(namespace="default", job="demo", role="trainer").set(1)
        self.operator.job_restarts.labels(namespace="default", job="demo").set(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def tick(self) -> None:
        t = self.trainer
        t["samples"].labels(state="generated").inc(10)
        t["samples"].labels(state="consumed").inc(8)
        t["samples"].labels(state="dropped_stale").inc(2)  # 20 %: KubedistillStalenessOverBound
        t["samples"].labels(state="resumed").inc(1)
        for phase, s in [
            ("gen", 2.0),
            ("score", 1.0),
            ("wait", 0.1),
            ("train_compute", 2.5),
            ("train_other", 0.5),
            ("eval", 0.05),
            ("sync_pause", 0.1),
            ("sync_transfer", 0.2),
            ("sync_load", 0.15),
            ("sync_resume", 0.05),
            ("checkpoint", 0.0),
            ("driver", 0.01),
        ]:
            t["step_seconds"].labels(phase=phase).observe(s)
        for v in (0, 1, 1, 2):
            t["staleness"].observe(v)
        # Multi-turn traces against an environment (spec.environments).
        t["env_turns"].labels(environment="calc").observe(3)
        t["env_call_seconds"].labels(environment="calc").observe(0.02)
        t["env_errors"].labels(environment="calc", reason="timeout").inc()
        t["loss_tokens"].labels(kind="student").inc(60)
        t["loss_tokens"].labels(kind="observation").inc(20)
        t["weight_sync_seconds"].observe(300.0)  # KubedistillWeightSyncSlow
        t["weight_sync_bytes"].inc(2**30)
        self.rollout["rollout_tokens"].inc(500)
        self.teacher["teacher_tokens"].labels(teacher="math").inc(500)
        for m, endpoint in [(self.rollout, "/generate"), (self.teacher, "/score")]:
            m["requests"].labels(endpoint=endpoint, code="200").inc()
        op = self.operator
        op.reconcile_seconds.observe(0.02)
        op.reconcile_errors.inc()  # KubedistillOperatorReconcileErrors
        op.children_created.labels(kind="Pod").inc()
        op.children_deleted.labels(kind="Pod").inc()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(SCRAPE_SECONDS / 2)

    def __enter__(self) -> FakeJob:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: run `bash scripts/install-promtool.sh` (scripts/install.sh does)"
    tmp = tmp_path_factory.mktemp("prometheus")
    with FakeJob() as job:
        servers, targets = [], {}
        for name, registry in [
            ("trainer", job.trainer.registry),
            ("rollout", job.rollout.registry),
            ("teacher", job.teacher.registry),
            ("operator", job.operator.registry),
        ]:
            port = free_port()
            servers.append(start_http_server(port, addr="127.0.0.1", registry=registry))
            targets[name] = f"127.0.0.1:{port}"
        # What the chart's PodMonitor/ServiceMonitor generate: honor_labels keeps the runtime's
        # `job` label; the namespace is a target label.
        config = {
            "global": {"scrape_interval": f"{SCRAPE_MS}ms", "scrape_timeout": f"{SCRAPE_MS}ms"},
            "scrape_configs": [
                {
                    "job_name": "podMonitor/kubedistill/kd-jobs/0",
                    "honor_labels": True,
                    "static_configs": [
                        {
                            "targets": [targets[r] for r in ("trainer", "rollout", "teacher")],
                            "labels": {"namespace": "default"},
                        }
                    ],
                },
                {
                    "job_name": "serviceMonitor/kubedistill/kd/0",
                    "honor_labels": True,
                    "static_configs": [{"targets": [targets["operator"]], "labels": {"namespace": "kubedistill"}}],
                },
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "prometheus.log", "w"),
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, (tmp / "prometheus.log").read_text()
                try:
                    # Ready once rates over RATE_WINDOW exist for every target (the trainer's
                    # scrape shows in the samples counter, the servers' in their requests).
                    if (
                        len(query(base, f"rate(kubedistill_requests_total[{RATE_WINDOW}])")) == 2
                        and query(base, f"rate(kubedistill_samples_total[{RATE_WINDOW}])")
                        and query(base, f"rate(kubedistill_operator_reconcile_errors_total[{RATE_WINDOW}])")
                    ):
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "Prometheus did not scrape the targets in 30 s"
                time.sleep(0.25)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=20)
            for server in servers:
                server[0].shutdown()


def test_every_dashboard_query_returns_data(prometheus: str) -> None:
    empty = []
    for where, expr in dashboard_queries():
        expr = expr.replace("[1m]", f"[{RATE_WINDOW}]")
        result = query(prometheus, expr)
        if not result:
            empty.append(f"{where}: {expr}")
    assert not empty, "queries with no data:\n" + "\n".join(empty)


def test_dashboard_series_carry_the_job_name(prometheus: str) -> None:
    # A metric of each role: the trainer's step, the servers' requests in flight.
    series = query(
        prometheus, '{__name__=~"kubedistill_step|kubedistill_requests_in_flight", namespace=~"default", job=~"demo"}'
    )
    assert sorted(s["metric"]["role"] for s in series) == ["rollout", "teacher", "trainer"]
    assert all(s["metric"]["job"] == "demo" and "exported_job" not in s["metric"] for s in series)


def _alert_results(prometheus: str, *values: str) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for group in render_alert_groups(*values):
        for rule in group["rules"]:
            expr = rule["expr"]
            for window in ("[10m]", "[30m]"):
                expr = expr.replace(window, f"[{RATE_WINDOW}]")
            out[rule["alert"]] = query(prometheus, expr)
    return out


def test_every_alert_fires_on_data_made_to_trigger_it(prometheus: str) -> None:
    fired = _alert_results(prometheus)
    assert all(fired.values()), f"alerts that did not fire: {[a for a, r in fired.items() if not r]}"
    (stale,) = fired["KubedistillStalenessOverBound"]
    assert stale["metric"]["job"] == "demo" and 0.15 < float(stale["value"][1]) < 0.25
    (slow,) = fired["KubedistillWeightSyncSlow"]
    assert slow["metric"]["job"] == "demo" and 120 < float(slow["value"][1]) <= 300


def test_alert_thresholds_from_values_silence_them(prometheus: str) -> None:
    """The same data under thresholds above it: the values reach the rules."""
    quiet = _alert_results(
        prometheus,
        "--set-json",
        "metrics.prometheusRule.staleDropRatio=0.5",
        "--set",
        "metrics.prometheusRule.weightSyncSlowSeconds=600",
    )
    assert quiet["KubedistillStalenessOverBound"] == []
    assert quiet["KubedistillWeightSyncSlow"] == []
    assert quiet["KubedistillJobFailed"]  # untouched by those values
