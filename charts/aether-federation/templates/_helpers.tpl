{{/* The base of every name in the release namespace: fullnameOverride, or the release's name. */}}
{{- define "aether.fullname" -}}
{{- .Values.fullnameOverride | default .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The operator's ServiceAccount: the chart's (serviceAccount.create), or one given by name. */}}
{{- define "aether.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "aether.fullname" .) -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false: the operator's RBAC is bound to it" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's image: by digest when image.digest is set (the tag is then ignored). */}}
{{- define "aether.image" -}}
{{- with .Values.image -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository (.tag | default $.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
imagePullSecrets: global.imagePullSecrets (of a parent chart; names or {name: ...}) and the chart's
own, each name once.
*/}}
{{- define "aether.imagePullSecrets" -}}
{{- $names := list -}}
{{- range concat ((.Values.global | default dict).imagePullSecrets | default list) (.Values.imagePullSecrets | default list) -}}
{{- if kindIs "string" . -}}
{{- $names = append $names . -}}
{{- else -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- end -}}
{{- range uniq $names }}
- name: {{ . }}
{{- end -}}
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
