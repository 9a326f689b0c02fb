#!/usr/bin/env bash
# The kind e2e's first real-cluster scenario: two regions (a, b) from hack/kind/federation.sh, the
# operator image `make image` built (target/image/aether-operator-<version>.oci.tar) loaded with
# hack/kind/load-operator.sh, the packaged chart (target/chart/aether-federation-<version>.tgz)
# installed with Helm into each cluster with the RegionPeering it renders from values, then:
#
#   1. both RegionPeerings Ready (kubectl wait, with a deadline);
#   2. data path a -> b: N endpoint keys put into a's registry etcd under /aether/v1/regions/a/
#      appear in b's etcd, verbatim (keys and values equal to the origin's); some are deleted and
#      disappear from b; the same b -> a;
#   3. leader handoff in a: the leader Pod (the holder of the Lease aether-operator-leader) is
#      deleted gracefully; while the standby takes over, b's copy of a's subtree is read
#      continuously and must never lose a key (for at least the lease TTL plus a keepalive
#      interval, so a lapse would show); regionpeering a must be Ready again under the new leader,
#      with status.peers[b].replication.resyncs unchanged.
#
#   hack/kind/e2e.sh            run it; the clusters are deleted at the end (federation.sh down)
#   KEEP=1 hack/kind/e2e.sh     keep the clusters (and dockerd) afterwards
#
# Knobs: AETHER_E2E_KEYS (endpoint keys per region, default 50), AETHER_E2E_DELETE (how many of them
# are deleted, default 10), AETHER_E2E_READY_TIMEOUT (s, default 300), AETHER_E2E_PROPAGATION_TIMEOUT
# (s, default 120), AETHER_E2E_HANDOFF_TIMEOUT (s, default 180).
#
# Needs what federation.sh and load-operator.sh need (root, the node image's cache, `make tools`'
# helm and etcdctl, python3), the operator's OCI archive (`make image`; this script never builds
# Rust), and runs offline. Every wait polls with a deadline and says what it saw on a timeout; any
# failure dumps `kubectl describe` of the pods and RegionPeerings, the operator's logs and the
# events of both clusters. The measured times are printed at the end, on failure too.
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

REGIONS=(a b)
NS=aether-system
RELEASE=aether
NODEPORT=${AETHER_KIND_ETCD_NODEPORT:-32379}
N_KEYS=${AETHER_E2E_KEYS:-50}
N_DELETE=${AETHER_E2E_DELETE:-10}
READY_TIMEOUT=${AETHER_E2E_READY_TIMEOUT:-300}
PROPAGATION_TIMEOUT=${AETHER_E2E_PROPAGATION_TIMEOUT:-120}
HANDOFF_TIMEOUT=${AETHER_E2E_HANDOFF_TIMEOUT:-180}
LEASE_NAME=aether-operator-leader     # the chart's leaderElection.leaseName

root=$(cd "$kind_dir/../.." && pwd)
fed_dir=${AETHER_KIND_FED_DIR:-/tmp/aether-kind-federation}
kubeconfig=$fed_dir/kubeconfig
kubectl_bin=$tools_dir/kind-kube-$KUBE_VERSION/kubectl
helm_bin=$bin_dir/helm
etcdctl_bin=$bin_dir/etcdctl
started_file=${AETHER_KIND_STATE_DIR:-/run/aether-federation}/dockerd.started-by-engine-sh

need_root "the kind e2e"
((N_DELETE < N_KEYS)) || die "AETHER_E2E_DELETE ($N_DELETE) must be less than AETHER_E2E_KEYS ($N_KEYS)"
[[ -x $helm_bin ]] || die "$helm_bin is missing: run 'make tools'"
[[ -x $etcdctl_bin ]] || die "$etcdctl_bin is missing: run 'make tools'"
command -v python3 >/dev/null || die "python3 is needed"
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml")
[[ -n $version ]] || die "no version in Cargo.toml's [workspace.package]"
archive=${AETHER_OPERATOR_ARCHIVE:-$root/target/image/aether-operator-$version.oci.tar}
[[ -f $archive ]] || die "$archive does not exist: run 'make image' first (this script does not build the operator)"
chart_tgz=$root/target/chart/aether-federation-$version.tgz

