{{/*
The chart name, or nameOverride. Truncated to 63 characters because label values and
DNS-1123 labels (Service names) allow no more; the trailing "-" a cut can leave is
trimmed because neither may end with one.
*/}}
{{- define "pagefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: "<release>-<chart>", or just the release name when it
already contains the chart name (release "pagefleet" gives "pagefleet", not
"pagefleet-pagefleet"). Truncated to 54 characters, not 63, so that the longest suffix
added below ("-operator", 9 characters) still leaves a valid Service name.
*/}}
{{- define "pagefleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the operator's Deployment, Service, ClusterRole/Role and bindings. */}}
{{- define "pagefleet.operatorName" -}}
{{- printf "%s-operator" (include "pagefleet.fullname" .) }}
{{- end }}

{{/* "<chart>-<version>" for the helm.sh/chart label; "+" is not allowed in labels. */}}
{{- define "pagefleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's identity; a part of every selector. */}}
{{- define "pagefleet.instanceLabels" -}}
app.kubernetes.io/name: {{ include "pagefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels that never change for the life of a release: the operator's selector. */}}
{{- define "pagefleet.selectorLabels" -}}
{{ include "pagefleet.instanceLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels on every object the chart creates, less app.kubernetes.io/component. */}}
{{- define "pagefleet.commonLabels" -}}
helm.sh/chart: {{ include "pagefleet.chart" . }}
{{ include "pagefleet.instanceLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagefleet
{{- end }}

{{/* Labels of the operator's objects. */}}
{{- define "pagefleet.labels" -}}
{{ include "pagefleet.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount: created ("<fullname>-operator") or named in values. */}}
{{- define "pagefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagefleet.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image reference; an empty tag means the chart's appVersion. */}}
{{- define "pagefleet.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/* Default serving-pod image reference; an empty tag means the chart's appVersion. */}}
{{- define "pagefleet.servingImage" -}}
{{- printf "%s:%s" .Values.servingPod.image.repository (default .Chart.AppVersion .Values.servingPod.image.tag) }}
{{- end }}

{{/* The operator's liveness URL inside the cluster, as the `helm test` Pod reaches it. */}}
{{- define "pagefleet.healthUrl" -}}
{{- printf "http://%s.%s.svc:%d/healthz" (include "pagefleet.operatorName" .) .Release.Namespace (int .Values.operator.healthPort) }}
{{- end }}
