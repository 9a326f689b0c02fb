#!/usr/bin/env bash
# The kind e2e's first real-cluster scenario: two regions (a, b) from hack/kind/federation.sh, the
# operator image `make image` built (target/image/aether-operator-<version>.oci.tar) loaded with
# hack/kind/load-operator.sh, the packaged chart (target/chart/aether-federation-<version>.tgz)
# installed with Helm into each cluster with the RegionPeering it renders from values, then:
#
#   1. both RegionPeerings Ready (kubectl wait, with a deadline); `helm test` in each cluster (the
#      chart's test pod: the federation healthy from inside the cluster, each peer's copy checked);
#   2. data path a -> b: N endpoint keys put into a's registry etcd under /aether/v1/regions/a/
#      appear in b's etcd, verbatim (keys and values equal to the origin's); some are deleted and
#      disappear from b; the same b -> a;
#   3. leader handoff in a (Rust, the local e2e's code: e2e/tests/kind.rs leader_handoffs, with
#      3-4c below): the leader Pod (the holder of the Lease aether-operator-leader) is
#      deleted gracefully; while the standby takes over, b's copy of a's subtree is read
#      continuously and must never lose a key (for at least the lease TTL plus a keepalive
#      interval, so a lapse would show); regionpeering a must be Ready again under the new leader,
#      with status.peers[b].replication.resyncs unchanged;
#   4. forced leader handoff in a: the same with the leader Pod deleted with --force
#      --grace-period=0 (the API object goes at once; the kubelet still stops the container with
#      SIGTERM and its 2 s minimum grace): no key of a missing on b, no new ResyncStarted event,
#      regionpeering a Ready under the new leader within AETHER_E2E_FORCED_READY_BOUND s;
#   4b. crashed leader in a: the leader's operator process SIGKILLed in its node (ctr task kill: no
#      SIGTERM, the leader Lease is not released, nothing is revoked); the kubelet restarts the
#      container in its Pod (same identity) or the standby waits the Lease out; whichever leads
#      must adopt the leases before they lapse: no key of a missing on b, no new ResyncStarted, a
#      new LeasesAdopted and regionpeering a Ready within AETHER_E2E_FORCED_READY_BOUND s;
#   4c. lost leader in a: its operator's processes frozen (SIGSTOP in its node: silent, renewing and
#      releasing nothing, as behind a lost node) and its Pod force-deleted; the kubelet's SIGTERM
#      stays pending behind the stop and nothing restarts it in a deleted Pod: the Lease is never
#      released, the standby waits it out; the same checks;
#   5. metrics over HTTPS (Rust: e2e/tests/kind.rs metrics_scrape): a ServiceAccount bound to the
#      chart's metrics-reader ClusterRole, its token (TokenRequest), /metrics of the leader through
#      the API server's port-forward from this host: 200 with the operator's aether_federation_
#      families; no token 401 or 403, a bogus token 401, an unbound ServiceAccount's token 403;
#   6. region loss (Rust, the local e2e's code: e2e/tests/kind.rs region_loss_and_recovery): a's
#      operator scaled to 0 and a's registry etcd (StatefulSet) scaled to 0; a's
#      copy on b must lapse within the lease TTL + keepalive interval + AETHER_E2E_LAPSE_MARGIN s of
#      the operator's pods being gone, and regionpeering b must report a unreachable (PeersReachable
#      False, peers[a].reachable false) and inbound[a].keys 0; then recovery: a's etcd and one
#      operator replica back, a's keys back on b, regionpeering a and b Ready, b's copy in a equal.
#      Inside it, `kubectl aether status --context kind-aether-a --context kind-aether-b` (the
#      operator's binary as the kubectl plugin, found in target/, never built; skipped with a
#      message when absent): before the loss exit 0, both Ready, neither STALE, and with --etcd
#      exit 0, every peer's canary synced, a checkpoint, the peers' key counts equal to the
#      origins' (the origins' local etcds are in-cluster Service names this host cannot dial:
#      the plugin asks each region's leader to check from its pod, and the rows say so);
#      during the loss, polled in the background from the operator's pods being gone, region a
#      STALE, b not, exit 1;
#   7. upgrade under load, then rollback (the rolls in Rust: e2e/tests/kind.rs
#      helm_upgrade_and_rollback): the operator's image re-tagged <version>-e2e-upgrade (the
#      same binary: configs re-labelled, manifests and index re-hashed, offline) and loaded into
#      aether-a; a back at the chart's replica count; a background writer puts AETHER_E2E_LOAD_RATE
#      endpoint keys/s into a's etcd (transactions of puts; creates, then updates, a pool of keys);
#      `helm upgrade --reuse-values` to the new tag until the Deployment rolled out, while b's copy is
#      read continuously: no key a held before the roll missing in any read (until the lease TTL +
#      keepalive + 5 s after the last old Pod was gone), every Pod on the new image, regionpeering a
#      Ready under a leader on it, no new ResyncStarted event and resyncs unchanged (or 0 under a new
#      leader that adopted the leases), no failed put, and with the writer stopped b's copy equal to
#      a's. Then `helm rollback` to the revision before, with the same checks;
#   8. secret rotation (Rust: e2e/tests/kind.rs secret_rotation): a new client certificate for
#      mirror-a from b's CA written into a's Secret registry-etcd-peer-b; the leader restarts its
#      mirror worker for b (its log) within --refresh-seconds + AETHER_E2E_STATUS_MARGIN s and adopts
#      the leases, no Pod restarted or replaced, the same leader, and a key put into a afterwards
#      reaches b;
#   7b. a third region joins (federation.sh up a b c; the chart installed in c with peers a and b, a's
#      and b's releases upgraded with c as a peer): every RegionPeering Ready with two peers, c's
#      keys on a and b, a's and b's subtrees on c; a -> b and b -> a not re-synced, no key of a
#      missing on b meanwhile;
#   9. helm uninstall (Rust, helm shelled out: e2e/tests/kind.rs helm_uninstall_everywhere) in
#      every cluster through the chart's pre-delete hook: the hook Job succeeds,
#      the RegionPeering and every object of the release go, nothing is left Terminating in the
#      namespace, helm lists no release, the CRDs stay (Established; Helm never deletes crds/).
#  10. GitOps: real Argo CD (hack/argocd/, installed in every cluster beside the steps before) syncs
#      each region's chart and RegionPeering from a git server in its cluster; the scenarios are
#      Rust (e2e/tests/gitops.rs, AETHER_E2E_SCENARIOS selects them by name): every region's first
#      sync into a cluster without the project's CRDs (the API server, one of three by its flags, keeps
#      a new CRD Installing for 5 s) and no drift for five minutes (and a drift watch on every
#      Application from every sync to the next change), then on a: a TTL change committed, a peer
#      removed by a commit and added back by the next, a peer's etcd stopped (Degraded, the peer
#      named) and back (the peer's own Application Healthy again), self-heal, an upgrade committed
#      then `git revert`ed under 100 writes/s; every Application deleted (the deletion policy
#      applied while the operator runs, nothing Terminating).
#
#   hack/kind/e2e.sh            run it; the clusters are deleted at the end (federation.sh down)
#   KEEP=1 hack/kind/e2e.sh     keep the clusters (and dockerd) afterwards
#
# Knobs: AETHER_E2E_KEYS (endpoint keys per region, default 50), AETHER_E2E_DELETE (how many of them
# are deleted, default 10), AETHER_E2E_READY_TIMEOUT (s, default 300), AETHER_E2E_PROPAGATION_TIMEOUT
# (s, default 120), AETHER_E2E_HANDOFF_TIMEOUT (s, default 180), AETHER_E2E_FORCED_READY_BOUND (s,
# default 60), AETHER_E2E_LAPSE_MARGIN (s, default 5), AETHER_E2E_STATUS_MARGIN (s, default 10: on
# top of b's acceptable pause and status refresh), AETHER_E2E_RECOVERY_TIMEOUT (s, default 180);
# AETHER_E2E_PLUGIN (a kubectl-aether binary to use instead of target/'s); AETHER_E2E_UPGRADE,
# AETHER_E2E_THREE, AETHER_E2E_ROTATION, AETHER_E2E_UNINSTALL, AETHER_E2E_GITOPS (1, the default,
# runs steps 7, 7b, 8, 9, 10; 0 skips one; 10 needs 9),
# AETHER_E2E_UPGRADE_TIMEOUT (s, default 300, each roll), AETHER_E2E_LOAD_RATE (keys/s, default 100),
# AETHER_E2E_LOAD_BATCH (puts per transaction, default 10), AETHER_E2E_LOAD_POOL (distinct keys,
# default 200), AETHER_E2E_ROTATION_TIMEOUT (s, default 60), AETHER_E2E_UNINSTALL_TIMEOUT (s,
# default 300: helm uninstall --timeout).
#
# Needs what federation.sh and load-operator.sh need (root, the node image's cache, `make tools`'
# helm and etcdctl, python3, openssl), the operator's OCI archive (`make image`; this script never builds
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
UPGRADE=${AETHER_E2E_UPGRADE:-1}
UPGRADE_TIMEOUT=${AETHER_E2E_UPGRADE_TIMEOUT:-300}
LOAD_RATE=${AETHER_E2E_LOAD_RATE:-100}
LOAD_BATCH=${AETHER_E2E_LOAD_BATCH:-10}
LOAD_POOL=${AETHER_E2E_LOAD_POOL:-200}
ROTATION=${AETHER_E2E_ROTATION:-1}
THREE=${AETHER_E2E_THREE:-1}
ROTATION_TIMEOUT=${AETHER_E2E_ROTATION_TIMEOUT:-60}
UNINSTALL=${AETHER_E2E_UNINSTALL:-1}
GITOPS=${AETHER_E2E_GITOPS:-1}
UNINSTALL_TIMEOUT=${AETHER_E2E_UNINSTALL_TIMEOUT:-300}
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
command -v openssl >/dev/null || die "openssl is needed (federation.sh makes the certificates with it; apt-get install openssl)"
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
e2e_tmp=''
on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  local pid
  [[ -n ${join_file:-} && ! -e $join_file ]] && echo "hack/kind/e2e.sh exited: $phase" >"$join_file"   # the third region's Rust step
  for pid in ${join_pid:-}; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  for pid in ${argocd_pid:-}; do pkill -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  [[ -n $e2e_tmp ]] && rm -rf "$e2e_tmp"
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
e2e_tmp=$(mktemp -d /tmp/aether-kind-e2e.XXXXXX)