# --- Helpers ----------------------------------------------------------------------------------------
now_ms() { date +%s%3N; }
secs() { awk -v ms="$1" 'BEGIN { printf "%.1f", ms / 1000 }'; }   # milliseconds -> "12.3"
k() { local r=$1; shift; "$kubectl_bin" --kubeconfig "$kubeconfig" --context "kind-aether-$r" "$@"; }
h() { local r=$1; shift; "$helm_bin" --kubeconfig "$kubeconfig" --kube-context "kind-aether-$r" "$@"; }
node_of() { echo "aether-$1-control-plane"; }
node_ip() { docker inspect -f '{{with index .NetworkSettings.Networks "kind"}}{{.IPAddress}}{{end}}' "$(node_of "$1")" 2>/dev/null; }
# etcdctl from this host against region R's registry etcd (NodePort over the kind network), as root.
ectl() {
  local r=$1 d=$fed_dir/region-$1; shift
  "$etcdctl_bin" --endpoints "https://$(cat "$d/node-ip"):$NODEPORT" --cacert "$d/ca.crt" \
    --cert "$d/client-root.crt" --key "$d/client-root.key" --dial-timeout 5s --command-timeout 10s "$@"
}
prefix_of() { echo "/aether/v1/regions/$1/"; }
endpoint_key() { # REGION I: the v1 layout of operator/src/keys.rs
  echo "/aether/v1/regions/$1/clusters/kind-$1/services/echo/protocols/http/endpoints/10.$2.$(($3 / 250)).$(($3 % 250 + 1))"
}
region_index() { case $1 in a) echo 1 ;; b) echo 2 ;; *) echo 9 ;; esac; }
rp_field() { k "$1" -n "$NS" get regionpeering "$1" -o jsonpath="$2" 2>/dev/null; }
ready_status() { rp_field "$1" '{.status.conditions[?(@.type=="Ready")].status}'; }
rp_summary() { # REGION: what a person would look at
  k "$1" -n "$NS" get regionpeering "$1" -o jsonpath='leader={.status.leader} peersReady={.status.peersReady}{"\n"}{range .status.conditions[*]}  {.type}={.status} {.reason}: {.message}{"\n"}{end}{range .status.peers[*]}  peer {.region}: phase={.phase} reachable={.reachable} keys={.replication.keys} synced={.replication.synced} resyncs={.replication.resyncs} lag={.replication.lagSeconds}s/{.replication.lagRevisions}rev lastError={.lastError}{"\n"}{end}' 2>&1 || true
}

phase=preflight
declare -A times=()
order=()
record() { times[$1]=$2; order+=("$1"); say "time: $1 = $2"; }

dump() {
  local r p
  for r in "${REGIONS[@]}"; do
    docker inspect "$(node_of "$r")" >/dev/null 2>&1 || { echo "===== aether-$r: no node container =====" >&2; continue; }
    echo "===== aether-$r: pods =====" >&2
    k "$r" get pods -A -o wide >&2 2>&1 || true
    echo "===== aether-$r: describe pods in $NS =====" >&2
    k "$r" -n "$NS" describe pods >&2 2>&1 || true
    echo "===== aether-$r: regionpeerings =====" >&2
    k "$r" -n "$NS" get regionpeerings -o wide >&2 2>&1 || true
    k "$r" -n "$NS" describe regionpeerings >&2 2>&1 || true
    echo "===== aether-$r: leases, deployment, helm =====" >&2
    k "$r" -n "$NS" get leases -o wide >&2 2>&1 || true
    k "$r" -n "$NS" describe deployment "$RELEASE" >&2 2>&1 || true
    h "$r" -n "$NS" status "$RELEASE" >&2 2>&1 || true
    for p in $(k "$r" -n "$NS" get pods -l app.kubernetes.io/name=aether-operator -o name 2>/dev/null); do
      echo "===== aether-$r: logs of $p (last 200 lines) =====" >&2
      k "$r" -n "$NS" logs "$p" --tail 200 >&2 2>&1 || true
      k "$r" -n "$NS" logs "$p" --previous --tail 50 >&2 2>/dev/null || true
    done
    echo "===== aether-$r: events (last 80) =====" >&2
    k "$r" get events -A --sort-by=.lastTimestamp 2>&1 | tail -n 80 >&2 || true
  done
}

