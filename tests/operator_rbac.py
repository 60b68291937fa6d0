"""The Kubernetes permissions the operator needs, as data: what the tests hold the Helm chart to.

The chart's Role/ClusterRole (helm/kubedistill/templates/_helpers.tpl) is what installs them;
tests/test_helm_chart.py checks it renders exactly these lists, and tests/test_operator_render.py
that they cover every call the operator makes. NAMESPACED rules go in a Role per watched
namespace (or the ClusterRole with --all-namespaces); CLUSTER rules are always cluster-scoped
(kopf reads CRDs and namespaces to discover what it watches).
"""

from __future__ import annotations

from collections.abc import Collection

PolicyRule = dict[str, list[str]]

NAMESPACED: list[PolicyRule] = [
    # The jobs: watch them, keep status, own the finalizer and kopf's annotations, TTL delete.
    {
        "apiGroups": ["kubedistill.io"],
        "resources": ["distillationjobs"],
        "verbs": ["get", "list", "watch", "patch", "update", "delete"],
    },
    {"apiGroups": ["kubedistill.io"], "resources": ["distillationjobs/status"], "verbs": ["get", "patch", "update"]},
    # Children carry ownerReferences with blockOwnerDeletion (kopf.adopt): where the admission plugin
    # OwnerReferencesPermissionEnforcement runs (OpenShift, hardened clusters) setting it needs
    # update on the owner's finalizers subresource, or every child create is refused.
    {"apiGroups": ["kubedistill.io"], "resources": ["distillationjobs/finalizers"], "verbs": ["update"]},
    # The children: pods are watched (phase, readiness) and recreated; the rest only when missing,
    # and the ConfigMap patched when the spec it carries changes (spec.rollout.replicas).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create", "delete", "patch"]},
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create", "delete"],
    },
    # The checkpoint claim a job without a volume at checkpoint.path gets: created once (a 409
    # when it exists), deleted by the job's owner reference or kept (whenDeleted Retain).
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["create"]},
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


GANG_SCHEDULER_RULES: dict[str, PolicyRule] = {
    # The PodGroup of a job with spec.scheduling.gangScheduler volcano or coscheduling: created
    # once (a 409 when it exists), patched when the job's pod count changes (minMember,
    # minResources after a rollout scale), deleted by the job's owner reference, never listed or
    # watched. Granted only where that scheduler is installed (Helm value gangSchedulers.<name>).
    # Kueue needs nothing: it reads the pods' labels.
    "volcano": {
        "apiGroups": ["scheduling.volcano.sh"],
        "resources": ["podgroups"],
        "verbs": ["get", "create", "patch"],
    },
    "coscheduling": {
        "apiGroups": ["scheduling.x-k8s.io"],
        "resources": ["podgroups"],
        "verbs": ["get", "create", "patch"],
    },
}


def rules(all_namespaces: bool, gang_schedulers: Collection[str] = ()) -> dict[str, list[PolicyRule]]:
    """{"role": rules for each watched namespace, "clusterRole": cluster rules} — with
    --all-namespaces the namespaced rules move into the ClusterRole. `gang_schedulers`: the
    enabled GANG_SCHEDULER_RULES."""
    namespaced = [*NAMESPACED, *(GANG_SCHEDULER_RULES[g] for g in GANG_SCHEDULER_RULES if g in gang_schedulers)]
    if all_namespaces:
        return {"role": [], "clusterRole": [*CLUSTER, *namespaced]}
    return {"role": namespaced, "clusterRole": list(CLUSTER)}
