#!/usr/bin/env bash
# The e2e scenario on two kind clusters, one etcd per region, the operator installed with the
# Helm chart from an image loaded with `kind load`. Needs Docker, kind, kubectl and helm.
#   e2e/kind.sh          run it
#   KEEP=1 e2e/kind.sh   leave the clusters running afterwards
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v docker >/dev/null || missing+=(docker)
command -v kind >/dev/null || missing+=(kind)
command -v kubectl >/dev/null || missing+=(kubectl)
command -v helm >/dev/null || missing+=(helm)
if ((${#missing[@]})); then
  echo "e2e-kind: missing ${missing[*]}. Install Docker (https://docs.docker.com/engine/install/) and kind (https://kind.sigs.k8s.io/), or run 'make e2e', which needs neither." >&2
  exit 2
fi
if ! docker info >/dev/null 2>&1; then
  echo "e2e-kind: the Docker engine is not reachable (docker info failed); start it, or run 'make e2e'." >&2
  exit 2
fi

IMAGE=aether-operator:e2e
REGIONS=(a b)
cleanup() { [[ -n "${KEEP:-}" ]] || for r in "${REGIONS[@]}"; do kind delete cluster --name "aether-$r" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT

docker build -t "$IMAGE" .
for r in "${REGIONS[@]}"; do
  kind create cluster --name "aether-$r" --wait 120s
  kind load docker-image "$IMAGE" --name "aether-$r"
  ctx="kind-aether-$r"
  kubectl --context "$ctx" create namespace aether-system
  # The region's registry etcd, reachable from the other cluster through the node's port 32379.
  kubectl --context "$ctx" -n aether-system apply -f - <<YAML
apiVersion: apps/v1
kind: Deployment
metadata: {name: registry-etcd}
spec:
  selector: {matchLabels: {app: registry-etcd}}
  template:
    metadata: {labels: {app: registry-etcd}}
    spec:
      containers:
        - name: etcd
          image: registry.k8s.io/etcd:3.5.21-0
          command: [etcd, --listen-client-urls=http://0.0.0.0:2379, --advertise-client-urls=http://registry-etcd:2379, --data-dir=/tmp/etcd]
---
apiVersion: v1
kind: Service
metadata: {name: registry-etcd}
spec:
  type: NodePort
  selector: {app: registry-etcd}
  ports: [{port: 2379, nodePort: 32379}]
YAML
  kubectl --context "$ctx" -n aether-system rollout status deploy/registry-etcd --timeout 120s
done
node_ip() { docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "aether-$1-control-plane"; }

for r in "${REGIONS[@]}"; do
  peers=()
  for p in "${REGIONS[@]}"; do [[ "$p" == "$r" ]] || peers+=("$p=http://$(node_ip "$p"):32379"); done
  helm --kube-context "kind-aether-$r" install aether charts/aether-federation -n aether-system \
    --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE#*:}" --set image.pullPolicy=Never \
    --set regionPeering.enabled=true --set regionPeering.region="$r" \
    --set "regionPeering.localEtcd.endpoints={http://registry-etcd.aether-system:2379}" \
    --set "regionPeering.peerEtcd={$(IFS=,; echo "${peers[*]}")}" \
    --set regionPeering.lease.ttlSeconds=10 --set regionPeering.lease.keepaliveIntervalSeconds=3
done

etcdctl_in() { kubectl --context "kind-aether-$1" -n aether-system exec deploy/registry-etcd -- etcdctl "${@:2}"; }
count() { etcdctl_in "$1" get --prefix "/aether/v1/regions/$2/" --count-only -w fields | awk '/"Count"/ {print $3}'; }
wait_for() { local what=$1; shift; for _ in $(seq 1 90); do if "$@"; then echo "ok: $what"; return 0; fi; sleep 2; done; echo "FAILED: $what" >&2; exit 1; }
ready() { [[ $(kubectl --context "kind-aether-$1" -n aether-system get regionpeering "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]; }

# 1. Visibility
for r in "${REGIONS[@]}"; do
  for i in $(seq 1 50); do etcdctl_in "$r" put "/aether/v1/regions/$r/clusters/c1/services/s/protocols/http/endpoints/10.0.0.$i" "{\"region\":\"$r\"}" >/dev/null; done
done
for r in "${REGIONS[@]}"; do wait_for "$r Ready" ready "$r"; done
wait_for "a's endpoints in b" test "$(count b a)" = 50
wait_for "b's endpoints in a" test "$(count a b)" = 50
# 2. Data path
etcdctl_in a del /aether/v1/regions/a/clusters/c1/services/s/protocols/http/endpoints/10.0.0.1 >/dev/null
wait_for "delete mirrored" test "$(count b a)" = 49
# 3. Leader handoff in a
leader=$(kubectl --context kind-aether-a -n aether-system get regionpeering a -o jsonpath='{.status.leader}')
kubectl --context kind-aether-a -n aether-system delete pod "$leader" --grace-period=0 --force
sleep 15
test "$(count b a)" = 49 && echo "ok: no mirrored key lost in the handoff"
wait_for "a Ready under a new leader" ready a
# 4. Region loss
kubectl --context kind-aether-a -n aether-system scale deploy/aether --replicas 0
kubectl --context kind-aether-a -n aether-system scale deploy/registry-etcd --replicas 0
wait_for "a's mirror expired in b" test "$(count b a)" = 0
wait_for "b reports a unreachable" test "$(kubectl --context kind-aether-b -n aether-system get regionpeering b -o jsonpath='{.status.conditions[?(@.type=="PeersReachable")].status}')" = False
# 5. Recovery (a's etcd lost its data with the pod: a's registrars would re-register; here we write again)
kubectl --context kind-aether-a -n aether-system scale deploy/registry-etcd --replicas 1
kubectl --context kind-aether-a -n aether-system rollout status deploy/registry-etcd --timeout 120s
for i in $(seq 1 50); do etcdctl_in a put "/aether/v1/regions/a/clusters/c1/services/s/protocols/http/endpoints/10.0.0.$i" '{"region":"a"}' >/dev/null; done
kubectl --context kind-aether-a -n aether-system scale deploy/aether --replicas 2
wait_for "a Ready again" ready a
wait_for "a's mirror back in b" test "$(count b a)" = 50
echo "e2e-kind: passed"