print_times() {
  local t
  ((${#order[@]})) || return 0
  echo "e2e: measured times:"
  for t in "${order[@]}"; do printf '  %-66s %s\n' "$t" "${times[$t]}"; done
}

engine_started_here=
on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  if ((rc != 0)); then
    echo "e2e: FAILED in phase '$phase' (exit $rc); what the clusters show:" >&2
    dump
  fi
  print_times
  if [[ ${KEEP:-} == 1 ]]; then
    say "KEEP=1: clusters kept (export KUBECONFIG=$kubeconfig; hack/kind/federation.sh down deletes them)"
  else
    say "deleting the clusters (hack/kind/federation.sh down ${REGIONS[*]})"
    "$kind_dir/federation.sh" down "${REGIONS[@]}" || say "federation.sh down failed (exit $?)"
    if [[ -n $engine_started_here && -f $started_file && -z $(/usr/bin/docker ps -q 2>/dev/null) ]]; then
      "$kind_dir/engine.sh" stop || true
    fi
  fi
  if ((rc == 0)); then echo "e2e: PASSED"; else echo "e2e: FAILED ($phase)"; fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

fail() { echo "e2e: FAILED: $*" >&2; exit 1; }

# --- 0. The chart, packaged as `make chart` does (hack/package.sh chart: lint, package) -------------
phase=chart
if [[ -f $chart_tgz ]]; then
  say "chart: $chart_tgz exists"
else
  t=$SECONDS
  AETHER_TOOLS_BIN=$bin_dir heavy "$root/hack/package.sh" chart || fail "hack/package.sh chart"
  [[ -f $chart_tgz ]] || fail "hack/package.sh chart did not write $chart_tgz"
  say "chart: packaged in $((SECONDS - t)) s"
fi

# --- 1. Clusters, etcd, images ----------------------------------------------------------------------
# dockerd runs unniced (the nodes' control planes live under it): started here first when it is
# down, and stopped again at the end (unless KEEP=1) when this run started it.
phase=engine
[[ -f $started_file ]] || engine_was_down=1
bin=$("$kind_dir/engine.sh") || fail "hack/kind/engine.sh"
PATH=$bin:$PATH
[[ -n ${engine_was_down:-} && -f $started_file ]] && engine_started_here=1

phase="federation.sh up"
t=$(now_ms)
heavy "$kind_dir/federation.sh" up "${REGIONS[@]}" || fail "hack/kind/federation.sh up ${REGIONS[*]}"
record "federation.sh up ${REGIONS[*]}" "$(secs $(($(now_ms) - t))) s"

phase="load-operator.sh"
t=$(now_ms)
out=$(heavy "$kind_dir/load-operator.sh" "${REGIONS[@]}") || fail "hack/kind/load-operator.sh ${REGIONS[*]}"
image_flags_line=$(grep -- '--set image.repository=' <<<"$out" | tail -n 1)
[[ -n $image_flags_line ]] || fail "load-operator.sh printed no --set image flags (it said: $out)"
read -ra image_flags <<<"$image_flags_line"
record "load-operator.sh (operator image into ${#REGIONS[@]} clusters)" "$(secs $(($(now_ms) - t))) s"

# The uninstall hook's kubectl image: federation.sh loads it already; images.sh load when a node lacks it.
phase="hook image"
hook_image=$("$kind_dir/images.sh" --print | sed -n 's/^HOOK_KUBECTL_IMAGE=//p')
[[ -n $hook_image ]] || fail "images.sh --print named no HOOK_KUBECTL_IMAGE"
missing=()
for r in "${REGIONS[@]}"; do
  docker exec "$(node_of "$r")" ctr -n k8s.io images ls -q "name==$hook_image" | grep -qxF "$hook_image" || missing+=("aether-$r")
done
if ((${#missing[@]})); then
  heavy "$kind_dir/images.sh" load "${missing[@]}" >/dev/null || fail "hack/kind/images.sh load ${missing[*]}"
fi
read -ra hook_flags <<<"$("$kind_dir/images.sh" --helm-set)"
say "operator image flags: ${image_flags[*]}; hook image flags: ${hook_flags[*]}"

# --- 2. helm install, one RegionPeering per region from the chart's values --------------------------
installed_ms=()
for r in "${REGIONS[@]}"; do
  phase="helm install aether-$r"
  peers=() peer_secrets=()
  for p in "${REGIONS[@]}"; do
    [[ $p == "$r" ]] && continue
    ip=$(node_ip "$p")
    [[ -n $ip ]] || fail "no kind-network address of $(node_of "$p")"
    peers+=("$p=https://$ip:$NODEPORT")
    peer_secrets+=(--set "regionPeering.peerTlsSecrets.$p=registry-etcd-peer-$p")
  done
  t=$(now_ms)
  h "$r" upgrade --install "$RELEASE" "$chart_tgz" -n "$NS" --wait --timeout 300s \
    "${image_flags[@]}" "${hook_flags[@]}" \
    --set regionPeering.enabled=true --set "regionPeering.region=$r" \
    --set "regionPeering.localEtcd.endpoints={https://registry-etcd.$NS.svc:2379}" \
    --set regionPeering.localEtcd.tlsSecret=registry-etcd-local \
    --set "regionPeering.peerEtcd={$(IFS=,; echo "${peers[*]}")}" "${peer_secrets[@]}" \
    >"$log_dir/aether-kind-e2e-helm-$r.log" 2>&1 || { cat "$log_dir/aether-kind-e2e-helm-$r.log" >&2; fail "helm install into aether-$r"; }
  k "$r" -n "$NS" rollout status "deployment/$RELEASE" --timeout 120s >/dev/null \
    || fail "deployment/$RELEASE in aether-$r: not rolled out within 120 s"
  record "helm install aether-$r (--wait: both replicas Ready)" "$(secs $(($(now_ms) - t))) s"
  installed_ms[${#installed_ms[@]}]=$(now_ms)
done

# --- 3. Ready ---------------------------------------------------------------------------------------
# Both polled together (each region's time counts from its own helm install), then confirmed with
# kubectl wait.
phase=ready
declare -A ready_ms=()
start=$(now_ms)
while ((${#ready_ms[@]} < ${#REGIONS[@]})); do
  for i in "${!REGIONS[@]}"; do
    r=${REGIONS[$i]}
    [[ -n ${ready_ms[$r]:-} ]] && continue
    if [[ $(ready_status "$r" || true) == True ]]; then
      ready_ms[$r]=$(now_ms)
      record "regionpeering/$r Ready (after its helm install)" "$(secs $((ready_ms[$r] - installed_ms[i]))) s"
      rp_summary "$r" >&2
    fi
  done
  ((${#ready_ms[@]} == ${#REGIONS[@]})) && break
  if (($(now_ms) - start > READY_TIMEOUT * 1000)); then
    for r in "${REGIONS[@]}"; do
      [[ -n ${ready_ms[$r]:-} ]] && continue
      echo "e2e: regionpeering/$r in aether-$r is not Ready after $READY_TIMEOUT s; it shows:" >&2
      rp_summary "$r" >&2
    done
    fail "not every RegionPeering Ready within $READY_TIMEOUT s"
  fi
  sleep 1
done
for r in "${REGIONS[@]}"; do
  k "$r" -n "$NS" wait --for=condition=Ready "regionpeering/$r" --timeout 30s >/dev/null \
    || { rp_summary "$r" >&2; fail "kubectl wait --for=condition=Ready regionpeering/$r"; }
done

# --- 4. Data path -----------------------------------------------------------------------------------
# The peer's copy of ORIGIN's subtree equals the origin's, keys and values (the mirror is verbatim).
copy_equal() { # ORIGIN PEER
  local o p
  o=$(ectl "$1" get --prefix "$(prefix_of "$1")") || return 1
  p=$(ectl "$2" get --prefix "$(prefix_of "$1")") || return 1
  [[ $o == "$p" ]]
}
count_of() { # REGION PREFIX
  ectl "$1" get --prefix "$2" --count-only -w fields 2>/dev/null | awk '/"Count"/ {print $3}'
}
show_difference() { # ORIGIN PEER
  local pre; pre=$(prefix_of "$1")
  echo "e2e: $pre on aether-$1 holds $(count_of "$1" "$pre") keys, aether-$2's copy $(count_of "$2" "$pre"); keys differing (< origin only, > peer only):" >&2
  diff <(ectl "$1" get --prefix --keys-only "$pre" 2>&1 | sed '/^$/d') <(ectl "$2" get --prefix --keys-only "$pre" 2>&1 | sed '/^$/d') | grep '^[<>]' | head -n 20 >&2 || true
  echo "e2e: regionpeering $1 shows:" >&2
  rp_summary "$1" >&2
}
wait_copy() { # ORIGIN PEER WHAT: poll until the copy equals the origin; prints the seconds it took
  local o=$1 p=$2 what=$3 start; start=$(now_ms)
  until copy_equal "$o" "$p"; do
    if (($(now_ms) - start > PROPAGATION_TIMEOUT * 1000)); then
      show_difference "$o" "$p"
      return 1
    fi
    sleep 0.25
  done
  say "ok: $what after $(secs $(($(now_ms) - start))) s"
}

run_id=$(date +%s)
for pair in "a b" "b a"; do
  read -r o p <<<"$pair"
  phase="data path $o -> $p"
  ri=$(region_index "$o")
  # A clean start for this run's keys (a KEEP=1 rerun finds the last run's).
  ectl "$o" del --prefix "/aether/v1/regions/$o/clusters/kind-$o/" >/dev/null || fail "clearing $o's test keys on aether-$o"
  t=$(now_ms)
  for ((i = 0; i < N_KEYS; i++)); do
    ectl "$o" put "$(endpoint_key "$o" "$ri" "$i")" \
      "{\"clusterName\":\"kind-$o\",\"region\":\"$o\",\"zone\":\"$o-1\",\"port\":8080,\"run\":\"$run_id\",\"i\":$i}" >/dev/null \
      || fail "etcdctl put into aether-$o's registry etcd"
  done
  t_last=$(now_ms)
  got=$(count_of "$o" "/aether/v1/regions/$o/clusters/kind-$o/")
  [[ $got == "$N_KEYS" ]] || fail "aether-$o holds $got of the $N_KEYS keys just put"
  say "put $N_KEYS endpoint keys into aether-$o in $(secs $((t_last - t))) s"
  wait_copy "$o" "$p" "$N_KEYS keys of $o visible, verbatim, in aether-$p" \
    || fail "$o's $N_KEYS keys not all in aether-$p within $PROPAGATION_TIMEOUT s"
  done_ms=$(now_ms)
  record "propagation $o -> $p: $N_KEYS puts, first put to all visible" "$(secs $((done_ms - t))) s"
  record "propagation $o -> $p: last put to all visible" "$(secs $((done_ms - t_last))) s"

  phase="deletes $o -> $p"
  t=$(now_ms)
  for ((i = 0; i < N_DELETE; i++)); do
    ectl "$o" del "$(endpoint_key "$o" "$ri" $((i * N_KEYS / N_DELETE)))" >/dev/null || fail "etcdctl del on aether-$o"
  done
  t_last=$(now_ms)
  got=$(count_of "$o" "/aether/v1/regions/$o/clusters/kind-$o/")
  [[ $got == $((N_KEYS - N_DELETE)) ]] || fail "aether-$o holds $got keys after deleting $N_DELETE of $N_KEYS"
  wait_copy "$o" "$p" "$N_DELETE deletes of $o gone from aether-$p" \
    || fail "$N_DELETE deleted keys of $o not gone from aether-$p within $PROPAGATION_TIMEOUT s"
  record "deletes $o -> $p: last delete to gone" "$(secs $(($(now_ms) - t_last))) s"
done

# --- 5. Leader handoff in a -------------------------------------------------------------------------
phase="leader handoff"
o=a p=b
k "$o" -n "$NS" rollout status "deployment/$RELEASE" --timeout 120s >/dev/null \
  || fail "deployment/$RELEASE in aether-$o: not all replicas Ready before the handoff"
holder() { k "$o" -n "$NS" get lease "$LEASE_NAME" -o jsonpath='{.spec.holderIdentity}' 2>/dev/null; }
# The status names the leader the Lease names (the status may lag a moment behind an election).
start=$SECONDS
while :; do
  leader=$(holder || true); status_leader=$(rp_field "$o" '{.status.leader}' || true)
  [[ -n $leader && $leader == "$status_leader" ]] && break
  ((SECONDS - start < 60)) || fail "Lease $LEASE_NAME names '$leader', regionpeering/$o's status.leader '$status_leader': not the same within 60 s"
  sleep 1
done
k "$o" -n "$NS" get pod "$leader" >/dev/null 2>&1 || fail "the leader '$leader' (Lease $LEASE_NAME) is not a Pod in $NS"
resyncs_before=$(rp_field "$o" "{.status.peers[?(@.region==\"$p\")].replication.resyncs}")
# Events of regionpeering/o by reason, repetitions counted (the recorder aggregates them in a series).
event_count() { # REASON
  k "$o" -n "$NS" get events --field-selector "involvedObject.kind=RegionPeering,involvedObject.name=$o,reason=$1" -o json \
    | python3 -c '
import json, sys
print(sum(max((e.get("series") or {}).get("count") or 0, e.get("count") or 0, 1) for e in json.load(sys.stdin)["items"]))'
}
resync_events_before=$(event_count ResyncStarted) || fail "reading the events of regionpeering/$o"
adopted_events_before=$(event_count LeasesAdopted) || fail "reading the events of regionpeering/$o"
[[ -n $resyncs_before ]] || fail "regionpeering/$o shows no status.peers[$p].replication.resyncs"
pre=$(prefix_of "$o")
# What b holds of a before: every key, with its mod revision and lease (python: the JSON's keys are base64).
copy_meta() {
  ectl "$p" get --prefix "$pre" -w json | python3 -c '
import base64, json, sys
d = json.load(sys.stdin)
for kv in d.get("kvs", []):
    print(base64.b64decode(kv["key"]).decode(), kv["mod_revision"], kv.get("lease", 0))'
}
expected_keys=$(ectl "$p" get --prefix --keys-only "$pre" | sed '/^$/d') || fail "reading $pre on aether-$p"
n_expected=$(wc -l <<<"$expected_keys")
meta_before=$(copy_meta) || fail "reading $pre on aether-$p as JSON"
say "handoff: leader $leader; regionpeering/$o peers[$p].resyncs=$resyncs_before; aether-$p holds $n_expected keys of $o"

# Read b's copy at least for the lease TTL plus a keepalive interval (and 5 s): a lapse would show.
min_watch_ms=$(( ($(rp_field "$o" '{.spec.lease.ttlSeconds}') + $(rp_field "$o" '{.spec.lease.keepaliveIntervalSeconds}') + 5) * 1000 ))
t0=$(now_ms)
k "$o" -n "$NS" delete pod "$leader" --wait=false >/dev/null || fail "kubectl delete pod $leader"
polls=0 errors=0 t_takeover='' t_ready='' new_leader=''
while :; do
  elapsed=$(($(now_ms) - t0))
  if keys=$(ectl "$p" get --prefix --keys-only "$pre" 2>&1); then
    polls=$((polls + 1))
    keys=$(sed '/^$/d' <<<"$keys")
    if [[ $keys != "$expected_keys" ]]; then
      echo "e2e: $(secs "$elapsed") s into the handoff, aether-$p's copy of $pre changed (< expected, > seen):" >&2
      diff <(echo "$expected_keys") <(echo "$keys") | grep '^[<>]' | head -n 20 >&2 || true
      fail "a key of $o went missing (or appeared) in aether-$p during the leader handoff"
    fi
  else
    errors=$((errors + 1))
    say "handoff: reading aether-$p failed ($errors): $(tail -n 1 <<<"$keys")"
    ((errors <= 5)) || fail "reading aether-$p's etcd failed $errors times during the handoff"
  fi
  h_now=$(holder || true)
  if [[ -z $t_takeover && -n $h_now && $h_now != "$leader" ]]; then
    t_takeover=$(now_ms) new_leader=$h_now
    say "handoff: Lease $LEASE_NAME held by $new_leader after $(secs $((t_takeover - t0))) s"
  fi
  if [[ -n $new_leader && -z $t_ready ]]; then
    if [[ $(rp_field "$o" '{.status.leader}') == "$new_leader" && $(ready_status "$o") == True ]]; then
      t_ready=$(now_ms)
      say "handoff: regionpeering/$o Ready under $new_leader after $(secs $((t_ready - t0))) s"
    fi
  fi
  [[ -n $t_ready ]] && (($(now_ms) - t0 >= min_watch_ms)) && break
  if (($(now_ms) - t0 > HANDOFF_TIMEOUT * 1000)); then
    echo "e2e: after $HANDOFF_TIMEOUT s: Lease holder '$(holder || true)' (old leader $leader), regionpeering/$o shows:" >&2
    rp_summary "$o" >&2
    fail "regionpeering/$o not Ready under a new leader within $HANDOFF_TIMEOUT s"
  fi
  sleep 0.3
done
record "handoff: leader Pod deleted to Lease held by the standby" "$(secs $((t_takeover - t0))) s"
record "handoff: leader Pod deleted to regionpeering/$o Ready under it" "$(secs $((t_ready - t0))) s"
say "handoff: $polls reads of aether-$p's copy over $(secs $(($(now_ms) - t0))) s (at least the lease TTL + a keepalive interval), $n_expected keys of $o present in every one; $errors failed reads"
resyncs_after=$(rp_field "$o" "{.status.peers[?(@.region==\"$p\")].replication.resyncs}")
resync_events_after=$(event_count ResyncStarted) adopted_events_after=$(event_count LeasesAdopted)
((resync_events_after == resync_events_before)) \
  || fail "ResyncStarted events of regionpeering/$o: $resync_events_before before the handoff, $resync_events_after after: the new leader ran a full sync"
if [[ $resyncs_after == "$resyncs_before" ]]; then
  say "ok: peers[$p].replication.resyncs unchanged across the handoff ($resyncs_after); no ResyncStarted event"
elif [[ $resyncs_after == 0 ]] && ((adopted_events_after > adopted_events_before)); then
  # The field counts "full resyncs since the worker started" (the CRD): the new leader's worker
  # starts at 0. It adopted the leases (LeasesAdopted) and ran no full sync (no ResyncStarted).
  say "ok: peers[$p].replication.resyncs was $resyncs_before under $leader (its worker's count), 0 under $new_leader, which adopted the leases (LeasesAdopted) and ran no full sync (no ResyncStarted event)"
else
  fail "regionpeering/$o peers[$p].replication.resyncs was $resyncs_before before the handoff, $resyncs_after under $new_leader (LeasesAdopted events $adopted_events_before -> $adopted_events_after)"
fi
record "handoff: peers[$p].resyncs before / after; ResyncStarted events before / after" "$resyncs_before / $resyncs_after; $resync_events_before / $resync_events_after"
# Informational: did the new leader adopt (keys untouched on b) or re-put?
meta_after=$(copy_meta) || fail "reading $pre on aether-$p as JSON"
reput=$(comm -13 <(sort <<<"$meta_before") <(sort <<<"$meta_after") | wc -l)
say "handoff: $reput of $n_expected keys of $o on aether-$p have another mod revision or lease than before (0: the new leader adopted the leases and re-put nothing)"
record "handoff: keys of $o re-put on $p by the new leader" "$reput of $n_expected"
rp_summary "$o" >&2

record "total: e2e.sh from start to here (without federation.sh down)" "$SECONDS s"
phase=finished