# kubectl aether (docs: the operator's binary, installed as kubectl-aether; `make krew` packs it):
# taken, never built, from the first of $AETHER_E2E_PLUGIN, a krew archive in target/krew/ for this
# machine, make image's binary target/image/aether-operator-<version>-linux-<arch>,
# target/<arch>-unknown-linux-musl/release/aether-operator, target/release/aether-operator whose
# --version is <version>; copied first (a concurrent cargo build may replace the original).
plugin_dir=$e2e_tmp/plugin plugin_from=''
find_plugin() {
  local arch triple c f x candidates=()
  triple=$(uname -m)-unknown-linux-musl arch=$(uname -m)
  case $arch in x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; esac
  [[ -n ${AETHER_E2E_PLUGIN:-} ]] && candidates+=("$AETHER_E2E_PLUGIN")
  for f in "$root"/target/krew/*linux*"$arch"*.tar.gz; do
    [[ -f $f ]] || continue
    x=$e2e_tmp/krew-${f##*/}
    mkdir -p "$x"
    tar -C "$x" -xzf "$f" 2>/dev/null || continue
    candidates+=("$(find "$x" -type f \( -name aether-operator -o -name kubectl-aether \) | head -n 1)")
  done
  candidates+=("$root/target/image/aether-operator-$version-linux-$arch" "$root/target/$triple/release/aether-operator" "$root/target/release/aether-operator")
  mkdir -p "$plugin_dir/try"
  for c in "${candidates[@]}"; do
    [[ -n $c && -f $c && -x $c ]] || continue
    cp "$c" "$plugin_dir/try/kubectl-aether" || continue
    if [[ $("$plugin_dir/try/kubectl-aether" --version 2>/dev/null) == *" $version" ]]; then
      mv "$plugin_dir/try/kubectl-aether" "$plugin_dir/kubectl-aether"
      plugin_from=$c
      return 0
    fi
    say "kubectl aether: $c is not version $version ($("$plugin_dir/try/kubectl-aether" --version 2>&1 | head -n 1)): not used"
  done
  return 1
}
# The plugin's checks are Rust (e2e/src/scenarios/plugin.rs): `kubectl aether status` and `doctor`
# run as the plugin on the PATH, their JSON read into the operator's own types. They get the
# plugin's directory and this kubectl.
plugin_env=()
# The Verify commands of the README and of docs/multi-region.md, run as written on this healthy
# federation: their regions are this one's (eu-west -> a, us-east -> b, a context per region named
# kind-aether-<r>, the current one eu-west's), and each command exits 0.
docs_verify() {
  phase="the docs' verify commands"
  local doc cmd n rc out cfg=$e2e_tmp/docs-verify.kubeconfig
  cp "$kubeconfig" "$cfg"
  : >"$log_dir/aether-kind-e2e-docs-verify.log"
  "$kubectl_bin" --kubeconfig "$cfg" config use-context "kind-aether-$o" >/dev/null
  for doc in README.md docs/multi-region.md; do
    n=0
    while IFS= read -r cmd; do
      [[ -z $cmd ]] && continue
      cmd=${cmd//--context eu-west/--context kind-aether-$o}; cmd=${cmd//--context us-east/--context kind-aether-$p}
      cmd=${cmd//eu-west/$o}; cmd=${cmd//us-east/$p}
      n=$((n + 1)); rc=0
      out=$(cd "$e2e_tmp" && PATH=$plugin_dir:$(dirname "$kubectl_bin"):$PATH KUBECONFIG=$cfg timeout 330 bash -c "$cmd" 2>&1) || rc=$?
      say "$doc, Verify: $cmd: exit $rc"
      printf '$ %s   (exit %s)\n%s\n\n' "$cmd" "$rc" "$out" >>"$log_dir/aether-kind-e2e-docs-verify.log"
      ((rc == 0)) || { echo "$out" >&2; fail "$doc's Verify command '$cmd' exits $rc on a healthy federation (above)"; }
    done < <(awk '/^## Verify/ { v = 1 } v && /^```sh/ { b = 1; next } b && /^```/ { exit } b' "$root/$doc")
    ((n >= 3)) || fail "$doc's Verify section: $n commands found (expected its sh block of three)"
  done
  say "ok: the Verify commands of the README and docs/multi-region.md, run as written, exit 0 (what they printed: $log_dir/aether-kind-e2e-docs-verify.log)"
}
if find_plugin; then
  say "kubectl aether: $plugin_from, as $plugin_dir/kubectl-aether ($("$plugin_dir/kubectl-aether" --version))"
  plugin_env=(AETHER_E2E_PLUGIN_DIR="$plugin_dir" AETHER_E2E_KUBECTL="$kubectl_bin")
else
  plugin_from=''
  say "kubectl aether: SKIPPED: no plugin binary of version $version in target/ (krew archives, make image's binary, the release builds); this script builds none"
fi

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
# install_region REGION: helm upgrade --install of the packaged chart with every other region of
# REGIONS as a peer (each over its node's NodePort, with the Secret federation.sh made for it).
install_region() {
  local r=$1 p ip peers=() peer_secrets=()
  for p in "${REGIONS[@]}"; do
    [[ $p == "$r" ]] && continue
    ip=$(node_ip "$p")
    [[ -n $ip ]] || fail "no kind-network address of $(node_of "$p")"
    peers+=("$p=https://$ip:$NODEPORT")
    peer_secrets+=(--set "regionPeering.peerTlsSecrets.$p=registry-etcd-peer-$p")
  done
  h "$r" upgrade --install "$RELEASE" "$chart_tgz" -n "$NS" --wait --timeout 300s \
    "${image_flags[@]}" "${hook_flags[@]}" \
    --set regionPeering.enabled=true --set "regionPeering.region=$r" \
    --set "regionPeering.localEtcd.endpoints={https://registry-etcd.$NS.svc:2379}" \
    --set regionPeering.localEtcd.tlsSecret=registry-etcd-local \
    --set "regionPeering.peerEtcd={$(IFS=,; echo "${peers[*]}")}" "${peer_secrets[@]}" \
    >"$log_dir/aether-kind-e2e-helm-$r.log" 2>&1 || { cat "$log_dir/aether-kind-e2e-helm-$r.log" >&2; fail "helm upgrade --install into aether-$r"; }
  k "$r" -n "$NS" rollout status "deployment/$RELEASE" --timeout 120s >/dev/null \
    || fail "deployment/$RELEASE in aether-$r: not rolled out within 120 s"
}
installed_ms=()
for r in "${REGIONS[@]}"; do
  phase="helm install aether-$r"
  t=$(now_ms)
  install_region "$r"
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
# helm test: the chart's test pod, in each region, waits for its federation to be healthy as seen
# from inside the cluster (every mirror synced, each peer's copy checked on its etcd).
phase="helm test"
for r in "${REGIONS[@]}"; do
  t=$(now_ms)
  h "$r" test "$RELEASE" -n "$NS" --timeout 5m >"$log_dir/aether-kind-e2e-helm-test-$r.log" 2>&1 \
    || { cat "$log_dir/aether-kind-e2e-helm-test-$r.log" >&2; k "$r" -n "$NS" logs "$RELEASE-test-federation-healthy" >&2 || true
         fail "helm test $RELEASE in aether-$r"; }
  grep -Eq "Phase: +Succeeded" "$log_dir/aether-kind-e2e-helm-test-$r.log" \
    || { cat "$log_dir/aether-kind-e2e-helm-test-$r.log" >&2; fail "helm test $RELEASE in aether-$r: it does not say Phase: Succeeded"; }
  # A test pod that passed is deleted (hook-succeeded): helm uninstall would leave a kept one behind.
  if k "$r" -n "$NS" get pod "$RELEASE-test-federation-healthy" -o name 2>/dev/null | grep -q .; then
    fail "helm test $RELEASE in aether-$r passed and left its pod behind (helm uninstall would too)"
  fi
  record "helm test $RELEASE in aether-$r (the federation healthy from inside the cluster)" "$(secs $(($(now_ms) - t))) s"
done

# --- 4. Data path -----------------------------------------------------------------------------------
# What a failure prints: the keys that differ between ORIGIN's subtree and PEER's copy.
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

# The step itself is Rust, the same code the local e2e runs (e2e/src/scenarios.rs, data_path):
# N_KEYS endpoint keys put into each region under clusters/kind-<region>/ appear verbatim on the
# other, N_DELETE of them deleted disappear; N_KEYS - N_DELETE stay (the recovery counts them).
# rust_step TEST [VAR=VALUE...]: a scenario of e2e/tests/kind.rs run by name with the federation's
# environment and VAR=VALUE...: its "time: WHAT = VALUE" lines recorded, the rest of its output
# printed; returns the test's status.
rust_test() { # TEST [VAR=VALUE...]: runs the scenario, printing its output; returns its status
  local test=$1
  shift
  (cd "$root" && env AETHER_KIND_FED_DIR="$fed_dir" AETHER_KIND_ETCD_NODEPORT="$NODEPORT" "$@" \
    "${CARGO:-cargo}" test -q -p aether-e2e --test kind -- --ignored --exact "$test" --nocapture 2>&1)
}
rust_report() { # OUTPUT: its "time: WHAT = VALUE" lines recorded, the rest printed
  grep -v '^time: ' <<<"$1" | sed 's/^/  /' >&2
  local line
  while IFS= read -r line; do
    line=${line#time: }
    record "${line% = *}" "${line##* = }"
  done < <(grep '^time: ' <<<"$1")
}
rust_step() {
  local out rc=0
  out=$(rust_test "$@") || rc=$?
  rust_report "$out"
  return $rc
}
run_id=$(date +%s)   # marks this run's writes in the steps below
phase="data path a -> b and b -> a (e2e/tests/kind.rs: data_path_both_ways)"
rust_step data_path_both_ways AETHER_E2E_KEYS="$N_KEYS" AETHER_E2E_DELETE="$N_DELETE" \
  AETHER_E2E_PROPAGATION_TIMEOUT="$PROPAGATION_TIMEOUT" \
  || { show_difference a b; show_difference b a; fail "the data path (e2e/tests/kind.rs, its output above)"; }

# --- 5. Leader handoffs in a: graceful, forced, crashed, lost -------------------------------------
o=a p=b
holder() { k "$o" -n "$NS" get lease "$LEASE_NAME" -o jsonpath='{.spec.holderIdentity}' 2>/dev/null; }
deploy_arg() { # REGION FLAG: the value of --FLAG=... in the operator container's args ("true" for a bare --FLAG)
  k "$1" -n "$NS" get deployment "$RELEASE" -o jsonpath='{.spec.template.spec.containers[?(@.name=="operator")].args}' 2>/dev/null \
    | python3 -c 'import json, sys
flag = "--" + sys.argv[1]
for a in json.load(sys.stdin):
    if a == flag: print("true")
    elif a.startswith(flag + "="): print(a.split("=", 1)[1])' "$2"
}

# The step itself is Rust, the same code the local e2e runs (e2e/src/scenarios/handoff.rs;
# e2e/tests/kind.rs, leader_handoffs): a's leader Pod deleted; force-deleted (the Pod object goes
# at once, a replacement starts while the old container may still run); its operator container
# SIGKILLed in the node (no SIGTERM: the kubelet restarts it in its Pod under the same identity);
# its processes frozen (SIGSTOP) and its Pod force-deleted (the standby must wait the Lease out,
# never take it early). After each, b's copy of a is read about three times a second and watched
# for at least the lease TTL + keepalive interval + 5 s and must hold every key in every read and
# lose none; a is Ready under a worker that adopted the leases (after a loss other than the graceful
# one within AETHER_E2E_FORCED_READY_BOUND s); no ResyncStarted event; resyncs unchanged (or 0 under
# a new leader with a new LeasesAdopted event).
phase="leader handoffs in $o (e2e/tests/kind.rs: leader_handoffs)"
rust_step leader_handoffs AETHER_E2E_FORCED_READY_BOUND="$FORCED_READY_BOUND" AETHER_E2E_HANDOFF_TIMEOUT="$HANDOFF_TIMEOUT" \
  || { rp_summary "$o" >&2; fail "the leader handoffs (e2e/tests/kind.rs, its output above)"; }
rp_summary "$o" >&2

# --- 6. Metrics over HTTPS, with a ServiceAccount token ---------------------------------------------
# The step itself is Rust (e2e/src/scenarios/metrics.rs; e2e/tests/kind.rs, metrics_scrape): the
# chart (metrics.secure, default true) serves /metrics on one HTTPS port with a self-signed
# certificate and answers only bearer tokens the API server authenticates and allows `get` on
# /metrics (the ClusterRole <namespace>-<release>-metrics-reader). Through the API server's
# port-forward to the leader Pod: a bound ServiceAccount's token gets 200 and the operator's
# families; no token, a token that is none, an unbound ServiceAccount's token are refused.
phase="metrics over HTTPS (e2e/tests/kind.rs: metrics_scrape)"
rust_step metrics_scrape || fail "the metrics scrape (e2e/tests/kind.rs, its output above)"

# --- 7. Region loss: a's operator and etcd stop; a's copy lapses on b; b's status ------------------
# The step itself is Rust, the same code the local e2e runs (e2e/src/scenarios.rs, region_loss and
# region_recovery; e2e/tests/kind.rs, region_loss_and_recovery). a's Deployment, then its registry
# etcd's StatefulSet, scaled to 0. The operator revokes nothing when it stops: a's keys on b lapse
# with their leases, within the lease TTL + keepalive interval + AETHER_E2E_LAPSE_MARGIN (5 s) of
# the operator's pods being gone. b's failure detector calls a unreachable once no round trip to
# a's etcd succeeded for the acceptable pause, and b's status shows it at its next reconcile
# (--refresh-seconds): within pause + refresh + AETHER_E2E_STATUS_MARGIN of a's etcd pod being
# gone; inbound[a].keys 0 within a refresh + margin of the lapse. Then a's etcd and one operator
# back: a's copy on b and b's on a whole again, both RegionPeerings Ready, a reachable.
# Around it: `kubectl aether status` and `doctor` (the shipped plugin) healthy before (Rust:
# plugin_reports_healthy), the docs' Verify commands run as written (here), and `kubectl aether
# status --etcd` polled from the loss's start until it calls a STALE (inside region_loss_and_recovery).
region_loss_and_recovery() {
  if [[ -n $plugin_from ]]; then
    phase="kubectl aether status and doctor, healthy (e2e/tests/kind.rs: plugin_reports_healthy)"
    rust_step plugin_reports_healthy "${plugin_env[@]}" || fail "kubectl aether on a healthy federation (e2e/tests/kind.rs, its output above)"
    docs_verify
  fi
  phase="region loss and recovery ($o) (e2e/tests/kind.rs: region_loss_and_recovery)"
  local refresh
  refresh=$(deploy_arg "$p" refresh-seconds || true); refresh=${refresh:-5}
  rust_step region_loss_and_recovery "${plugin_env[@]}" AETHER_E2E_LAPSE_MARGIN="$LAPSE_MARGIN" \
    AETHER_E2E_STATUS_MARGIN="$STATUS_MARGIN" AETHER_E2E_REFRESH_SECONDS="$refresh" AETHER_E2E_RECOVERY_TIMEOUT="$RECOVERY_TIMEOUT" \
    || { rp_summary "$o" >&2; rp_summary "$p" >&2; fail "the region loss and recovery (e2e/tests/kind.rs, its output above)"; }
  rp_summary "$o" >&2; rp_summary "$p" >&2
}
region_loss_and_recovery

# --- 8. Upgrade of region a under load, then rollback ------------------------------------------------
# The "new version" is the same operator binary re-tagged: make image's OCI archive with a label
# (dev.aether.e2e.retagged-from=<version>) added to each platform's image config and the tag
# <version>-e2e-upgrade, written offline here (configs, manifests and the index re-hashed, the
# layers untouched) and loaded into aether-a with load-operator.sh. What is tested is the roll's
# mechanics: `helm upgrade --reuse-values` to the new tag, the Deployment's rolling update (a Pod
# surges, an old one goes, the leader among them: one or two leader handoffs), and then `helm
# rollback` to the revision before, the same way. The rolls are Rust (e2e/src/scenarios/upgrade.rs;
# e2e/tests/kind.rs, helm_upgrade_and_rollback): during each a writer puts AETHER_E2E_LOAD_RATE (100)
# endpoint keys a second into a's registry etcd (transactions of AETHER_E2E_LOAD_BATCH (10) puts over
# AETHER_E2E_LOAD_POOL (200) keys, created then updated), and b's copy is read about three times a
# second: every key a held before the roll must be there in every read, until the lease TTL +
# keepalive interval + 5 s after the last old Pod was gone. Then: the Deployment rolled out, every
# Pod on the wanted image unrestarted, regionpeering a Ready under a leader on it, no new
# ResyncStarted event and peers[b].resyncs unchanged (or 0 under a new leader that adopted the
# leases), no put failed, and, the writer stopped, b's copy equal to a's (keys and values).
make_retagged_archive() { # OUT TAG: make image's archive, re-tagged TAG (see above); prints the new index digest
  local out=$1 tag=$2 dir=$e2e_tmp/retag
  rm -rf "$dir" && mkdir -p "$dir"
  tar -C "$dir" -xf "$archive" || return 1
  python3 - "$dir" "$tag" "$version" <<'PY' || return 1
import hashlib, json, os, sys
layout, tag, version = sys.argv[1:4]
def path(digest):
    return os.path.join(layout, "blobs", *digest.split(":", 1))
def load(digest):
    with open(path(digest), "rb") as f:
        return json.load(f)
def store(obj):
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    with open(path(digest), "wb") as f:
        f.write(raw)
    return digest, len(raw)
with open(os.path.join(layout, "index.json")) as f:
    top = json.load(f)
desc = top["manifests"][0]
if len(top["manifests"]) != 1 or desc["mediaType"] != "application/vnd.oci.image.index.v1+json":
    sys.exit("index.json should hold one image index descriptor")
replaced = {desc["digest"]}
index = load(desc["digest"])
labels = {"dev.aether.e2e.retagged-from": version, "org.opencontainers.image.version": tag}
for m in index["manifests"]:
    manifest = load(m["digest"])
    replaced |= {m["digest"], manifest["config"]["digest"]}
    config = load(manifest["config"]["digest"])
    config.setdefault("config", {}).setdefault("Labels", {}).update(labels)
    manifest["config"]["digest"], manifest["config"]["size"] = store(config)
    manifest.setdefault("annotations", {})["org.opencontainers.image.version"] = tag
    m["digest"], m["size"] = store(manifest)
index.setdefault("annotations", {})["org.opencontainers.image.version"] = tag
desc["digest"], desc["size"] = store(index)
desc.setdefault("annotations", {})["org.opencontainers.image.ref.name"] = tag
with open(os.path.join(layout, "index.json"), "w") as f:
    json.dump(top, f, sort_keys=True)
for digest in replaced:
    os.remove(path(digest))
print(desc["digest"])
PY
  tar -C "$dir" --owner=0 --group=0 --numeric-owner -cf "$out" oci-layout index.json blobs || return 1
  rm -rf "$dir"
}
upgrade_and_rollback() {
  phase="upgrade: the re-tagged archive"
  local tag=$version-e2e-upgrade out=$e2e_tmp/aether-operator-$version-e2e-upgrade.oci.tar index_digest t flags_line repo
  index_digest=$(make_retagged_archive "$out" "$tag") || fail "re-tagging $archive as $tag"
  say "upgrade: $out: the image of $archive re-tagged $tag (index $index_digest; the binary unchanged)"
  t=$(now_ms)
  out=$(AETHER_OPERATOR_ARCHIVE=$out heavy "$kind_dir/load-operator.sh" "$o") || fail "load-operator.sh $o with the re-tagged archive"
  flags_line=$(grep -- '--set image.repository=' <<<"$out" | tail -n 1)
  [[ $flags_line == *"--set image.tag=$tag "* ]] || fail "load-operator.sh printed no flags for $tag: $out"
  record "upgrade: load-operator.sh (the re-tagged image into aether-$o)" "$(secs $(($(now_ms) - t))) s"
  repo=$(sed -n 's/.*--set image.repository=\([^ ]*\).*/\1/p' <<<"$flags_line")
  phase="upgrade and rollback under load (e2e/tests/kind.rs: helm_upgrade_and_rollback)"
  rust_step helm_upgrade_and_rollback AETHER_E2E_UPGRADE_CHART="$chart_tgz" AETHER_E2E_UPGRADE_IMAGE="$repo:$tag" \
    AETHER_E2E_UPGRADE_FLAGS="$flags_line" AETHER_E2E_UPGRADE_TIMEOUT="$UPGRADE_TIMEOUT" AETHER_E2E_LOAD_RATE="$LOAD_RATE" \
    AETHER_E2E_LOAD_BATCH="$LOAD_BATCH" AETHER_E2E_LOAD_POOL="$LOAD_POOL" \
    || { rp_summary "$o" >&2; fail "the upgrade and rollback under load (e2e/tests/kind.rs, its output above)"; }
}

# --- 9. A peer Secret rotated without a restart ------------------------------------------------------
# The step itself is Rust (e2e/src/scenarios/rotation.rs; e2e/tests/kind.rs, secret_rotation): a
# new client certificate for mirror-a from b's CA written into a's Secret registry-etcd-peer-b. The
# leader restarts its worker for b within --refresh-seconds + AETHER_E2E_STATUS_MARGIN s, the new
# worker adopts the leases, no operator Pod restarts or is replaced, the leader stays, and a key put
# into a afterwards reaches b.
rotate_peer_secret() {
  phase="secret rotation ($o -> $p) (e2e/tests/kind.rs: secret_rotation)"
  local refresh
  refresh=$(deploy_arg "$o" refresh-seconds || true); refresh=${refresh:-5}
  rust_step secret_rotation AETHER_E2E_REFRESH_SECONDS="$refresh" AETHER_E2E_STATUS_MARGIN="$STATUS_MARGIN" \
    AETHER_E2E_ROTATION_TIMEOUT="$ROTATION_TIMEOUT" AETHER_E2E_PROPAGATION_TIMEOUT="$PROPAGATION_TIMEOUT" \
    || { rp_summary "$o" >&2; k "$o" -n "$NS" logs "$(holder)" --tail 15 >&2 || true; fail "the Secret rotation (e2e/tests/kind.rs, its output above)"; }
}

# --- 10. helm uninstall through the chart's pre-delete hook, in every cluster ------------------------
# The step itself is Rust (e2e/src/scenarios/uninstall.rs; e2e/tests/kind.rs,
# helm_uninstall_everywhere): the chart's hook Job deletes the RegionPeering and waits until the
# still-running operator has run its finalizer; only then does Helm delete the operator. Checked:
# helm uninstall --wait succeeds, the hook Job succeeded (seen, or its Completed event once
# hook-succeeded deleted it), no RegionPeering left, nothing of the release left (any kind, by the
# release's label), nothing in the namespace Terminating, helm lists no release, and the CRDs still
# there and Established (Helm never deletes crds/; the chart intends that: values.yaml, crds).
uninstall_all() {
  phase="helm uninstall in ${REGIONS[*]} (e2e/tests/kind.rs: helm_uninstall_everywhere)"
  rust_step helm_uninstall_everywhere AETHER_E2E_REGIONS="$(IFS=,; echo "${REGIONS[*]}")" \
    AETHER_E2E_UNINSTALL_TIMEOUT="$UNINSTALL_TIMEOUT" \
    || fail "helm uninstall (e2e/tests/kind.rs, its output above)"
}

# --- 8b. A third region joins: c ------------------------------------------------------------------
# Provisioned here, checked in Rust beside it (e2e/src/scenarios/join.rs; e2e/tests/kind.rs,
# third_region_joins): federation.sh up a b c adds aether-c (its etcd, users mirror-a and mirror-b on
# it, mirror-c on a's and b's etcds, the Secrets for every pair) and keeps a and b; the operator
# image goes into c; the chart is installed in c with peers a and b, and a's and b's releases are
# upgraded with c as a second peer. The Rust step reads a's copy on b and b's on a from before the
# first change until the end: no key missing in any read. Then every RegionPeering Ready with two
# peers; c's keys on a and on b, a's and b's subtrees on c; a -> b and b -> a not re-synced.
provision_third_region() { # on failure: why, in provision_failure
  local r t t0
  t0=$(now_ms)
  heavy "$kind_dir/federation.sh" up a b c >"$log_dir/aether-kind-e2e-up-c.log" 2>&1 \
    || { tail -n 40 "$log_dir/aether-kind-e2e-up-c.log" >&2; provision_failure="hack/kind/federation.sh up a b c"; return 1; }
  record "third region: federation.sh up a b c (aether-c created, a and b kept)" "$(secs $(($(now_ms) - t0))) s"
  t=$(now_ms)
  heavy "$kind_dir/load-operator.sh" c >/dev/null || { provision_failure="hack/kind/load-operator.sh c"; return 1; }
  docker exec "$(node_of c)" ctr -n k8s.io images ls -q "name==$hook_image" | grep -qxF "$hook_image" \
    || heavy "$kind_dir/images.sh" load aether-c >/dev/null || { provision_failure="hack/kind/images.sh load aether-c"; return 1; }
  record "third region: load-operator.sh c" "$(secs $(($(now_ms) - t))) s"
  t=$(now_ms)
  for r in c a b; do install_region "$r"; done   # a failure exits; on_exit tells the Rust step
  record "third region: helm install c, helm upgrade a and b with c as a peer" "$(secs $(($(now_ms) - t))) s"
}
join_third_region() {
  local watching=$e2e_tmp/join-watching joined=$e2e_tmp/join-done out=$e2e_tmp/join.out rc=0 start=$SECONDS
  phase="a third region joins (e2e/tests/kind.rs: third_region_joins, beside the provisioning)"
  rm -f "$watching" "$joined"
  join_file=$joined
  rust_test third_region_joins AETHER_E2E_WATCHING_FILE="$watching" AETHER_E2E_JOINED_FILE="$joined" \
    AETHER_E2E_READY_TIMEOUT="$READY_TIMEOUT" AETHER_E2E_KEYS="$N_KEYS" AETHER_E2E_PROPAGATION_TIMEOUT="$PROPAGATION_TIMEOUT" \
    >"$out" 2>&1 &
  join_pid=$!
  until [[ -f $watching ]]; do
    kill -0 "$join_pid" 2>/dev/null || { wait "$join_pid" || true; rust_report "$(cat "$out")"; fail "third_region_joins exited before it read the baseline (its output above)"; }
    ((SECONDS - start < 300)) || fail "third_region_joins read no baseline within 300 s"
    sleep 0.5
  done
  REGIONS=(a b c)   # from here on the dump and the teardown include c
  phase="federation.sh up a b c, the image into c, helm install c, helm upgrade a and b"
  provision_failure=''
  if provision_third_region; then
    echo ok >"$joined"
    [[ -z $gitops_dir ]] || echo "${REGIONS[*]}" >"$gitops_dir/regions"   # c's Argo CD may follow now
  else
    echo "$provision_failure" >"$joined"
  fi
  wait "$join_pid" || rc=$?
  join_pid='' join_file=''
  rust_report "$(cat "$out")"
  ((rc == 0)) || { for r in a b c; do echo "e2e: regionpeering/$r:" >&2; rp_summary "$r" >&2; done; fail "a third region joining (e2e/tests/kind.rs, its output above)"; }
  o=a p=b
}

# --- 10. GitOps: each region's Argo CD syncs the chart and the region's RegionPeering from git -------
# hack/argocd/up.sh installs Argo CD (built here, hack/argocd/build.sh) and a git server in a region's
# cluster. It takes about a minute a region, so it runs beside the steps before 10: from the upgrade
# step on, one region at a time and niced (argocd_up_beside). Each region's result lands in
# $gitops_dir/R/ (up.out, rc); the regions the run ends with are written to $gitops_dir/regions once
# known (c's once its cluster is provisioned), and the installs still missing then follow. Step 10 writes each region's values (its etcds
# and Secrets as federation.sh made them, the images loaded above, deletionPolicy Delete) and runs the
# Rust scenarios (e2e/tests/gitops.rs): every region's first sync (the CRDs deleted first) and no
# drift; on the first region a TTL change committed, a peer removed and added back by two commits,
# a peer's etcd stopped and back (the peer's own Application Healthy again
# too), self-heal of a hand edit, an upgrade reverted; then every Application deleted. They run after
# the helm releases are gone.
gitops_dir='' argocd_pid=''
argocd_up_beside() { # REGION...: the clusters there now; the rest once $gitops_dir/regions names them
  gitops_dir=$e2e_tmp/gitops
  mkdir -p "$gitops_dir"
  (
    up() { mkdir -p "$gitops_dir/$1"; local rc=0; heavy "$root/hack/argocd/up.sh" "$1" >"$gitops_dir/$1/up.out" 2>&1 || rc=$?; echo "$rc" >"$gitops_dir/$1/rc"; }
    for r in "$@"; do up "$r"; done
    until [[ -f $gitops_dir/regions ]]; do sleep 1; done
    for r in $(cat "$gitops_dir/regions"); do [[ -f $gitops_dir/$r/rc ]] || up "$r"; done
  ) &
  argocd_pid=$!
}
argocd_ready() { # REGION: waits for its install beside the steps; fails with up.sh's output if it failed
  local r=$1 deadline=$((SECONDS + 900))
  until [[ -f $gitops_dir/$r/rc ]]; do
    kill -0 "$argocd_pid" 2>/dev/null || [[ -f $gitops_dir/$r/rc ]] || fail "hack/argocd/up.sh $r: the install beside the steps ended without a result"
    ((SECONDS < deadline)) || fail "hack/argocd/up.sh $r: not done within 900 s"
    sleep 1
  done
  [[ $(cat "$gitops_dir/$r/rc") == 0 ]] || { cat "$gitops_dir/$r/up.out" >&2; fail "hack/argocd/up.sh $r"; }
  grep -v '^GITOPS_REPO' "$gitops_dir/$r/up.out" || true
}
gitops_with_argocd() {
  local r q ip flag t in_cluster='' sets=()
  [[ -n $gitops_dir ]] || argocd_up_beside
  echo "${REGIONS[*]}" >"$gitops_dir/regions"
  phase="Argo CD in ${REGIONS[*]} (hack/argocd/up.sh, beside the steps before)"
  t=$(now_ms)
  for r in "${REGIONS[@]}"; do argocd_ready "$r"; done
  wait "$argocd_pid" || true
  argocd_pid=''
  record "GitOps: waited for Argo CD in ${REGIONS[*]} (installed beside the steps before)" "$(secs $(($(now_ms) - t))) s"
  for r in "${REGIONS[@]}"; do
    local GITOPS_REPO='' GITOPS_REPO_IN_CLUSTER=''
    eval "$(grep '^GITOPS_REPO' "$gitops_dir/$r/up.out")"
    [[ -n $GITOPS_REPO && -n $GITOPS_REPO_IN_CLUSTER ]] || fail "hack/argocd/up.sh $r printed no GITOPS_REPO (it said: $(cat "$gitops_dir/$r/up.out"))"
    echo "$GITOPS_REPO" >"$gitops_dir/$r/repo"
    in_cluster=$GITOPS_REPO_IN_CLUSTER
    sets=()
    for q in "${REGIONS[@]}"; do
      [[ $q == "$r" ]] && continue
      ip=$(node_ip "$q")
      [[ -n $ip ]] || fail "no kind-network address of $(node_of "$q")"
      sets+=("regionPeering.peerEtcd+=$q=https://$ip:$NODEPORT" "regionPeering.peerTlsSecrets.$q=registry-etcd-peer-$q")
    done
    for flag in "${image_flags[@]}" "${hook_flags[@]}"; do [[ $flag == --set ]] || sets+=("$flag"); done
    python3 - "$gitops_dir/$r/values.yaml" "$r" "$NS" "${sets[@]}" <<'PY' || fail "writing the GitOps values of $r"
import sys, yaml
out, region, ns, sets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
values = {"regionPeering": {
    "enabled": True, "region": region,
    "localEtcd": {"endpoints": [f"https://registry-etcd.{ns}.svc:2379"], "tlsSecret": "registry-etcd-local"},
    "peerEtcd": [], "peerTlsSecrets": {},
    "lease": {"ttlSeconds": 30, "keepaliveIntervalSeconds": 10},
    "deletionPolicy": "Delete"}}
for s in sets:
    path, value = s.split("=", 1)
    *parents, last = path.split(".")
    at = values
    for p in parents:
        at = at.setdefault(p, {})
    if last.endswith("+"):
        at[last[:-1]].append(value)
    else:
        at[last] = value
with open(out, "w") as f:
    yaml.safe_dump(values, f, sort_keys=False)
PY
  done
  # The upgrade step loaded the re-tagged image into aether-a; without it the scenario says so.
  local upgrade_tag=''
  [[ $UPGRADE == 1 ]] && upgrade_tag=$version-e2e-upgrade
  phase="the GitOps scenarios (e2e/tests/gitops.rs)"
  t=$(now_ms)
  (cd "$root" && GITOPS_REPO_IN_CLUSTER=$in_cluster AETHER_GITOPS_REGIONS=$(IFS=,; echo "${REGIONS[*]}") \
    AETHER_GITOPS_DIR=$gitops_dir AETHER_KIND_FED_DIR=$fed_dir \
    AETHER_KIND_ETCD_NODEPORT=$NODEPORT AETHER_GITOPS_UPGRADE_TAG=$upgrade_tag "${CARGO:-cargo}" test -q -p aether-e2e --test gitops -- --ignored --nocapture) \
    || fail "the GitOps scenarios with Argo CD (e2e/tests/gitops.rs; its output above)"
  record "GitOps scenarios with Argo CD in ${REGIONS[*]}" "$(secs $(($(now_ms) - t))) s"
}

if [[ $GITOPS == 1 && $UNINSTALL == 1 ]]; then argocd_up_beside "${REGIONS[@]}"; fi
if [[ $UPGRADE == 1 ]]; then upgrade_and_rollback; else say "upgrade and rollback: SKIPPED (AETHER_E2E_UPGRADE=$UPGRADE)"; fi
if [[ $THREE == 1 ]]; then join_third_region; else say "third region: SKIPPED (AETHER_E2E_THREE=$THREE)"; fi
[[ -z $gitops_dir ]] || echo "${REGIONS[*]}" >"$gitops_dir/regions"
if [[ $ROTATION == 1 ]]; then rotate_peer_secret; else say "secret rotation: SKIPPED (AETHER_E2E_ROTATION=$ROTATION)"; fi
if [[ $UNINSTALL == 1 ]]; then uninstall_all; else say "helm uninstall: SKIPPED (AETHER_E2E_UNINSTALL=$UNINSTALL)"; fi
if [[ $GITOPS == 1 && $UNINSTALL == 1 ]]; then gitops_with_argocd; else say "GitOps with Argo CD: SKIPPED (AETHER_E2E_GITOPS=$GITOPS, AETHER_E2E_UNINSTALL=$UNINSTALL)"; fi

record "total: e2e.sh from start to here (without federation.sh down)" "$SECONDS s"
phase=finished
