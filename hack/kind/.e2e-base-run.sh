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
#      with status.peers[b].replication.resyncs unchanged;
#   4. forced leader handoff in a: the same with the leader Pod deleted with --force
#      --grace-period=0 (the API object goes at once; the kubelet still stops the container with
#      SIGTERM and its 2 s minimum grace): no key of a missing on b, no new ResyncStarted event,
#      regionpeering a Ready under the new leader within AETHER_E2E_FORCED_READY_BOUND s;
#   5. metrics over HTTPS: a ServiceAccount bound to the chart's metrics-reader ClusterRole, its
#      token (kubectl create token), /metrics of the leader through kubectl port-forward and curl
#      from this host: 200 with the operator's aether_federation_ families; no token 401, a bogus
#      token 401, an unbound ServiceAccount's token 403;
#   6. region loss: a's operator scaled to 0 and a's registry etcd (StatefulSet) scaled to 0; a's
#      copy on b must lapse within the lease TTL + keepalive interval + AETHER_E2E_LAPSE_MARGIN s of
#      the operator's pods being gone, and regionpeering b must report a unreachable (PeersReachable
#      False, peers[a].reachable false) and inbound[a].keys 0; then recovery: a's etcd and one
#      operator replica back, a's keys back on b, regionpeering a and b Ready, b's copy in a equal.
#
#   hack/kind/e2e.sh            run it; the clusters are deleted at the end (federation.sh down)
#   KEEP=1 hack/kind/e2e.sh     keep the clusters (and dockerd) afterwards
#
# Knobs: AETHER_E2E_KEYS (endpoint keys per region, default 50), AETHER_E2E_DELETE (how many of them
# are deleted, default 10), AETHER_E2E_READY_TIMEOUT (s, default 300), AETHER_E2E_PROPAGATION_TIMEOUT
# (s, default 120), AETHER_E2E_HANDOFF_TIMEOUT (s, default 180), AETHER_E2E_FORCED_READY_BOUND (s,
# default 60), AETHER_E2E_LAPSE_MARGIN (s, default 5), AETHER_E2E_STATUS_MARGIN (s, default 10: on
# top of b's acceptable pause and status refresh), AETHER_E2E_RECOVERY_TIMEOUT (s, default 180).
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
FORCED_READY_BOUND=${AETHER_E2E_FORCED_READY_BOUND:-60}
LAPSE_MARGIN=${AETHER_E2E_LAPSE_MARGIN:-5}
STATUS_MARGIN=${AETHER_E2E_STATUS_MARGIN:-10}
RECOVERY_TIMEOUT=${AETHER_E2E_RECOVERY_TIMEOUT:-180}
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
command -v curl >/dev/null || die "curl is needed (the metrics scrape; apt-get install curl)"
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
  k "$1" -n "$NS" get regionpeering "$1" -o jsonpath='leader={.status.leader} peersReady={.status.peersReady}{"\n"}{range .status.conditions[*]}  {.type}={.status} {.reason}: {.message}{"\n"}{end}{range .status.peers[*]}  peer {.region}: phase={.phase} reachable={.reachable} keys={.replication.keys} synced={.replication.synced} resyncs={.replication.resyncs} lag={.replication.lagSeconds}s/{.replication.lagRevisions}rev lastError={.lastError}{"\n"}{end}{range .status.inbound[*]}  inbound {.region}: keys={.keys} synced={.synced} leaseTtlRemaining={.leaseTtlRemainingSeconds}s{"\n"}{end}' 2>&1 || true
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
  if [[ -n ${pf_pid:-} ]]; then kill "$pf_pid" 2>/dev/null || true; wait "$pf_pid" 2>/dev/null || true; fi
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

# --- 5. Leader handoffs in a: graceful, then forced -------------------------------------------------
o=a p=b
pre=$(prefix_of "$o")
holder() { k "$o" -n "$NS" get lease "$LEASE_NAME" -o jsonpath='{.spec.holderIdentity}' 2>/dev/null; }
lease_line() { k "$o" -n "$NS" get lease "$LEASE_NAME" -o jsonpath='{.spec.holderIdentity}|{.spec.renewTime}|{.spec.leaseDurationSeconds}' 2>/dev/null; }
# Events of regionpeering/o by reason, repetitions counted (the recorder aggregates them in a series).
event_count() { # REASON
  k "$o" -n "$NS" get events --field-selector "involvedObject.kind=RegionPeering,involvedObject.name=$o,reason=$1" -o json \
    | python3 -c '
import json, sys
print(sum(max((e.get("series") or {}).get("count") or 0, e.get("count") or 0, 1) for e in json.load(sys.stdin)["items"]))'
}
# What b holds of a: every key, with its mod revision and lease (python: the JSON's keys are base64).
copy_meta() {
  ectl "$p" get --prefix "$pre" -w json | python3 -c '
import base64, json, sys
d = json.load(sys.stdin)
for kv in d.get("kvs", []):
    print(base64.b64decode(kv["key"]).decode(), kv["mod_revision"], kv.get("lease", 0))'
}
deploy_arg() { # REGION FLAG: the value of --FLAG=... in the operator container's args ("true" for a bare --FLAG)
  k "$1" -n "$NS" get deployment "$RELEASE" -o jsonpath='{.spec.template.spec.containers[?(@.name=="operator")].args}' 2>/dev/null \
    | python3 -c 'import json, sys
flag = "--" + sys.argv[1]
for a in json.load(sys.stdin):
    if a == flag: print("true")
    elif a.startswith(flag + "="): print(a.split("=", 1)[1])' "$2"
}

