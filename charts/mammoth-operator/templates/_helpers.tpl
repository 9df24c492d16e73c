{{/*
Names, labels and shared fragments of the mammoth-operator chart. Every template takes its
names and labels from here (one definition each); nothing else spells them out.
*/}}

{{/* mammoth-operator.name is the chart name, or .Values.nameOverride (63 characters at most). */}}
{{- define "mammoth-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
mammoth-operator.fullname is the name of every namespaced object of the release: .Values.fullnameOverride,
else "<release>" when the release name already contains the chart name, else "<release>-<chart>".
*/}}
{{- define "mammoth-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
mammoth-operator.clusterScopedName names cluster-scoped objects (ClusterRole, ClusterRoleBinding):
prefixed with the release namespace so two releases in two namespaces never collide.
*/}}
{{- define "mammoth-operator.clusterScopedName" -}}
{{- printf "%s-%s" .Release.Namespace (include "mammoth-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* mammoth-operator.chart is "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "mammoth-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* mammoth-operator.selectorLabels selects the operator's pods; immutable once installed. */}}
{{- define "mammoth-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mammoth-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* mammoth-operator.labels is the recommended label set carried by every object of the chart. */}}
{{- define "mammoth-operator.labels" -}}
helm.sh/chart: {{ include "mammoth-operator.chart" . }}
{{ include "mammoth-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mammoth-pipeline
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* mammoth-operator.serviceAccountName is the ServiceAccount the operator runs as. */}}
{{- define "mammoth-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mammoth-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
mammoth-operator.image renders "<repository>:<tag>" or "<repository>@<digest>" for one image
value object; the tag defaults to the chart's appVersion (the tag the release workflow pushes).
Call with (dict "image" .Values.image "root" $).
*/}}
{{- define "mammoth-operator.image" -}}
{{- $image := .image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/*
mammoth-operator.namespacedRules are the RBAC rules the operator needs inside every namespace it
serves: its own custom resource, the children it builds from it, and Events. They are exactly
the calls made by operator/mammoth_operator (tests/chart/test_rbac.py compares them with the
requests the operator sends to the emulated API server). The same list feeds the Role
(namespace mode) and the ClusterRole (cluster-wide mode).
*/}}
{{- define "mammoth-operator.namespacedRules" -}}
- apiGroups: ["mammoth.dev"]
  resources: ["mammothpipelines"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["mammoth.dev"]
  resources: ["mammothpipelines/status"]
  verbs: ["patch"]
# blockOwnerDeletion on the children's owner references: the OwnerReferencesPermissionEnforcement
# admission plugin (on by default on OpenShift) requires update on the owner's finalizers.
- apiGroups: ["mammoth.dev"]
  resources: ["mammothpipelines/finalizers"]
  verbs: ["update"]
# children are watched (drift repair, status) and created or patched
- apiGroups: [""]
  resources: ["configmaps", "services", "secrets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
mammoth-operator.clusterRules are the cluster-scoped reads kopf makes in cluster-wide mode:
it watches CustomResourceDefinitions to notice the MammothPipeline CRD being (re)installed.
*/}}
{{- define "mammoth-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
