{{/*
The alerting rules' groups (spec of the PrometheusRule): files/prometheus-rules.yaml rendered with
tpl (its thresholds come from prometheusRule.thresholds), then, alert by alert: those named in
prometheusRule.disabled left out, prometheusRule.additionalRuleLabels added (an alert's own labels,
such as severity, win), and runbook_url set to the alert's section of the runbooks page. A group
left without rules is left out too.
*/}}
{{- define "aether.prometheusRules" -}}
{{- $p := .Values.prometheusRule -}}
{{- $runbooks := $p.runbookBaseURL | default (include "aether.runbooks" .) | trimSuffix "/" -}}
{{- $source := tpl (.Files.Get "files/prometheus-rules.yaml") . | fromYaml -}}
{{- if hasKey $source "Error" -}}
{{- fail (printf "files/prometheus-rules.yaml does not render to YAML: %s" $source.Error) -}}
{{- end -}}
{{- $known := list -}}
{{- $groups := list -}}
{{- range $group := $source.groups -}}
{{- $rules := list -}}
{{- range $rule := $group.rules -}}
{{- $known = append $known $rule.alert -}}
{{- if not (get $p.disabled $rule.alert) -}}
{{- $_ := set $rule "labels" (merge (dict) ($rule.labels | default dict) ($p.additionalRuleLabels | default dict)) -}}
{{- $_ := set $rule.annotations "runbook_url" (printf "%s#%s" $runbooks (lower $rule.alert)) -}}
{{- $rules = append $rules $rule -}}
{{- end -}}
{{- end -}}
{{- if $rules -}}
{{- $groups = append $groups (dict "name" $group.name "rules" $rules) -}}
{{- end -}}
{{- end -}}
{{- range $name, $off := $p.disabled -}}
{{- if not (has $name $known) -}}
{{- fail (printf "prometheusRule.disabled names %s, which is no alert of this chart (%s)" $name (join ", " $known)) -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "groups" $groups) -}}
{{- end -}}

{{/* The runbooks of this chart's version: docs/runbooks.md at its tag. */}}
{{- define "aether.runbooks" -}}
https://github.com/aether/aether-federation/blob/v{{ .Chart.Version }}/docs/runbooks.md
{{- end -}}