# leader_handoff graceful|forced: the leader Pod of a is deleted (forced: --force --grace-period=0:
# the Pod object goes at once, a replacement starts while the old container may still run, and
# the kubelet gives it only its 2 s minimum grace after SIGTERM); b's copy of a's
# subtree is read about twice a second for at least the lease TTL + keepalive interval + 5 s and
# must hold every key in every read; the standby takes the Lease and regionpeering a is Ready under
# it (forced: within AETHER_E2E_FORCED_READY_BOUND s); no new ResyncStarted event, and resyncs
# unchanged (or 0 under the new leader with a new LeasesAdopted event).
leader_handoff() {
  local mode=$1 label delete_flags=()
  case $mode in
    graceful) label=handoff delete_flags=(--wait=false) ;;
    forced) label="forced handoff" delete_flags=(--force --grace-period=0 --wait=false) ;;
    *) fail "leader_handoff: unknown mode '$mode'" ;;
  esac
  phase="leader handoff ($mode)"
  k "$o" -n "$NS" rollout status "deployment/$RELEASE" --timeout 120s >/dev/null \
    || fail "deployment/$RELEASE in aether-$o: not all replicas Ready before the $label"
  # The status names the leader the Lease names (the status may lag a moment behind an election).
  local start=$SECONDS leader status_leader
  while :; do
    leader=$(holder || true); status_leader=$(rp_field "$o" '{.status.leader}' || true)
    [[ -n $leader && $leader == "$status_leader" ]] && break
    ((SECONDS - start < 60)) || fail "Lease $LEASE_NAME names '$leader', regionpeering/$o's status.leader '$status_leader': not the same within 60 s"
    sleep 1
  done
  k "$o" -n "$NS" get pod "$leader" >/dev/null 2>&1 || fail "the leader '$leader' (Lease $LEASE_NAME) is not a Pod in $NS"
  local resyncs_before resync_events_before adopted_events_before expected_keys n_expected meta_before
  resyncs_before=$(rp_field "$o" "{.status.peers[?(@.region==\"$p\")].replication.resyncs}")
  resync_events_before=$(event_count ResyncStarted) || fail "reading the events of regionpeering/$o"
  adopted_events_before=$(event_count LeasesAdopted) || fail "reading the events of regionpeering/$o"
  [[ -n $resyncs_before ]] || fail "regionpeering/$o shows no status.peers[$p].replication.resyncs"
  expected_keys=$(ectl "$p" get --prefix --keys-only "$pre" | sed '/^$/d') || fail "reading $pre on aether-$p"
  n_expected=$(wc -l <<<"$expected_keys")
  meta_before=$(copy_meta) || fail "reading $pre on aether-$p as JSON"
  local ttl ka lease_duration
  ttl=$(rp_field "$o" '{.spec.lease.ttlSeconds}') ka=$(rp_field "$o" '{.spec.lease.keepaliveIntervalSeconds}')
  lease_duration=$(deploy_arg "$o" leader-lease-duration)
  say "$label: leader $leader; regionpeering/$o peers[$p].resyncs=$resyncs_before; aether-$p holds $n_expected keys of $o; mirror leases TTL ${ttl}s, keepalive ${ka}s; leader Lease duration ${lease_duration:-?}s"

  # Read b's copy at least for the lease TTL plus a keepalive interval (and 5 s): a lapse would show.
  local min_watch_ms=$(((ttl + ka + 5) * 1000))
  local t0 polls=0 errors=0 t_takeover='' t_ready='' new_leader='' elapsed keys h_now h_renew h_dur line last_renew='' last_dur='' emptied=''
  # The Lease as the leader last renewed it before the delete (a released Lease may never show the
  # old holder again).
  if line=$(lease_line) && [[ -n $line ]]; then
    IFS='|' read -r h_now h_renew h_dur <<<"$line" || true
    [[ $h_now == "$leader" && -n $h_renew ]] && last_renew=$h_renew last_dur=$h_dur
  fi
  t0=$(now_ms)
  k "$o" -n "$NS" delete pod "$leader" "${delete_flags[@]}" >/dev/null || fail "kubectl delete pod $leader ${delete_flags[*]}"
  while :; do
    elapsed=$(($(now_ms) - t0))
    if keys=$(ectl "$p" get --prefix --keys-only "$pre" 2>&1); then
      polls=$((polls + 1))
      keys=$(sed '/^$/d' <<<"$keys")
      if [[ $keys != "$expected_keys" ]]; then
        echo "e2e: $(secs "$elapsed") s into the $label, aether-$p's copy of $pre changed (< expected, > seen):" >&2
        diff <(echo "$expected_keys") <(echo "$keys") | grep '^[<>]' | head -n 20 >&2 || true
        echo "e2e: Lease holder '$(holder || true)' (old leader $leader); regionpeering/$o shows:" >&2
        rp_summary "$o" >&2
        fail "a key of $o went missing (or appeared) in aether-$p during the $label"
      fi
    else
      errors=$((errors + 1))
      say "$label: reading aether-$p failed ($errors): $(tail -n 1 <<<"$keys")"
      ((errors <= 5)) || fail "reading aether-$p's etcd failed $errors times during the $label"
    fi
    h_now='' h_renew='' h_dur=''
    if line=$(lease_line) && [[ -n $line ]]; then
      IFS='|' read -r h_now h_renew h_dur <<<"$line" || true
      [[ -z $t_takeover && -z $h_now ]] && emptied=1
    fi
    # The old holder's last renewal seen: did the standby wait for its Lease to expire, or was it
    # released (the old leader releases it on SIGTERM)?
    [[ -z $t_takeover && $h_now == "$leader" && -n $h_renew ]] && last_renew=$h_renew last_dur=$h_dur
    if [[ -z $t_takeover && -n $h_now && $h_now != "$leader" ]]; then
      t_takeover=$(now_ms) new_leader=$h_now
      say "$label: Lease $LEASE_NAME held by $new_leader after $(secs $((t_takeover - t0))) s"
    fi
    if [[ -n $new_leader && -z $t_ready ]]; then
      if [[ $(rp_field "$o" '{.status.leader}') == "$new_leader" && $(ready_status "$o") == True ]]; then
        t_ready=$(now_ms)
        say "$label: regionpeering/$o Ready under $new_leader after $(secs $((t_ready - t0))) s"
      fi
    fi
    [[ -n $t_ready ]] && (($(now_ms) - t0 >= min_watch_ms)) && break
    if (($(now_ms) - t0 > HANDOFF_TIMEOUT * 1000)); then
      echo "e2e: after $HANDOFF_TIMEOUT s of the $label: Lease holder '$(holder || true)' (old leader $leader), regionpeering/$o shows:" >&2
      rp_summary "$o" >&2
      fail "regionpeering/$o not Ready under a new leader within $HANDOFF_TIMEOUT s of the $label"
    fi
    sleep 0.3
  done
  record "$label: leader Pod deleted to Lease held by the standby" "$(secs $((t_takeover - t0))) s"
  # Informational: was the Lease released (its holder seen empty) or waited out? The standby
  # notices either only at its next try, so the takeover time alone does not tell.
  local expiry_ms how
  if [[ -n $emptied ]]; then
    how="released by $leader (holderIdentity seen empty before $new_leader took it)"
  else
    how="never seen released by $leader"
    if [[ -n $last_renew && -n $last_dur ]] && expiry_ms=$(date -d "$last_renew" +%s%3N 2>/dev/null); then
      expiry_ms=$((expiry_ms + last_dur * 1000))
      how+="; taken $(secs $((t_takeover - expiry_ms))) s after its last renewal seen ($last_renew) + ${last_dur} s"
    fi
  fi
  say "$label: the leader Lease was $how"
  record "$label: leader Lease" "$how"
  record "$label: leader Pod deleted to regionpeering/$o Ready under it" "$(secs $((t_ready - t0))) s"
  if [[ $mode == forced ]]; then
    ((t_ready - t0 <= FORCED_READY_BOUND * 1000)) \
      || fail "regionpeering/$o Ready under $new_leader $(secs $((t_ready - t0))) s after the forced delete of $leader: over the bound of $FORCED_READY_BOUND s"
    say "ok: $label: regionpeering/$o Ready $(secs $((t_ready - t0))) s after the forced delete (bound $FORCED_READY_BOUND s)"
  fi
  say "$label: $polls reads of aether-$p's copy over $(secs $(($(now_ms) - t0))) s (at least the lease TTL + a keepalive interval), $n_expected keys of $o present in every one; $errors failed reads"
  local resyncs_after resync_events_after adopted_events_after meta_after reput
  resyncs_after=$(rp_field "$o" "{.status.peers[?(@.region==\"$p\")].replication.resyncs}")
  resync_events_after=$(event_count ResyncStarted) adopted_events_after=$(event_count LeasesAdopted)
  ((resync_events_after == resync_events_before)) \
    || fail "ResyncStarted events of regionpeering/$o: $resync_events_before before the $label, $resync_events_after after: the new leader ran a full sync"
  if [[ $resyncs_after == "$resyncs_before" ]]; then
    say "ok: peers[$p].replication.resyncs unchanged across the $label ($resyncs_after); no ResyncStarted event"
  elif [[ $resyncs_after == 0 ]] && ((adopted_events_after > adopted_events_before)); then
    # The field counts "full resyncs since the worker started" (the CRD): the new leader's worker
    # starts at 0. It adopted the leases (LeasesAdopted) and ran no full sync (no ResyncStarted).
    say "ok: peers[$p].replication.resyncs was $resyncs_before under $leader (its worker's count), 0 under $new_leader, which adopted the leases (LeasesAdopted) and ran no full sync (no ResyncStarted event)"
  else
    fail "regionpeering/$o peers[$p].replication.resyncs was $resyncs_before before the $label, $resyncs_after under $new_leader (LeasesAdopted events $adopted_events_before -> $adopted_events_after)"
  fi
  record "$label: peers[$p].resyncs before / after; ResyncStarted events before / after" "$resyncs_before / $resyncs_after; $resync_events_before / $resync_events_after"
  # Informational: did the new leader adopt (keys untouched on b) or re-put?
  meta_after=$(copy_meta) || fail "reading $pre on aether-$p as JSON"
  reput=$(comm -13 <(sort <<<"$meta_before") <(sort <<<"$meta_after") | wc -l)
  say "$label: $reput of $n_expected keys of $o on aether-$p have another mod revision or lease than before (0: the new leader adopted the leases and re-put nothing)"
  record "$label: keys of $o re-put on $p by the new leader" "$reput of $n_expected"
  rp_summary "$o" >&2
}
leader_handoff graceful
leader_handoff forced

