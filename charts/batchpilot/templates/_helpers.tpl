{{/* Chart name, truncated to a DNS label. */}}
{{- define "batchpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release already contains the chart name. */}}
{{- define "batchpilot.fullname" -}}
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

{{/* Standard labels. */}}
{{- define "batchpilot.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "batchpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "batchpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The service account name; contradictory values fail here. */}}
{{- define "batchpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "batchpilot.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image reference: repository@digest when a digest is set, else the tag, which defaults to the
chart's appVersion (the package version). The upload Job compiles the pipeline with it (`--image`). */}}
{{- define "batchpilot.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Namespace of the KFP runs' task pods. Single-user KFP runs them in its own namespace (`kubeflow` in
the standalone manifests); multi-user KFP in the profile namespace the run belongs to (Kubeflow docs,
"Multi-user Isolation": runs are executed in user namespaces). */}}
{{- define "batchpilot.kfpNamespace" -}}
{{- if .Values.kfp.namespace }}
{{- .Values.kfp.namespace }}
{{- else if .Values.kfp.multiUser }}
{{- .Release.Namespace }}
{{- else }}
{{- "kubeflow" }}
{{- end }}
{{- end }}

{{/* The service account KFP runs the task pods as when a run names none: the API server's
DEFAULTPIPELINERUNNERSERVICEACCOUNT, `pipeline-runner` in single-user KFP
(kubeflow/pipelines backend/src/apiserver/common/const.go DefaultPipelineRunnerServiceAccount) and
`default-editor` in multi-user KFP (manifests/kustomize/base/installs/multi-user/api-service/params.env). */}}
{{- define "batchpilot.kfpRunServiceAccount" -}}
{{- if .Values.kfp.runServiceAccount }}
{{- .Values.kfp.runServiceAccount }}
{{- else if .Values.kfp.multiUser }}
{{- "default-editor" }}
{{- else }}
{{- "pipeline-runner" }}
{{- end }}
{{- end }}

{{/* The RBAC subjects: the chart's account (the trainers, the upload Job) and the KFP run account (the
pipeline's task pods, which resize the pool and launch the trainers). One subject when they coincide. */}}
{{- define "batchpilot.rbacSubjects" -}}
- kind: ServiceAccount
  name: {{ include "batchpilot.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- $runName := include "batchpilot.kfpRunServiceAccount" . }}
{{- $runNamespace := include "batchpilot.kfpNamespace" . }}
{{- if not (and (eq $runName (include "batchpilot.serviceAccountName" .)) (eq $runNamespace .Release.Namespace)) }}
- kind: ServiceAccount
  name: {{ $runName }}
  namespace: {{ $runNamespace }}
{{- end }}
{{- end }}

{{/* The pipeline version each install/upgrade uploads: the app version plus the release revision, so an
upgrade (or a rollback, which is a new revision too) adds a version and never a second pipeline. */}}
{{- define "batchpilot.pipelineVersion" -}}
{{- printf "%s-r%d" .Chart.AppVersion (int .Release.Revision) }}
{{- end }}

{{/* The config in the ConfigMap: the user's, with the cluster fields that follow from the release filled
in when left unset (namespace, the trainers' service account, their image). */}}
{{- define "batchpilot.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $cluster := default (dict) $config.cluster }}
{{- if not $cluster.namespace }}
{{- $_ := set $cluster "namespace" .Release.Namespace }}
{{- end }}
{{- if not $cluster.service_account }}
{{- $_ := set $cluster "service_account" (include "batchpilot.serviceAccountName" .) }}
{{- end }}
{{- if and (ne (toString $cluster.backend) "local") (not $cluster.image) }}
{{- $_ := set $cluster "image" (include "batchpilot.image" .) }}
{{- end }}
{{- $_ := set $config "cluster" $cluster }}
{{- toYaml $config }}
{{- end }}
