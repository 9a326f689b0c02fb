{{- define "aether.fullname" -}}
{{- printf "%s" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "aether.labels" -}}
app.kubernetes.io/name: aether-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "aether.selector" -}}
app.kubernetes.io/name: aether-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