# --- 6. Metrics over HTTPS, with a ServiceAccount token ---------------------------------------------
# The chart (metrics.secure, default true) serves /metrics, /healthz and /readyz on one HTTPS port
# (metrics.port, 8443) with a self-signed certificate; /metrics answers only bearer tokens the API
# server authenticates (TokenReview) and allows `get` on the non-resource URL /metrics
# (SubjectAccessReview): the ClusterRole <namespace>-<release>-metrics-reader grants it. From the
# host through `kubectl port-forward` to the leader Pod (no image is pulled, and the operator's
# image has no shell): a bound ServiceAccount's token gets 200 and the operator's families; no
# token, or a token that is not one, 401; an unbound ServiceAccount's token 403.
SCRAPER_SA=aether-e2e-metrics-scraper
UNBOUND_SA=aether-e2e-metrics-unbound
pf_pid=''
stop_port_forward() {
  [[ -n $pf_pid ]] || return 0
  kill "$pf_pid" 2>/dev/null || true
  wait "$pf_pid" 2>/dev/null || true
  pf_pid=''
}
# scrape_metrics URL TOKEN OUT: writes the body to OUT, prints the HTTP status (000: no answer).
scrape_metrics() {
  local auth=()
  [[ -n $2 ]] && auth=(-H "Authorization: Bearer $2")
  curl -sk --max-time 10 -o "$3" -w '%{http_code}' "${auth[@]}" "$1" 2>/dev/null || true
}
metrics_scrape() {
  phase="metrics over HTTPS"
  local leader secure port role scheme pf_log body lp status t start
  leader=$(holder) || fail "no holder of the Lease $LEASE_NAME in aether-$o"
  k "$o" -n "$NS" wait --for=condition=Ready "pod/$leader" --timeout 60s >/dev/null || fail "the leader pod $leader is not Ready"
  secure=$(deploy_arg "$o" metrics-secure)
  port=$(k "$o" -n "$NS" get deployment "$RELEASE" -o jsonpath='{.spec.template.spec.containers[?(@.name=="operator")].ports[?(@.name=="metrics")].containerPort}')
  [[ -n $port ]] || fail "deployment/$RELEASE in aether-$o has no container port named metrics"
  if [[ $secure == true ]]; then
    scheme=https
    role=$(k "$o" get clusterroles -l "app.kubernetes.io/instance=$RELEASE" -o name | sed -n 's|^clusterrole.rbac.authorization.k8s.io/\(.*-metrics-reader\)$|\1|p')
    [[ -n $role ]] || fail "the chart rendered no ClusterRole *-metrics-reader (metrics.secure is on: it should): $(k "$o" get clusterroles -l "app.kubernetes.io/instance=$RELEASE" -o name 2>&1 | tr '\n' ' ')"
    say "metrics: the chart serves HTTPS with bearer-token authorization on port $port (--metrics-secure); reader ClusterRole $role: $(k "$o" get clusterrole "$role" -o jsonpath='{.rules}')"
  else
    scheme=http
    say "metrics: the chart runs the metrics listener as plain HTTP (no --metrics-secure) on port $port: /metrics is open to anyone reaching the port; testing that"
  fi
  k "$o" -n "$NS" create serviceaccount "$SCRAPER_SA" --dry-run=client -o yaml | k "$o" apply -f - >/dev/null || fail "ServiceAccount $SCRAPER_SA"
  k "$o" -n "$NS" create serviceaccount "$UNBOUND_SA" --dry-run=client -o yaml | k "$o" apply -f - >/dev/null || fail "ServiceAccount $UNBOUND_SA"
  if [[ $secure == true ]]; then
    k "$o" create clusterrolebinding "$SCRAPER_SA" --clusterrole "$role" --serviceaccount "$NS:$SCRAPER_SA" --dry-run=client -o yaml \
      | k "$o" apply -f - >/dev/null || fail "ClusterRoleBinding $SCRAPER_SA -> $role"
  fi
  local token unbound_token
  token=$(k "$o" -n "$NS" create token "$SCRAPER_SA" --duration 10m) || fail "kubectl create token $SCRAPER_SA"
  unbound_token=$(k "$o" -n "$NS" create token "$UNBOUND_SA" --duration 10m) || fail "kubectl create token $UNBOUND_SA"

  pf_log=$log_dir/aether-kind-e2e-port-forward.log body=$log_dir/aether-kind-e2e-metrics.txt
  k "$o" -n "$NS" port-forward --address 127.0.0.1 "pod/$leader" ":$port" >"$pf_log" 2>&1 &
  pf_pid=$!
  start=$SECONDS lp=''
  until lp=$(sed -n 's/^Forwarding from 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$pf_log" | head -n 1) && [[ -n $lp ]]; do
    kill -0 "$pf_pid" 2>/dev/null || fail "kubectl port-forward to $leader:$port exited: $(cat "$pf_log")"
    ((SECONDS - start < 30)) || fail "kubectl port-forward to $leader:$port: no local port within 30 s; it said: $(cat "$pf_log")"
    sleep 0.5
  done
  local url=$scheme://127.0.0.1:$lp/metrics
  say "metrics: kubectl port-forward pod/$leader 127.0.0.1:$lp -> $port; scraping $url"

  # With the bound ServiceAccount's token: 200 (retried for 30 s: the first connection may race
  # the forward).
  start=$SECONDS
  while :; do
    t=$(now_ms)
    status=$(scrape_metrics "$url" "$token" "$body")
    t=$(($(now_ms) - t))
    [[ $status == 200 ]] && break
    if ((SECONDS - start >= 30)); then
      echo "e2e: GET $url with $SCRAPER_SA's token: HTTP $status; body: $(head -c 400 "$body" 2>/dev/null); port-forward said: $(tail -n 5 "$pf_log")" >&2
      fail "/metrics of $leader with the token of $SCRAPER_SA (bound to ${role:-nothing}): HTTP $status, not 200"
    fi
    sleep 1
  done
  local families
  families=$(grep -c '^# TYPE aether_federation_' "$body" || true)
  say "metrics: with $SCRAPER_SA's token: HTTP 200, $(wc -c <"$body") bytes, $families aether_federation_ families, in $(secs "$t") s; the operator's own series:"
  grep -E '^aether_federation_(build_info|leader|mirrored_keys|inbound_keys|leases|replication_synced)[{ ]' "$body" | head -n 12 >&2 || true
  grep -q '^aether_federation_build_info{' "$body" || fail "/metrics of $leader has no aether_federation_build_info series"
  grep -qx 'aether_federation_leader 1' "$body" || fail "/metrics of $leader: aether_federation_leader is not 1 on the leader ($(grep '^aether_federation_leader ' "$body" || echo absent))"
  grep -q "^aether_federation_mirrored_keys{origin=\"$o\",target=\"$p\"}" "$body" \
    || fail "/metrics of $leader has no aether_federation_mirrored_keys{origin=\"$o\",target=\"$p\"} (the mirror $o -> $p)"
  record "metrics: HTTP 200 scrape of the leader with a ServiceAccount token ($families families)" "$(secs "$t") s"

  # Without a token, with a token that is none, with an unbound ServiceAccount's token.
  local what expect got
  for what in none garbage unbound; do
    case $what in
      none) status=$(scrape_metrics "$url" "" "$body") expect="401 403" ;;
      garbage) status=$(scrape_metrics "$url" "not-a-token" "$body") expect="401" ;;
      unbound) status=$(scrape_metrics "$url" "$unbound_token" "$body") expect="403" ;;
    esac
    got=$(head -c 200 "$body" 2>/dev/null | tr '\n' ' ')
    if [[ $secure != true ]]; then
      say "metrics: plain HTTP: token '$what' -> HTTP $status (open: nothing to refuse)"
      continue
    fi
    [[ " $expect " == *" $status "* ]] \
      || fail "/metrics of $leader with token '$what': HTTP $status, expected ${expect// / or }; body: $got"
    grep -q '^aether_federation_' "$body" && fail "/metrics of $leader with token '$what' answered HTTP $status with metrics in the body"
    say "ok: metrics: token '$what' -> HTTP $status ($got)"
    record "metrics: /metrics with token '$what' (expected ${expect// / or })" "HTTP $status"
  done
  stop_port_forward
}
metrics_scrape

