#!/usr/bin/env bash
# Argo CD and a git server in a region's kind cluster (hack/kind/federation.sh up made it), offline:
#
#   hack/argocd/up.sh REGION     load build.sh's image into aether-REGION, install Argo CD
#                                (manifest.py: controller, repo-server, redis; the project's health
#                                checks) in namespace argocd and the git server in namespace gitops;
#                                wait until both run; print GITOPS_REPO=<the URL this host pushes to>
#                                and GITOPS_REPO_IN_CLUSTER=<the URL Argo CD reads>
#
# The repository (gitops.git, branch main) starts empty: whoever drives the scenario pushes to it.
# Every wait polls with a deadline and says what it saw.
set -euo pipefail
# shellcheck source=../kind/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../kind" && pwd)/lib.sh"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
region=${1:?usage: up.sh REGION}
cluster=aether-$region
fed_dir=${AETHER_KIND_FED_DIR:-/tmp/aether-kind-federation}
kubeconfig=$fed_dir/kubeconfig
kubectl_bin=$tools_dir/kind-kube-$KUBE_VERSION/kubectl
k() { "$kubectl_bin" --kubeconfig "$kubeconfig" --context "kind-$cluster" "$@"; }
GIT_NODEPORT=30418

need_root "installing Argo CD into kind"
engine_up
docker inspect "$cluster-control-plane" >/dev/null 2>&1 || die "cluster $cluster does not run (hack/kind/federation.sh up $region)"
out=$("$here/build.sh") || die "hack/argocd/build.sh failed"
eval "$(grep '^ARGOCD_' <<<"$out")"   # ARGOCD_IMAGE, ARGOCD_DIR: built or reused

t=$SECONDS
# kind skips a node that has it already.
heavy "$bin_dir/kind" load docker-image "$ARGOCD_IMAGE" --name "$cluster" >"$log_dir/aether-argocd-load.log" 2>&1 \
  || { cat "$log_dir/aether-argocd-load.log" >&2; die "kind load docker-image $ARGOCD_IMAGE into $cluster failed"; }
say "image $ARGOCD_IMAGE in $cluster ($((SECONDS - t)) s)"

manifest=$(mktemp -t aether-argocd-install.XXXXXX.yaml)
trap 'rm -f "$manifest"' EXIT
python3 "$here/manifest.py" --install "$ARGOCD_DIR/install.yaml" --image "$ARGOCD_IMAGE" --out "$manifest" \
  --health "federation.aether.dev_RegionPeering=$root/config/argocd/regionpeering-health.lua" \
  --health "federation.aether.dev_RegistrySchema=$root/config/argocd/registryschema-health.lua" \
  --health "apiextensions.k8s.io_CustomResourceDefinition=$root/config/argocd/crd-health.lua"
k create namespace argocd --dry-run=client -o yaml | k apply -f - >/dev/null
# The first apply meets the AppProject before its CRD is established: wait for it and apply again.
t=$SECONDS
for attempt in 1 2 3 4 5; do
  if out=$(k apply --server-side --force-conflicts -n argocd -f "$manifest" 2>&1); then break; fi
  ((attempt < 5)) || { echo "$out" >&2; die "applying Argo CD's manifest failed 5 times"; }
  k wait --for=condition=Established crd --all --timeout=60s >/dev/null 2>&1 || true
done
for w in statefulset/argocd-application-controller deployment/argocd-repo-server deployment/argocd-redis; do
  k -n argocd rollout status "$w" --timeout=300s >/dev/null \
    || { k -n argocd get pods -o wide >&2; k -n argocd describe "$w" >&2 || true; die "$w not ready within 300 s"; }
done
say "Argo CD $ARGOCD_IMAGE running in $cluster ($((SECONDS - t)) s from the apply)"

sed "s|__ARGOCD_IMAGE__|$ARGOCD_IMAGE|" "$here/git-server.yaml" | k apply -f - >/dev/null
k -n gitops rollout status deployment/git-server --timeout=120s >/dev/null \
  || { k -n gitops get pods -o wide >&2; die "the git server is not ready within 120 s"; }
ip=$(docker inspect -f '{{with index .NetworkSettings.Networks "kind"}}{{.IPAddress}}{{end}}' "$cluster-control-plane")
# Its daemon answers once the NodePort routes to it.
deadline=$((SECONDS + 60))
until git ls-remote "git://$ip:$GIT_NODEPORT/gitops.git" >/dev/null 2>&1; do
  ((SECONDS < deadline)) || die "git ls-remote git://$ip:$GIT_NODEPORT/gitops.git: no answer within 60 s"
  sleep 1
done
echo "GITOPS_REPO=git://$ip:$GIT_NODEPORT/gitops.git"
echo "GITOPS_REPO_IN_CLUSTER=git://git-server.gitops.svc.cluster.local/gitops.git"
