#!/usr/bin/env bash
# Smoke test of the offline kind substrate: a one-node kind cluster from hack/kind/node-image.sh's
# image (no default CNI: the node's static bridge conflist; kubelet with failCgroupV1: false on
# Kubernetes 1.35+), then waits, each with a deadline, for the node Ready, CoreDNS Ready, and a
# pod of a locally built busybox image (Debian's busybox-static, loaded with `kind load`) Running
# and resolving the API server's Service name through CoreDNS. Deletes the cluster afterwards, and
# stops dockerd again if this run started it.
#
#   hack/kind/smoke.sh          run it
#   KEEP=1 hack/kind/smoke.sh   leave the cluster (and dockerd) running
#
# On a failure it prints what it saw: kubectl describe of the nodes and pods, events, the node
# container's docker logs and the node's journal (kubelet, containerd).
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

CLUSTER=${AETHER_KIND_SMOKE_CLUSTER:-aether-smoke}
need_root "the kind smoke test"
started_file=${AETHER_KIND_STATE_DIR:-/run/aether-federation}/dockerd.started-by-engine-sh
engine_already_started=; [[ -f $started_file ]] && engine_already_started=1

t0=$SECONDS
image=$("$kind_dir/node-image.sh") || die "the node image is not available (hack/kind/node-image.sh failed)"
engine_up   # after node-image.sh: it starts dockerd when needed
kind_install
kubectl=$tools_dir/kind-kube-$KUBE_VERSION/kubectl
[[ -x $kubectl ]] || die "kubectl $KUBE_VERSION is missing from $tools_dir/kind-kube-$KUBE_VERSION (hack/kind/node-image.sh builds it)"
kind=$bin_dir/kind
say "node image $image ready after $((SECONDS - t0)) s"

# A pod image built here: Debian's busybox-static.
busybox_image() {
  local ver
  ver=$(apt-cache policy busybox-static 2>/dev/null | sed -n 's/^  Candidate: //p')
  if [[ -z $ver || $ver == "(none)" ]]; then
    heavy apt-get update -qq >/dev/null || die "apt-get update failed: Debian's mirror is needed for busybox-static"
    ver=$(apt-cache policy busybox-static | sed -n 's/^  Candidate: //p')
  fi
  [[ -n $ver && $ver != "(none)" ]] || die "Debian's busybox-static package is not known to apt (apt-get update failed?)"
  local tag=aether.local/busybox:${ver//[^A-Za-z0-9_.-]/_}
  if ! docker image inspect "$tag" >/dev/null 2>&1; then
    local d
    d=$(mktemp -d /tmp/aether-busybox.XXXXXX)
    (cd "$d" && apt-get download -qq "busybox-static=$ver" >/dev/null 2>&1) || { rm -rf "$d"; die "apt-get download busybox-static=$ver failed"; }
    dpkg-deb -x "$d"/busybox-static_*.deb "$d/root"
    mkdir -p "$d/root/tmp" "$d/root/etc" && chmod 1777 "$d/root/tmp"
    for a in sh sleep nslookup wget cat ls; do ln -sf busybox "$d/root/bin/$a"; done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n' >"$d/root/etc/passwd"
    tar -C "$d/root" --numeric-owner --owner=0 --group=0 -c . \
      | docker import --change 'CMD ["/bin/sh"]' - "$tag" >/dev/null || { rm -rf "$d"; die "docker import of $tag failed"; }
    rm -rf "$d"
  fi
  echo "$tag"
}
pod_image=$(busybox_image)

kubeconfig=$log_dir/aether-kind-$CLUSTER.kubeconfig
k() { "$kubectl" --kubeconfig "$kubeconfig" "$@"; }
node=$CLUSTER-control-plane

dump() {
  echo "===== what was seen =====" >&2
  {
    k get nodes -o wide; k describe nodes
    k get pods -A -o wide; k -n kube-system describe pods; k describe pods
    k get events -A --sort-by=.lastTimestamp | tail -n 60
  } >&2 2>&1 || true
  echo "===== docker logs $node (last 80 lines) =====" >&2
  docker logs "$node" 2>&1 | tail -n 80 >&2 || true
  echo "===== journal of $node: kubelet, containerd (last 150 lines) =====" >&2
  docker exec "$node" journalctl --no-pager -u kubelet -u containerd 2>&1 | tail -n 150 >&2 || true
  echo "===== systemd units that failed in $node =====" >&2
  docker exec "$node" systemctl --failed --no-pager >&2 2>&1 || true
  echo "===== containers in $node =====" >&2
  docker exec "$node" ctr -n k8s.io containers ls >&2 2>&1 || true
}
fail() { echo "smoke: FAILED: $*" >&2; dump; exit 1; }

cleanup() {
  local rc=$?
  if [[ -z ${KEEP:-} ]]; then
    "$kind" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    docker rm -f "$node" >/dev/null 2>&1 || true
    if [[ -z $engine_already_started && -f $started_file ]]; then "$kind_dir/engine.sh" stop || true; fi
  else
    say "KEEP=1: cluster $CLUSTER left running (kubeconfig $kubeconfig)"
  fi
  exit "$rc"
}
trap cleanup EXIT

# wait_for WHAT SECONDS CMD...: poll CMD every 2 s until it succeeds or the deadline passes.
wait_for() {
  local what=$1 secs=$2 start=$SECONDS; shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS - start < secs)) || fail "$what: not within $secs s"
    sleep 2
  done
  say "ok: $what after $((SECONDS - start)) s"
}