# --- 7. Region loss: a's operator and etcd stop; a's copy lapses on b; b's status ------------------
# The operator revokes nothing when it stops (controllers/leader.rs, mirror/worker.rs): a's keys
# on b lapse with their leases, at the latest the lease TTL after the last renewal, which was at most
# a keepalive interval before the operator went away. Bound, from the moment the operator's pods are
# gone: TTL + keepalive interval + AETHER_E2E_LAPSE_MARGIN (5 s). b's failure detector calls a
# unreachable once no round trip to a's etcd succeeded for the acceptable pause
# (spec.failureDetector, default 2 x keepalive, below the TTL); b's status shows it at its next
# reconcile (--refresh-seconds): bound, from a's etcd pod gone, pause + refresh + AETHER_E2E_STATUS_MARGIN.
rp_peer_of() { rp_field "$1" "{.status.peers[?(@.region==\"$2\")].$3}"; }
rp_inbound_of() { rp_field "$1" "{.status.inbound[?(@.region==\"$2\")].$3}"; }
rp_cond() { rp_field "$1" "{.status.conditions[?(@.type==\"$2\")].$3}"; }
b_view_of_a() { # one line: what b's status says about a
  echo "Ready=$(rp_cond "$p" Ready status)/$(rp_cond "$p" Ready reason)" \
    "PeersReachable=$(rp_cond "$p" PeersReachable status)/$(rp_cond "$p" PeersReachable reason) '$(rp_cond "$p" PeersReachable message)'" \
    "peers[$o]: phase=$(rp_peer_of "$p" "$o" phase) reachable=$(rp_peer_of "$p" "$o" reachable) keepaliveFailures=$(rp_peer_of "$p" "$o" keepalive.consecutiveFailures) lastError='$(rp_peer_of "$p" "$o" lastError)'" \
    "inbound[$o]: keys=$(rp_inbound_of "$p" "$o" keys) synced=$(rp_inbound_of "$p" "$o" synced) leaseTtlRemaining=$(rp_inbound_of "$p" "$o" leaseTtlRemainingSeconds)" \
    "inboundSummary='$(rp_field "$p" '{.status.inboundSummary}')' refreshed=$(rp_field "$p" '{.status.refreshedTime}')"
}
operator_pods() { k "$o" -n "$NS" get pods -l "app.kubernetes.io/name=aether-operator,app.kubernetes.io/instance=$RELEASE" -o name 2>/dev/null; }
region_loss() {
  phase="region loss ($o)"
  local ttl ka pause refresh lapse_bound status_bound n_before fed_before
  ttl=$(rp_field "$o" '{.spec.lease.ttlSeconds}') ka=$(rp_field "$o" '{.spec.lease.keepaliveIntervalSeconds}')
  [[ -n $ttl && -n $ka ]] || fail "regionpeering/$o shows no spec.lease.ttlSeconds/keepaliveIntervalSeconds"
  pause=$(rp_field "$p" '{.spec.failureDetector.acceptablePauseSeconds}' || true)
  [[ -n $pause ]] || pause=$(((2 * ka < ttl - 1) ? 2 * ka : ttl - 1))
  # Visible changes are patched at each reconcile, every --refresh-seconds (5 by default);
  # status.refreshIntervalSeconds (60) is the heartbeat of an unchanged status only.
  refresh=$(deploy_arg "$p" refresh-seconds || true); refresh=${refresh:-5}
  lapse_bound=$((ttl + ka + LAPSE_MARGIN))
  status_bound=$((pause + refresh + STATUS_MARGIN))
  n_before=$(count_of "$p" "$pre")
  fed_before=$(count_of "$p" "/aether/v1/federation/$o/")
  ((n_before > 0)) || fail "aether-$p holds no key under $pre before the region loss"
  say "region loss: aether-$p holds $n_before keys under $pre (and $fed_before under /aether/v1/federation/$o/); TTL ${ttl}s + keepalive ${ka}s + margin ${LAPSE_MARGIN}s = lapse bound ${lapse_bound}s; b's acceptable pause ${pause}s + refresh ${refresh}s + margin ${STATUS_MARGIN}s = status bound ${status_bound}s"
  say "region loss: before, regionpeering/$p says of $o: $(b_view_of_a)"
  resync_events_before_loss=$(event_count ResyncStarted) || fail "reading the events of regionpeering/$o"

  local t_scale t_gone t_etcd_scale t_etcd_gone='' t_lapsed='' t_unreachable='' t_inbound0='' start n b_view last_print=0 now
  t_scale=$(now_ms)
  k "$o" -n "$NS" scale "deployment/$RELEASE" --replicas=0 >/dev/null || fail "kubectl scale deployment/$RELEASE --replicas=0 in aether-$o"
  start=$SECONDS
  while [[ -n $(operator_pods) ]]; do
    ((SECONDS - start < 60)) || fail "the operator's pods in aether-$o still exist 60 s after scaling to 0: $(operator_pods | tr '\n' ' ')"
    sleep 0.25
  done
  t_gone=$(now_ms)
  record "region loss: operator scaled to 0 until its pods were gone" "$(secs $((t_gone - t_scale))) s"
  t_etcd_scale=$(now_ms)
  k "$o" -n "$NS" scale statefulset/registry-etcd --replicas=0 >/dev/null || fail "kubectl scale statefulset/registry-etcd --replicas=0 in aether-$o"

  # Poll b's etcd (a's copy), a's etcd pod, and b's status, until all of it is seen or the bounds pass.
  local deadline_ms=$((($(( lapse_bound > status_bound ? lapse_bound : status_bound )) + 20) * 1000))
  while :; do
    now=$(now_ms)
    if [[ -z $t_etcd_gone ]] && ! k "$o" -n "$NS" get pod registry-etcd-0 >/dev/null 2>&1; then
      t_etcd_gone=$now
      say "region loss: registry-etcd-0 in aether-$o gone $(secs $((now - t_etcd_scale))) s after scaling to 0"
    fi
    if [[ -z $t_lapsed ]]; then
      n=$(count_of "$p" "$pre" || true)
      if [[ $n == 0 ]]; then
        t_lapsed=$now
        say "region loss: $pre gone from aether-$p $(secs $((now - t_gone))) s after the operator's pods were gone"
      fi
    fi
    if [[ -z $t_unreachable && $(rp_cond "$p" PeersReachable status) == False && $(rp_peer_of "$p" "$o" reachable) == false ]]; then
      t_unreachable=$now
      say "region loss: regionpeering/$p reports $o unreachable $(secs $((now - ${t_etcd_gone:-$t_etcd_scale}))) s after a's etcd was gone: $(rp_cond "$p" PeersReachable reason): $(rp_cond "$p" PeersReachable message)"
    fi
    if [[ -z $t_inbound0 && $(rp_inbound_of "$p" "$o" keys) == 0 ]]; then
      t_inbound0=$now
      say "region loss: regionpeering/$p status.inbound[$o].keys = 0 $(secs $((now - t_gone))) s after the operator's pods were gone"
    fi
    [[ -n $t_etcd_gone && -n $t_lapsed && -n $t_unreachable && -n $t_inbound0 ]] && break
    if ((now - last_print >= 5000)); then
      last_print=$now
      say "region loss: $(secs $((now - t_gone))) s: $pre on aether-$p: ${n:-0} keys; regionpeering/$p: $(b_view_of_a)"
    fi
    ((now - t_gone > deadline_ms)) && break
    sleep 0.5
  done
  b_view=$(b_view_of_a)
  say "region loss: regionpeering/$p now says of $o: $b_view"
  rp_summary "$p" >&2
  [[ -n $t_etcd_gone ]] || fail "registry-etcd-0 in aether-$o still exists $(secs $(($(now_ms) - t_etcd_scale))) s after scaling the StatefulSet to 0"
  if [[ -z $t_lapsed ]]; then
    n=$(count_of "$p" "$pre" || true)
    echo "e2e: $(secs $(($(now_ms) - t_gone))) s after a's operator was gone, aether-$p still holds $n keys under $pre; some of them, with their leases' remaining TTL:" >&2
    ectl "$p" get --prefix "$pre" -w json | python3 -c '
import base64, json, sys
for kv in json.load(sys.stdin).get("kvs", [])[:5]:
    print(base64.b64decode(kv["key"]).decode(), "%x" % kv.get("lease", 0))' | while read -r key lease; do
      echo "  $key lease $lease: $(ectl "$p" lease timetolive "$lease" 2>&1 | head -n 1)" >&2
    done
    fail "a's copy on aether-$p did not lapse within $(secs $((deadline_ms))) s of a's operator going away (bound ${lapse_bound} s)"
  fi
  record "region loss: operator gone to $pre gone from $p (bound ${lapse_bound} s)" "$(secs $((t_lapsed - t_gone))) s"
  ((t_lapsed - t_gone <= lapse_bound * 1000)) \
    || fail "a's copy on aether-$p lapsed $(secs $((t_lapsed - t_gone))) s after a's operator was gone: over TTL ${ttl} + keepalive ${ka} + ${LAPSE_MARGIN} = ${lapse_bound} s"
  say "ok: region loss: a's copy lapsed on aether-$p $(secs $((t_lapsed - t_gone))) s after the operator was gone (bound ${lapse_bound} s); $(count_of "$p" "/aether/v1/federation/$o/") keys remain under /aether/v1/federation/$o/ (were $fed_before)"
  if [[ -z $t_unreachable ]]; then
    fail "regionpeering/$p does not report $o unreachable (PeersReachable False, peers[$o].reachable false) within $(secs $((deadline_ms))) s of a's operator going away; it says: $b_view"
  fi
  record "region loss: a's etcd gone to regionpeering/$p reporting $o unreachable (bound ${status_bound} s)" "$(secs $((t_unreachable - t_etcd_gone))) s"
  ((t_unreachable - t_etcd_gone <= status_bound * 1000)) \
    || fail "regionpeering/$p reported $o unreachable $(secs $((t_unreachable - t_etcd_gone))) s after a's etcd was gone: over the pause ${pause} + refresh ${refresh} + ${STATUS_MARGIN} = ${status_bound} s"
  if [[ -z $t_inbound0 ]]; then
    fail "regionpeering/$p status.inbound[$o].keys is not 0 although a's copy is gone from aether-$p; it says: $b_view"
  fi
  record "region loss: operator gone to regionpeering/$p inbound[$o].keys = 0" "$(secs $((t_inbound0 - t_gone))) s"
  ((t_inbound0 - t_lapsed <= (refresh + STATUS_MARGIN) * 1000)) \
    || fail "regionpeering/$p's inbound[$o].keys reached 0 $(secs $((t_inbound0 - t_lapsed))) s after the copy was gone from aether-$p: more than a refresh (${refresh} s) + ${STATUS_MARGIN} s late"
  say "ok: region loss: regionpeering/$p reports $o unreachable and holding 0 keys here; Ready=$(rp_cond "$p" Ready status) ($(rp_cond "$p" Ready reason))"
  say "region loss: regionpeering/$o (nobody writes it now) still says: Ready=$(ready_status "$o") leader=$(rp_field "$o" '{.status.leader}') refreshed=$(rp_field "$o" '{.status.refreshedTime}')"
}

