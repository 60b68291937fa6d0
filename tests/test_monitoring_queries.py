"""The chart's dashboard and alert queries are real: promtool parses every one, and each names
only metrics (and labels) that the runtime (runtime/metrics.py) or the operator
(operator/metrics.py) exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from k8s_offline import helm

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kubedistill"
DASHBOARD = CHART / "files" / "dashboard.json"

# Operator metrics the dashboard needs that operator/metrics.py does not export (none now).
REQUESTED_OPERATOR_METRICS: dict[str, set[str]] = {}
# Labels Prometheus attaches to every scraped series (PodMonitor/ServiceMonitor target labels).
TARGET_LABELS = {"namespace", "pod", "container", "instance", "service", "endpoint", "job"}
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "30s", "$namespace": "default", "$job": "demo"}


# --- what the code exports -------------------------------------------------------------------


def _exposed(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Series names in the text exposition -> their label names."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def runtime_series() -> dict[str, set[str]]:
    from kubedistill.runtime.metrics import METRICS, ROLES, RoleMetrics

    out: dict[str, set[str]] = {}
    for role in ROLES:
        m = RoleMetrics("demo", role, 0)
        for d in METRICS:  # a child per labelled metric, so every series appears in the exposition
            if d.labels and role in d.roles:
                m[d.name].labels(**{label: "x" for label in d.labels})
        for name, labels in _exposed(m.registry).items():
            out.setdefault(name, set()).update(labels)
    return out


def operator_series() -> dict[str, set[str]]:
    from kubedistill.operator.metrics import METRICS, OperatorMetrics

    m = OperatorMetrics()
    for d in METRICS:
        if d.labels:
            getattr(m, d.name).labels(**{label: "x" for label in d.labels})
    return _exposed(m.registry)


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    series = {**runtime_series(), **operator_series()}
    assert not set(REQUESTED_OPERATOR_METRICS) & set(series), (
        "the operator now exports a requested metric: drop it from REQUESTED_OPERATOR_METRICS"
    )
    return {**series, **REQUESTED_OPERATOR_METRICS}


# --- the queries -----------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable, Grafana variables expanded."""
    d = dashboard()
    raw = [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            # label_values(SELECTOR, label) is Grafana's; Prometheus sees the series selector.
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
            assert m, f"variable {var['name']}: unexpected query {var['query']['query']!r}"
            raw.append((f"variable {var['name']}", m.group(1)))
    out = []
    for where, expr in raw:
        for name, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"{where}: unexpanded Grafana variable in {expr!r}"
        out.append((where, expr))
    return out


def render_alert_groups(*extra: str) -> list[dict[str, Any]]:
    out = helm(
        "template",
        "kd",
        str(CHART),
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        *extra,
    )
    (rule,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def alert_queries() -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for g in render_alert_groups() for r in g["rules"]]


# --- promtool --------------------------------------------------------------------------------


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not found: run `bash scripts/install-promtool.sh` (scripts/install.sh does)"
    return found


def promtool_check_rules(groups: list[dict[str, Any]], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_promtool_parses_alert_rules_and_dashboard_queries(tmp_path: Path) -> None:
    alerts = render_alert_groups()
    recorded = [
        {"record": f"kubedistill:dashboard:q{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_queries())
    ]
    groups = alerts + [{"name": "dashboard", "rules": recorded}]
    r = promtool_check_rules(groups, tmp_path)
    total = sum(len(g["rules"]) for g in groups)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {total} rules found" in r.stdout


def test_promtool_rejects_a_broken_query(tmp_path: Path) -> None:
    broken = [{"name": "x", "rules": [{"record": "x:y", "expr": "sum by (job) (rate(kubedistill_step[5m])"}]}]
    r = promtool_check_rules(broken, tmp_path)
    assert r.returncode != 0
    assert "parse error" in (r.stdout + r.stderr)


# --- metric and label names ------------------------------------------------------------------

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "start",
    "end",
}


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names in its matchers) of every series selector in a PromQL expression.

    A small lexer, enough for our queries: strings, label matchers, ranges, grouping clauses and
    numbers are taken out; the identifiers left that are not function calls or keywords are
    metric names.
    """
    strings_out = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    found: list[tuple[str, set[str]]] = []
    # name{matchers}
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}", strings_out):
        labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2)))
        if m.group(1):
            found.append((m.group(1), labels))
    rest = re.sub(r"[a-zA-Z_:][a-zA-Z0-9_:]*\s*\{[^}]*\}", " ", strings_out)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)
    rest = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", rest)
    # Numbers and durations (`offset 5m`, `1h30m`).
    rest = re.sub(
        r"(?<![a-zA-Z0-9_:])[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?((ms|[smhdwy])[0-9]*)*(?![a-zA-Z0-9_:])", " ", rest
    )
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", rest):
        if m.group(2) or m.group(1) in _KEYWORDS:
            continue
        found.append((m.group(1), set()))
    return found


def test_selector_lexer() -> None:
    expr = (
        'sum by (job, le) (rate(a_bucket{job=~"x", le!="1"}[5m])) / on (job) group_left '
        'b_total > 1e-9 and c or count(d{x="}"})'
    )
    assert selectors(expr) == [("a_bucket", {"job", "le"}), ("d", {"x"}), ("b_total", set()), ("c", set())]
    assert selectors("sum(rate(kubedistill_samples_total[1m:10s] offset 5m))") == [("kubedistill_samples_total", set())]


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_queries_name_only_exported_metrics_and_labels(source: str, exported: dict[str, set[str]]) -> None:
    queries = dashboard_queries() if source == "dashboard" else alert_queries()
    assert queries
    problems = []
    for where, expr in queries:
        names = selectors(expr)
        if not names:
            problems.append(f"{where}: names no metric: {expr}")
        for name, labels in names:
            if name not in exported:
                problems.append(f"{where}: {name} is exported by neither the runtime nor the operator")
            elif labels - exported[name] - TARGET_LABELS:
                problems.append(f"{where}: {name} has no label {sorted(labels - exported[name] - TARGET_LABELS)}")
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            metric_labels = set().union(*(exported.get(n, set()) for n, _ in names)) | TARGET_LABELS
            unknown = {g.strip() for g in group.split(",")} - metric_labels
            if unknown:
                problems.append(f"{where}: groups by {sorted(unknown)}, a label none of its metrics has")
    assert not problems, "\n".join(problems)


def test_cross_check_catches_an_unknown_metric(exported: dict[str, set[str]]) -> None:
    ((name, _),) = selectors('rate(kubedistill_samples_generated_total{job="x"}[1m])')
    assert name not in exported
    assert "kubedistill_samples_total" in exported and "state" in exported["kubedistill_samples_total"]


def test_dashboard_covers_the_runtime_metrics() -> None:
    from kubedistill.runtime.metrics import METRICS

    used = {name for _, expr in dashboard_queries() for name, _ in selectors(expr)}
    stems = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in used}
    missing = [d.full_name for d in METRICS if d.full_name not in stems and d.full_name not in used]
    assert not missing, f"no dashboard panel shows {missing}"


def test_dashboard_has_the_panels_the_chart_promises() -> None:
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for wanted in [
        "samples/s",
        "tokens/s",
        "step-phase time",
        "staleness",
        "buffer",
        "weight-sync time",
        "weight-sync bytes",
        "losses",
        "reward",
        "kl(student || teacher)",
        "role readiness",
        "restarts",
    ]:
        assert wanted in titles, f"no panel about {wanted!r}"


def test_dashboard_is_well_formed() -> None:
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
    # No two panels overlap on the grid.
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_metric_reference_lists_every_metric() -> None:
    """docs/monitoring.md's reference names every metric the runtime and the operator export."""
    from kubedistill.operator.metrics import METRICS as OPERATOR
    from kubedistill.runtime.metrics import METRICS as RUNTIME

    doc = (ROOT / "docs" / "monitoring.md").read_text()
    names = [d.full_name + ("_total" if d.kind.__name__ == "Counter" else "") for d in [*RUNTIME, *OPERATOR]]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/monitoring.md does not describe {missing}"
    for name in REQUESTED_OPERATOR_METRICS:
        assert name in doc


def test_docs_link_each_other_and_the_readme_links_them() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in ["install", "monitoring", "troubleshooting", "tuning"]:
        assert f"(docs/{doc}.md)" in readme
        path = ROOT / "docs" / f"{doc}.md"
        for target in re.findall(r"\]\(([^)#:]+)\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"