"$kind" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
cfg=$log_dir/aether-kind-$CLUSTER.yaml
kind_config "$cfg"

start=$SECONDS
say "kind create cluster --name $CLUSTER --image $image"
if ! timeout 600 "$kind" create cluster --name "$CLUSTER" --image "$image" --config "$cfg" \
    --kubeconfig "$kubeconfig" --retain >"$log_dir/aether-kind-$CLUSTER-create.log" 2>&1; then
  cat "$log_dir/aether-kind-$CLUSTER-create.log" >&2
  fail "kind create cluster (log $log_dir/aether-kind-$CLUSTER-create.log)"
fi
say "ok: kind create cluster after $((SECONDS - start)) s"

node_ready() { [[ $(k get node "$node" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]; }
coredns_ready() {
  local want got
  want=$(k -n kube-system get deploy coredns -o jsonpath='{.spec.replicas}')
  got=$(k -n kube-system get deploy coredns -o jsonpath='{.status.readyReplicas}')
  [[ -n $want && $got == "$want" ]]
}
wait_for "node $node Ready" 180 node_ready
wait_for "CoreDNS Ready" 180 coredns_ready

start=$SECONDS
"$kind" load docker-image "$pod_image" --name "$CLUSTER" >"$log_dir/aether-kind-$CLUSTER-load.log" 2>&1 \
  || { cat "$log_dir/aether-kind-$CLUSTER-load.log" >&2; fail "kind load docker-image $pod_image"; }
say "ok: kind load docker-image $pod_image after $((SECONDS - start)) s"
k apply -f - >/dev/null <<YAML || fail "kubectl apply of the smoke pod"
apiVersion: v1
kind: Pod
metadata: {name: smoke}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: busybox
    image: $pod_image
    imagePullPolicy: Never
    command: [sleep, "3600"]
YAML
pod_running() { [[ $(k get pod smoke -o jsonpath='{.status.phase}') == Running ]]; }
wait_for "pod smoke Running" 120 pod_running
resolves() { k exec smoke -- nslookup kubernetes.default.svc.cluster.local | grep -q 'Address.*10\.96\.0\.1$'; }
wait_for "the pod resolves kubernetes.default through CoreDNS" 60 resolves

say "PASS in $((SECONDS - t0)) s"
