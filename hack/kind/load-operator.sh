#!/usr/bin/env bash
# Loads the operator's image, as `make image` shipped it (target/image/aether-operator-<version>.oci.tar,
# an OCI layout with a multi-arch index over linux/amd64 and linux/arm64), into kind clusters with
# `kind load image-archive`, and checks that each node's CRI lists it and that the kubelet starts a
# container from it (imagePullPolicy: Never). Prints the helm --set flags for the chart's image.
#
#   hack/kind/load-operator.sh [regions...]   default: every region hack/kind/federation.sh set up
#                                             (clusters aether-<region>)
#   AETHER_OPERATOR_ARCHIVE=path              another archive (a rebuilt image of a bumped version)
#
# What kind needs: `kind load image-archive` runs `ctr -n k8s.io images import --all-platforms
# --digests -` in the node, which takes the OCI archive as it is (every platform's blobs are in it;
# the CRI unpacks the node's platform when a container starts) but names the image after the
# index.json annotation: `make image` writes only `org.opencontainers.image.ref.name: <version>`,
# which ctr would turn into `import-<date>:<version>`. So the archive is copied with the index's
# descriptor annotated `io.containerd.image.name: aether.local/aether-operator:<version>` (blobs,
# manifests and the index digest unchanged), and that copy is loaded. The name is local on purpose:
# with pullPolicy Never nothing ever tries a registry.
#
# Needs: root, the clusters (federation.sh up), python3; crictl (built once from the Go module
# sigs.k8s.io/cri-tools into the tools cache, copied into the nodes) for the CRI's view.
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

CRICTL_VERSION=v1.34.0   # the newest sigs.k8s.io/cri-tools the Go proxy serves below 1.37; CRI v1
REPOSITORY=aether.local/aether-operator
root=$(cd "$kind_dir/../.." && pwd)
work_fed=${AETHER_KIND_FED_DIR:-/tmp/aether-kind-federation}
NS=aether-system

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml")
archive=${AETHER_OPERATOR_ARCHIVE:-$root/target/image/aether-operator-$version.oci.tar}
if [[ ! -f $archive ]]; then
  others=$(ls "$root"/target/image/aether-operator-*.oci.tar 2>/dev/null | tr '\n' ' ' || true)
  die "$archive does not exist: run 'make image' first (it builds the operator's OCI archive)${others:+; found other versions: $others(pick one with AETHER_OPERATOR_ARCHIVE=...)}"
fi
need_root "loading images into kind"
command -v python3 >/dev/null || die "python3 is needed to annotate the archive's index"

