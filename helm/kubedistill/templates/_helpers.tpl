{{- define "kubedistill.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubedistill.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kubedistill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubedistill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubedistill.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kubedistill.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubedistill
{{- end -}}

{{- define "kubedistill.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubedistill.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kubedistill.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The namespaces watched when not cluster-wide (default: the release namespace). */}}
{{- define "kubedistill.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson (uniq .Values.watch.namespaces) -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/*
Whether a monitoring.coreos.com/v1 kind is served (Prometheus Operator CRDs installed). Objects of
an absent kind are not rendered (an install would fail on them); NOTES.txt says so.
*/}}
{{- define "kubedistill.hasMonitoringApi" -}}
{{- if .Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind) -}}true{{- end -}}
{{- end -}}

{{/*
The operator's RBAC rules: exactly the verbs kubedistill.operator uses. tests/operator_rbac.py holds
the same data (NAMESPACED, CLUSTER); tests/test_helm_chart.py checks that the chart renders exactly it.
*/}}
{{- define "kubedistill.namespacedRules" -}}
# The jobs: watch them, keep status, kopf's annotations and finalizer, TTL deletion.
- apiGroups: ["kubedistill.io"]
  resources: ["distillationjobs"]
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["kubedistill.io"]
  resources: ["distillationjobs/status"]
  verbs: ["get", "patch", "update"]
# Children's ownerReferences set blockOwnerDeletion: OwnerReferencesPermissionEnforcement
# (OpenShift, hardened clusters) admits that only with update on the job's finalizers.
- apiGroups: ["kubedistill.io"]
  resources: ["distillationjobs/finalizers"]
  verbs: ["update"]
# The children; the ConfigMap is patched when the job's rollout replicas change.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The checkpoint claim of a job without a volume at checkpoint.path: created once, deleted with
# the job (owner reference) or kept (checkpoint.claim.whenDeleted Retain).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["create"]
# Events for every phase transition and error.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.gangSchedulers.volcano }}
# PodGroups of jobs with gangScheduler volcano: created once, patched when the job's pod count
# changes (a rollout scale), deleted with the job (owner reference).
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- if .Values.gangSchedulers.coscheduling }}
# PodGroups of jobs with gangScheduler coscheduling (scheduler-plugins).
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- end -}}

{{/* Cluster-scoped reads: kopf's resource discovery and namespace scanning. */}}
{{- define "kubedistill.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end -}}