# Recovery: a's etcd back (its data and users survive on the node), the operator back at one
# replica; a's keys reappear on b (keys and values), regionpeering a Ready under the new leader, b
# reaches a again and its copy in a equals b's.
region_recovery() {
  phase="region recovery ($o)"
  local t_etcd t_etcd_ok t_op start now t_a_ready='' t_a_copy='' t_b_ready='' t_b_copy='' leader last_print=0
  t_etcd=$(now_ms)
  k "$o" -n "$NS" scale statefulset/registry-etcd --replicas=1 >/dev/null || fail "kubectl scale statefulset/registry-etcd --replicas=1 in aether-$o"
  start=$SECONDS
  until [[ $(k "$o" -n "$NS" get pod registry-etcd-0 -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]] \
      && ectl "$o" endpoint health >/dev/null 2>&1; do
    if ((SECONDS - start >= 120)); then
      k "$o" -n "$NS" get pod registry-etcd-0 -o wide >&2 2>&1 || true
      fail "registry-etcd-0 in aether-$o not Ready and answering within 120 s of scaling to 1; last health: $(ectl "$o" endpoint health 2>&1 | tail -n 1)"
    fi
    sleep 0.5
  done
  t_etcd_ok=$(now_ms)
  record "recovery: a's etcd scaled to 1 to Ready and answering" "$(secs $((t_etcd_ok - t_etcd))) s"
  local n_a; n_a=$(count_of "$o" "/aether/v1/regions/$o/clusters/kind-$o/")
  [[ $n_a == $((N_KEYS - N_DELETE)) ]] || fail "a's etcd holds $n_a of its $((N_KEYS - N_DELETE)) test keys after the restart (the data should survive on the node)"
  say "recovery: a's etcd holds its $n_a test keys again, and $(count_of "$o" "$(prefix_of "$p")") keys of $p's copy (etcd's leases do not run down while it is stopped)"
  t_op=$(now_ms)
  k "$o" -n "$NS" scale "deployment/$RELEASE" --replicas=1 >/dev/null || fail "kubectl scale deployment/$RELEASE --replicas=1 in aether-$o"
  while :; do
    now=$(now_ms)
    if [[ -z $t_a_copy ]] && copy_equal "$o" "$p"; then
      t_a_copy=$now; say "recovery: $o's keys back on aether-$p, verbatim, $(secs $((now - t_op))) s after scaling the operator to 1"
    fi
    if [[ -z $t_a_ready ]]; then
      leader=$(holder || true)
      if [[ -n $leader ]] && k "$o" -n "$NS" get pod "$leader" >/dev/null 2>&1 \
          && [[ $(rp_field "$o" '{.status.leader}') == "$leader" && $(ready_status "$o") == True ]]; then
        t_a_ready=$now; say "recovery: regionpeering/$o Ready under $leader $(secs $((now - t_op))) s after scaling the operator to 1"
      fi
    fi
    if [[ -z $t_b_ready && $(ready_status "$p") == True && $(rp_cond "$p" PeersReachable status) == True ]]; then
      t_b_ready=$now; say "recovery: regionpeering/$p Ready, $o reachable, $(secs $((now - t_etcd_ok))) s after a's etcd answered"
    fi
    if [[ -z $t_b_copy ]] && copy_equal "$p" "$o"; then
      t_b_copy=$now; say "recovery: $p's copy in aether-$o equals $p's $(secs $((now - t_etcd_ok))) s after a's etcd answered"
    fi
    [[ -n $t_a_copy && -n $t_a_ready && -n $t_b_ready && -n $t_b_copy ]] && break
    if ((now - last_print >= 10000)); then
      last_print=$now
      say "recovery: $(secs $((now - t_op))) s: regionpeering/$o: Ready=$(ready_status "$o") leader=$(rp_field "$o" '{.status.leader}') (Lease: $(holder || true)); $pre on aether-$p: $(count_of "$p" "$pre") keys; regionpeering/$p: $(b_view_of_a)"
    fi
    if ((now - t_op > RECOVERY_TIMEOUT * 1000)); then
      echo "e2e: $RECOVERY_TIMEOUT s after scaling a's operator to 1: a's copy on b $([[ -n $t_a_copy ]] && echo equal || echo differs), regionpeering/$o Ready under a live leader: ${t_a_ready:+yes}, regionpeering/$p Ready: ${t_b_ready:+yes}, b's copy in a $([[ -n $t_b_copy ]] && echo equal || echo differs)" >&2
      [[ -n $t_a_copy ]] || show_difference "$o" "$p"
      [[ -n $t_b_copy ]] || show_difference "$p" "$o"
      rp_summary "$o" >&2; rp_summary "$p" >&2
      fail "region $o not recovered within $RECOVERY_TIMEOUT s of scaling its operator to 1"
    fi
    sleep 0.5
  done
  record "recovery: operator scaled to 1 to $o's keys back on $p" "$(secs $((t_a_copy - t_op))) s"
  record "recovery: operator scaled to 1 to regionpeering/$o Ready" "$(secs $((t_a_ready - t_op))) s"
  record "recovery: a's etcd answering to regionpeering/$p Ready ($o reachable)" "$(secs $((t_b_ready - t_etcd_ok))) s"
  record "recovery: a's etcd answering to $p's copy in $o equal" "$(secs $((t_b_copy - t_etcd_ok))) s"
  local resync_events_after; resync_events_after=$(event_count ResyncStarted) || true
  say "recovery: ResyncStarted events of regionpeering/$o: $resync_events_before_loss before the loss, $resync_events_after now (the lapsed leases call for a full sync)"
  rp_summary "$o" >&2; rp_summary "$p" >&2
}
region_loss
region_recovery

record "total: e2e.sh from start to here (without federation.sh down)" "$SECONDS s"
phase=finished