regions=("$@")
if ((${#regions[@]} == 0)); then
  for d in "$work_fed"/region-*/; do [[ -d $d ]] && { d=${d%/}; regions+=("${d##*/region-}"); }; done
fi
((${#regions[@]})) || die "no region given and none set up by hack/kind/federation.sh (run 'hack/kind/federation.sh up' first)"

engine_up
kind_install
kubectl=$tools_dir/kind-kube-$KUBE_VERSION/kubectl
kubeconfig=$work_fed/kubeconfig
for r in "${regions[@]}"; do
  docker inspect "aether-$r-control-plane" >/dev/null 2>&1 || die "cluster aether-$r does not run (hack/kind/federation.sh up ${regions[*]})"
done

# --- The archive, named for containerd ------------------------------------------------------------
t0=$SECONDS
tmp=$(mktemp -d /tmp/aether-operator-load.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/layout"
tar -C "$tmp/layout" -xf "$archive" || die "$archive is not a tar archive"
[[ -f $tmp/layout/index.json && -f $tmp/layout/oci-layout ]] || die "$archive is not an OCI image layout (no index.json or oci-layout): make image writes one"
node_arch=$(docker exec "aether-${regions[0]}-control-plane" uname -m)
case $node_arch in x86_64) node_arch=amd64 ;; aarch64) node_arch=arm64 ;; esac
info=$(python3 - "$tmp/layout" "$REPOSITORY" "$node_arch" <<'PY'
import json, os, sys
layout, repo, arch = sys.argv[1:4]
with open(os.path.join(layout, "index.json")) as f:
    top = json.load(f)
if len(top.get("manifests", [])) != 1:
    sys.exit("index.json should hold one descriptor (the image's index); it holds %d" % len(top.get("manifests", [])))
desc = top["manifests"][0]
ann = desc.setdefault("annotations", {})
tag = ann.get("org.opencontainers.image.ref.name", "")
if not tag or "/" in tag or ":" in tag:
    sys.exit("index.json's ref.name should be the version, it is %r" % tag)
def blob(d):
    with open(os.path.join(layout, "blobs", *d["digest"].split(":", 1)), "rb") as f:
        return json.load(f)
platforms = []
if desc["mediaType"] == "application/vnd.oci.image.index.v1+json":
    platforms = ["%s/%s" % (m["platform"]["os"], m["platform"]["architecture"]) for m in blob(desc)["manifests"]]
else:
    cfg = blob(blob(desc)["config"])
    platforms = ["%s/%s" % (cfg["os"], cfg["architecture"])]
if "linux/" + arch not in platforms:
    sys.exit("the image has no linux/%s manifest (it has %s): the kind node cannot run it" % (arch, ", ".join(platforms)))
ann["io.containerd.image.name"] = "%s:%s" % (repo, tag)
with open(os.path.join(layout, "index.json"), "w") as f:
    json.dump(top, f, sort_keys=True)
print(tag, desc["digest"], " ".join(platforms))
PY
) || die "annotating $archive's index.json failed (message above)"
read -r tag index_digest platforms <<<"$info"
ref=$REPOSITORY:$tag
# ctr's importer reads oci-layout, index.json and blobs/ by name: no leading ./
tar -C "$tmp/layout" --owner=0 --group=0 --numeric-owner -cf "$tmp/image.tar" oci-layout index.json blobs
say "archive $archive: version $tag, index $index_digest, platforms $platforms; loading as $ref"

# crictl, for the CRI's view of the node (kind's node image has none).
crictl=$tools_dir/crictl-$CRICTL_VERSION/crictl
build_crictl() {
  [[ -x $crictl ]] && return 0
  need_go
  local start=$SECONDS dest=${crictl%/crictl}
  say "crictl $CRICTL_VERSION: go install sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
  rm -rf "$dest.tmp"
  (cd /tmp && GOBIN=$dest.tmp CGO_ENABLED=0 heavy go install -trimpath "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION") \
    || die "go install sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION failed (the Go module proxy is needed the first time)"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
  say "crictl $CRICTL_VERSION: built in $((SECONDS - start)) s"
}
with_lock "$tools_dir/crictl-$CRICTL_VERSION" build_crictl

k() { local r=$1; shift; "$kubectl" --kubeconfig "$kubeconfig" --context "kind-aether-$r" "$@"; }
dump() {
  local r=$1 node=aether-$1-control-plane
  echo "===== aether-$r: the check pod, events, images =====" >&2
  { k "$r" -n "$NS" describe pod aether-operator-image-check; k "$r" -n "$NS" logs aether-operator-image-check
    k "$r" get events -n "$NS" --sort-by=.lastTimestamp | tail -n 20; } >&2 2>&1 || true
  docker exec "$node" ctr -n k8s.io images ls >&2 2>&1 || true
  docker exec "$node" journalctl --no-pager -u containerd 2>&1 | tail -n 30 >&2 || true
}
fail() { local r=$1; shift; echo "load-operator: FAILED: $*" >&2; dump "$r"; exit 1; }

for r in "${regions[@]}"; do
  node=aether-$r-control-plane start=$SECONDS
  "$bin_dir/kind" load image-archive "$tmp/image.tar" --name "aether-$r" >"$tmp/load.log" 2>&1 \
    || { cat "$tmp/load.log" >&2; die "kind load image-archive into aether-$r failed"; }
  say "aether-$r: kind load image-archive in $((SECONDS - start)) s"
  docker exec "$node" ctr -n k8s.io images ls -q "name==$ref" | grep -qxF "$ref" \
    || { docker exec "$node" ctr -n k8s.io images ls >&2; die "aether-$r: containerd has no $ref after the load"; }
  docker exec "$node" test -x /usr/local/bin/crictl || docker cp "$crictl" "$node:/usr/local/bin/crictl" >/dev/null
  seen=$(docker exec "$node" crictl --runtime-endpoint unix:///run/containerd/containerd.sock images --digests 2>&1 | grep -F "$REPOSITORY" | grep -F "$tag" || true)
  [[ -n $seen ]] || { docker exec "$node" crictl --runtime-endpoint unix:///run/containerd/containerd.sock images >&2 || true; die "aether-$r: crictl images does not list $ref"; }
  say "aether-$r: crictl images: $(tr -s ' ' <<<"$seen")"
  # The kubelet starts a container from it, without pulling: Running (the operator waits for its
  # API), or exits after `--help`.
  k "$r" create namespace "$NS" --dry-run=client -o yaml | k "$r" apply -f - >/dev/null
  k "$r" -n "$NS" delete pod aether-operator-image-check --ignore-not-found --wait=true >/dev/null 2>&1 || true
  k "$r" -n "$NS" apply -f - >/dev/null <<YAML || fail "$r" "creating the check pod"
apiVersion: v1
kind: Pod
metadata: {name: aether-operator-image-check}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  automountServiceAccountToken: false
  containers:
  - name: operator
    image: $ref
    imagePullPolicy: Never
    args: [--help]
YAML
  start=$SECONDS
  while :; do
    started=$(k "$r" -n "$NS" get pod aether-operator-image-check -o jsonpath='{.status.containerStatuses[0].state.running.startedAt}{.status.containerStatuses[0].state.terminated.exitCode}' 2>/dev/null || true)
    [[ -n $started ]] && break
    waiting=$(k "$r" -n "$NS" get pod aether-operator-image-check -o jsonpath='{.status.containerStatuses[0].state.waiting.reason}' 2>/dev/null || true)
    [[ $waiting == ErrImageNeverPull || $waiting == CreateContainerError ]] && fail "$r" "aether-$r: the kubelet cannot start $ref: $waiting"
    ((SECONDS - start < 90)) || fail "$r" "aether-$r: no container of $ref started within 90 s"
    sleep 2
  done
  say "aether-$r: the kubelet started a container of $ref after $((SECONDS - start)) s ($(k "$r" -n "$NS" get pod aether-operator-image-check -o jsonpath='{.status.phase}'))"
  k "$r" -n "$NS" delete pod aether-operator-image-check --wait=false >/dev/null 2>&1 || true
done
say "loaded into ${regions[*]/#/aether-} in $((SECONDS - t0)) s"
echo "--set image.repository=$REPOSITORY --set image.tag=$tag --set image.pullPolicy=Never"
