#!/usr/bin/env bash
# Checks the alert rules (`make check-alerts`, the first step of `make test`). Their source is
# charts/aether-federation/files/prometheus-rules.yaml, a template the chart renders (thresholds,
# extra labels, disabled alerts and the runbook URL come from the values), so every check runs on
# what `helm template` renders:
#   - the rules rendered with the chart's defaults, and again with
#     config/prometheus/tests/tuned/values.yaml (other thresholds, extra labels, a disabled alert,
#     another runbook page): promtool's check of both, and promtool's unit tests of each
#     (config/prometheus/tests/*_test.yaml on the defaults, a firing and a quiet case per alert;
#     config/prometheus/tests/tuned/*_test.yaml on the tuned rendering);
#   - that config/prometheus/prometheusrule.yaml (kustomize) carries exactly the default rendering;
#   - that every query of the Grafana dashboard (charts/aether-federation/files/dashboard.json)
#     parses, with its variables filled in;
#   - that the rules and the dashboard name only metrics docs/operating.md's table documents (a
#     unit test checks that table against the real exposition);
#   - that every alert's runbook_url names a section of docs/runbooks.md at the chart version's tag
#     (the dashboard's runbooks link too);
#   - that config/prometheus builds with kustomize.
#
#   hack/check-alerts.sh          check
#   hack/check-alerts.sh --write  render the default rules into config/prometheus/prometheusrule.yaml
#
# helm and promtool come from `make tools` (AETHER_TOOLS_BIN, or ~/.cache/aether-federation/tools/bin).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
chart=$root/charts/aether-federation
source_rules=$chart/files/prometheus-rules.yaml
dashboard=$chart/files/dashboard.json
copy=$root/config/prometheus/prometheusrule.yaml
tests=$root/config/prometheus/tests
bin=${AETHER_TOOLS_BIN:-$HOME/.cache/aether-federation/tools/bin}

die() { echo "check-alerts: $*" >&2; exit 1; }

helm=$bin/helm
[[ -x $helm ]] || die "$helm is missing: run 'make tools' (or set AETHER_TOOLS_BIN)"
version=$(sed -n 's/^version: *//p' "$chart/Chart.yaml")
runbooks="https://github.com/aether/aether-federation/blob/v$version/docs/runbooks.md"

# render [VALUES_FILE]: the rule groups the chart renders (the PrometheusRule's spec), unindented.
render() {
  local values=()
  [[ -n "${1:-}" ]] && values=(--values "$1")
  "$helm" template aether "$chart" --namespace aether-system --kube-version 1.35.0 \
    --set prometheusRule.enabled=true "${values[@]}" --show-only templates/prometheusrule.yaml \
    | sed '1,/^spec:$/d' | sed 's/^  //'
}

