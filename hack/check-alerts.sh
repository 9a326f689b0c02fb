#!/usr/bin/env bash
# Checks the alert rules (`make check-alerts`, the first step of `make test`):
#   - promtool's check of charts/aether-federation/files/prometheus-rules.yaml, the canonical file;
#   - promtool's unit tests in config/prometheus/tests/ (a firing and a quiet case per alert);
#   - that config/prometheus/prometheusrule.yaml (kustomize) carries exactly the same groups;
#   - that every query of the Grafana dashboard (charts/aether-federation/files/dashboard.json)
#     parses, with its variables filled in;
#   - that the rules and the dashboard name only metrics docs/operating.md's table documents (a
#     unit test checks that table against the real exposition);
#   - that every alert's runbook_url names a section of docs/runbooks.md;
#   - that config/prometheus builds with kustomize.
#
#   hack/check-alerts.sh          check
#   hack/check-alerts.sh --write  copy the chart's groups into config/prometheus/prometheusrule.yaml
#
# promtool comes from `make tools` (AETHER_TOOLS_BIN, or ~/.cache/aether-federation/tools/bin).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rules=$root/charts/aether-federation/files/prometheus-rules.yaml
dashboard=$root/charts/aether-federation/files/dashboard.json
copy=$root/config/prometheus/prometheusrule.yaml
bin=${AETHER_TOOLS_BIN:-$HOME/.cache/aether-federation/tools/bin}

die() { echo "check-alerts: $*" >&2; exit 1; }

# The copy is a PrometheusRule whose spec is the chart's file indented by two spaces: everything
# from the line `spec:` on belongs to the rules, everything above it (metadata) to the copy.
head_of_copy() { sed '/^spec:$/q' "$copy"; }
groups_of_copy() { sed '1,/^spec:$/d' "$copy" | sed 's/^  //'; }

if [[ "${1:-}" == "--write" ]]; then
  grep -qx 'spec:' "$copy" || die "$copy has no 'spec:' line to put the groups under"
  { head_of_copy; sed 's/^./  &/' "$rules"; } > "$copy.tmp"
  mv "$copy.tmp" "$copy"
  echo "check-alerts: wrote the groups of $rules into $copy"
  exit 0
fi

promtool=$bin/promtool
[[ -x $promtool ]] || die "$promtool is missing: run 'make tools' (or set AETHER_TOOLS_BIN)"

"$promtool" check rules "$rules"
(cd "$root/config/prometheus/tests" && "$promtool" test rules ./*.yaml)

if ! diff -u --label "$rules" --label "$copy (spec)" "$rules" <(groups_of_copy); then
  die "config/prometheus/prometheusrule.yaml's groups differ from the chart's rules file; run 'hack/check-alerts.sh --write'"
fi
echo "check-alerts: config/prometheus/prometheusrule.yaml carries the chart's groups"

# The dashboard's queries as recording rules, for promtool to parse.
command -v python3 >/dev/null || die "python3 is needed to read the dashboard's queries"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$dashboard" > "$tmp/dashboard-queries.yaml" <<'PY'
import json, sys
board = json.load(open(sys.argv[1]))
def panels(items):
    for p in items:
        yield p
        yield from panels(p.get("panels", []))
fill = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
        "$namespace": ".*", "$region": ".*", "$peer": ".*"}
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
used=$(grep -oh 'aether_federation_[a-z0-9_]*' "$rules" "$dashboard" | sort -u)
unknown=$(comm -23 <(printf '%s\n' "$used") <(printf '%s\n' "$known" | sort -u))
[[ -z $unknown ]] || die "not in docs/operating.md's metrics table: $(echo $unknown)"
echo "check-alerts: the rules and the dashboard use $(echo "$used" | wc -l) documented metrics"

# Runbooks: every runbook_url's anchor is a heading of docs/runbooks.md (GitHub's slug of it).
anchors=$(grep '^#' "$root/docs/runbooks.md" | sed 's/^#* *//' | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9_\n-' | sort -u)
while read -r url; do
  [[ $url == https://github.com/aether/aether-federation/blob/main/docs/runbooks.md#* ]] || die "runbook_url $url is not in docs/runbooks.md"
  grep -qxF "${url#*#}" <<< "$anchors" || die "docs/runbooks.md has no section #${url#*#}"
done < <(grep -o 'runbook_url: .*' "$rules" | cut -d' ' -f2)
[[ $(grep -c 'runbook_url:' "$rules") == $(grep -c -- '- alert:' "$rules") ]] || die "an alert without a runbook_url"
echo "check-alerts: every alert links its runbook"

if [[ -x $bin/kubectl ]]; then
  "$bin/kubectl" kustomize "$root/config/prometheus" > /dev/null
  echo "check-alerts: config/prometheus builds with kustomize"
fi
