{{- define "aether.fullname" -}}
{{- printf "%s" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The base of every name outside the release namespace (ClusterRoles, ClusterRoleBindings, and the
Roles in watched namespaces): `<namespace>-<fullname>`, so two releases of the chart never share
one. At most 47 characters, so a suffix such as `-metrics-reader` still fits in 63; a longer base
is cut and given a hash of the whole, so cutting never makes two releases collide.
*/}}
{{- define "aether.scopedName" -}}
{{- $base := printf "%s-%s" .Release.Namespace (include "aether.fullname" .) -}}
{{- if gt (len $base) 47 -}}
{{- printf "%s-%s" ($base | trunc 38 | trimSuffix "-") ($base | sha256sum | trunc 8) -}}
{{- else -}}
{{- $base -}}
{{- end -}}
{{- end -}}

{{- define "aether.labels" -}}
{{ include "aether.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: aether-federation
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "aether.selector" -}}
app.kubernetes.io/name: aether-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Where the operator mounts metrics.certSecret. */}}
{{- define "aether.metricsCertDir" -}}
/etc/aether/metrics-tls
{{- end -}}
