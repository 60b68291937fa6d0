"""The Kubernetes permissions the operator needs, as data.

The Helm chart renders its Role/ClusterRole from these lists. NAMESPACED rules go in a Role per
watched namespace (or the ClusterRole with --all-namespaces); CLUSTER rules are always
cluster-scoped (kopf reads CRDs and namespaces to discover what it watches).
"""

from __future__ import annotations

from typing import Any

PolicyRule = dict[str, list[str]]

NAMESPACED: list[PolicyRule] = [
    # The jobs: watch them, keep status, own the finalizer and kopf's annotations, TTL delete.
    {
        "apiGroups": ["kubedistill.io"],
        "resources": ["distillationjobs"],
        "verbs": ["get", "list", "watch", "patch", "update", "delete"],
    },
    {"apiGroups": ["kubedistill.io"], "resources": ["distillationjobs/status"], "verbs": ["get", "patch", "update"]},
    # The children: pods are watched (phase, readiness) and recreated; the rest only when missing.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services", "configmaps"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create", "delete"],
    },
    # Events for every phase transition and error (kopf.info/warn).
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]

CLUSTER: list[PolicyRule] = [
    # kopf's resource discovery and namespace scanning.
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
]


def rules(all_namespaces: bool) -> dict[str, list[PolicyRule]]:
    """{"role": rules for each watched namespace, "clusterRole": cluster rules} — with
    --all-namespaces the namespaced rules move into the ClusterRole."""
    if all_namespaces:
        return {"role": [], "clusterRole": [*CLUSTER, *NAMESPACED]}
    return {"role": list(NAMESPACED), "clusterRole": list(CLUSTER)}


def as_yaml_rules(rules_list: list[PolicyRule]) -> list[dict[str, Any]]:
    return [dict(r) for r in rules_list]