# The copy is a PrometheusRule whose spec is the default rendering indented by two spaces:
# everything from the line `spec:` on belongs to the rules, everything above it (metadata) to the copy.
head_of_copy() { sed '/^spec:$/q' "$copy"; }
groups_of_copy() { sed '1,/^spec:$/d' "$copy" | sed 's/^  //'; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
render > "$tmp/default.yaml" || die "helm template failed on the default values"
grep -q -- '- alert:' "$tmp/default.yaml" || die "the chart rendered no alerts"

if [[ "${1:-}" == "--write" ]]; then
  grep -qx 'spec:' "$copy" || die "$copy has no 'spec:' line to put the groups under"
  { head_of_copy; sed 's/^./  &/' "$tmp/default.yaml"; } > "$copy.tmp"
  mv "$copy.tmp" "$copy"
  echo "check-alerts: wrote the rules rendered with the chart's defaults into $copy"
  exit 0
fi

promtool=$bin/promtool
[[ -x $promtool ]] || die "$promtool is missing: run 'make tools' (or set AETHER_TOOLS_BIN)"

# suite DIR [VALUES_FILE]: render with the values, check, and run DIR's unit tests on the rendering
# (each test file names `rules.yaml`, which is written beside a copy of it).
suite() {
  local dir=$1 values=${2:-} name
  name=$(basename "$dir")
  mkdir -p "$tmp/$name"
  if [[ -n $values ]]; then
    render "$values" > "$tmp/$name/rules.yaml" || die "helm template failed with $values"
  else
    cp "$tmp/default.yaml" "$tmp/$name/rules.yaml"
  fi
  cp "$dir"/*_test.yaml "$tmp/$name/"
  "$promtool" check rules "$tmp/$name/rules.yaml"
  (cd "$tmp/$name" && "$promtool" test rules ./*_test.yaml)
}
suite "$tests"
suite "$tests/tuned" "$tests/tuned/values.yaml"

# Every alert of the default rendering has a case that fires and one that does not.
for alert in $(sed -n 's/^ *- alert: *//p' "$tmp/default.yaml"); do
  awk -v a="$alert" '
    $1 == "alertname:" && $2 == a { pending = 1; next }
    pending && $1 == "exp_alerts:" { if ($2 == "[]") quiet = 1; else firing = 1; pending = 0 }
    END { exit !(quiet && firing) }' "$tests"/*_test.yaml \
    || die "$alert lacks a firing or a quiet case in config/prometheus/tests/"
done
echo "check-alerts: every alert has a firing and a quiet unit test"

# The tuned values leave an alert out and point the runbooks elsewhere.
for off in $(sed -n '/^  disabled:/,/^  [a-zA-Z]/s/^    \(AetherFederation[A-Za-z]*\): *true/\1/p' "$tests/tuned/values.yaml"); do
  ! grep -q -- "- alert: $off\$" "$tmp/tuned/rules.yaml" || die "$off is disabled in tests/tuned/values.yaml but rendered"
done

if ! diff -u --label "the chart's rules (defaults)" --label "$copy (spec)" "$tmp/default.yaml" <(groups_of_copy); then
  die "config/prometheus/prometheusrule.yaml's groups differ from the chart's rendering; run 'hack/check-alerts.sh --write'"
fi
echo "check-alerts: config/prometheus/prometheusrule.yaml carries the chart's default rendering"

# The dashboard's queries as recording rules, for promtool to parse.
command -v python3 >/dev/null || die "python3 is needed to read the dashboard's queries"
python3 - "$dashboard" > "$tmp/dashboard-queries.yaml" <<'PY'
import json, sys
board = json.load(open(sys.argv[1]))
def panels(items):
    for p in items:
        yield p
        yield from panels(p.get("panels", []))
fill = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
        "$namespace": ".*", "$origin": ".*", "$target": ".*"}
print("groups:\n  - name: dashboard\n    rules:")
n = 0
for p in panels(board["panels"]):
    for t in p.get("targets", []):
        expr = t["expr"]
        for k, v in fill.items():
            expr = expr.replace(k, v)
        assert "$" not in expr, f"{p['title']}: an unknown variable in {t['expr']}"
        n += 1
        print(f"      - record: dashboard:query_{n}")
        print(f"        expr: {json.dumps(expr)}")
for v in board["templating"]["list"]:
    if v["type"] == "query":
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        inner = q[len("label_values("):q.rindex(",")].strip()
        for k, val in fill.items():
            inner = inner.replace(k, val)
        n += 1
        print(f"      - record: dashboard:variable_{n}")
        print(f"        expr: {json.dumps(inner)}")
PY
"$promtool" check rules "$tmp/dashboard-queries.yaml" > /dev/null || die "a query of $dashboard does not parse"
echo "check-alerts: the dashboard's $(grep -c 'record:' "$tmp/dashboard-queries.yaml") queries parse"

# Metric names: the rules' and the dashboard's, against docs/operating.md's metrics table.
documented=$(grep '^| `aether_federation_' "$root/docs/operating.md" | cut -d'`' -f2 | sed 's/{.*//' | sort -u)
histograms=$(grep '^| `aether_federation_' "$root/docs/operating.md" | grep '| histogram |' | cut -d'`' -f2 | sed 's/{.*//')
known=$(printf '%s\n' "$documented"; for h in $histograms; do printf '%s\n' "${h}_bucket" "${h}_sum" "${h}_count"; done)
used=$(grep -oh 'aether_federation_[a-z0-9_]*' "$tmp/default.yaml" "$source_rules" "$dashboard" | sort -u)
unknown=$(comm -23 <(printf '%s\n' "$used") <(printf '%s\n' "$known" | sort -u))
[[ -z $unknown ]] || die "not in docs/operating.md's metrics table: $(echo $unknown)"
echo "check-alerts: the rules and the dashboard use $(echo "$used" | wc -l) documented metrics"

# Runbooks: every runbook_url's anchor is a heading of docs/runbooks.md (GitHub's slug of it), at
# the chart version's tag; the dashboard links the same page.
anchors=$(grep '^#' "$root/docs/runbooks.md" | sed 's/^#* *//' | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9_\n-' | sort -u)
while read -r url; do
  [[ $url == "$runbooks#"* ]] || die "runbook_url $url is not in $runbooks"
  grep -qxF "${url#*#}" <<< "$anchors" || die "docs/runbooks.md has no section #${url#*#}"
done < <(grep -o 'runbook_url: .*' "$tmp/default.yaml" | cut -d' ' -f2)
[[ $(grep -c 'runbook_url:' "$tmp/default.yaml") == $(grep -c -- '- alert:' "$tmp/default.yaml") ]] || die "an alert without a runbook_url"
grep -qF "\"url\": \"$runbooks\"" "$dashboard" || die "the dashboard's runbooks link is not $runbooks"
echo "check-alerts: every alert links its runbook at v$version"

if [[ -x $bin/kubectl ]]; then
  "$bin/kubectl" kustomize "$root/config/prometheus" > /dev/null
  echo "check-alerts: config/prometheus builds with kustomize"
fi
