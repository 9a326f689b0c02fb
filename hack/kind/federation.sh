#!/usr/bin/env bash
# A federation of kind clusters on this machine, offline: one cluster per region (`aether-<region>`,
# node image from node-image.sh, no default CNI: the node's baked bridge), and in each the region's
# registry etcd (the image images.sh builds from the project's etcd v3.6.16) served over mTLS on a
# NodePort that the other clusters' nodes reach over kind's docker network, with auth enabled:
# root, plus the least-privilege user `mirror-<origin>` for every other region, made by
# hack/etcd-mirror-role.sh. In namespace aether-system of each cluster, the Secrets the operator
# reads (operator/src/controllers/etcd_access.rs: ca.crt, tls.crt, tls.key, username, password):
#   registry-etcd-local        the local etcd, as root (client certificate CN=root)
#   registry-etcd-peer-<peer>  each peer's etcd, as mirror-<this region> (client certificate
#                              CN=mirror-<this region> from the peer's CA, and its password)
#
#   hack/kind/federation.sh up [regions...]      create what is missing (default regions: a b) and
#                                                (re)configure users and Secrets for these regions
#   hack/kind/federation.sh status [regions...]  what runs; each region's endpoints and helm flags
#   hack/kind/federation.sh down [regions...]    delete the clusters (default: every region this
#                                                script set up), and stop dockerd if `up` started it
#
# One etcd member per region (a StatefulSet of one, data on the node under
# /var/lib/aether-registry-etcd, so it outlives the pod: scaling it to 0 and back keeps the users).
# Every wait polls with a deadline; a failure prints kubectl describe, events and logs.
# State (certificates, passwords, one kubeconfig with a context kind-aether-<region> per cluster):
# $AETHER_KIND_FED_DIR (default /tmp/aether-kind-federation). Needs what node-image.sh and
# images.sh need; nothing is pulled.
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

NODEPORT=${AETHER_KIND_ETCD_NODEPORT:-32379}
NS=aether-system
work=${AETHER_KIND_FED_DIR:-/tmp/aether-kind-federation}
kubeconfig=$work/kubeconfig
hack_dir=$(cd "$kind_dir/.." && pwd)
started_file=${AETHER_KIND_STATE_DIR:-/run/aether-federation}/dockerd.started-by-engine-sh

cmd=${1:-status}; shift || true
regions=("$@")
for r in "${regions[@]}"; do
  [[ $r =~ ^[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?$ ]] || die "region '$r': use a short DNS label (a-z, 0-9, -)"
done
known_regions() { local d; for d in "$work"/region-*/; do [[ -d $d ]] && { d=${d%/}; echo "${d##*/region-}"; }; done; }

kubectl_bin=$tools_dir/kind-kube-$KUBE_VERSION/kubectl
etcdctl_bin=$tools_dir/bin/etcdctl
k() { local r=$1; shift; "$kubectl_bin" --kubeconfig "$kubeconfig" --context "kind-aether-$r" "$@"; }
node_of() { echo "aether-$1-control-plane"; }
node_ip() { docker inspect -f '{{with index .NetworkSettings.Networks "kind"}}{{.IPAddress}}{{end}}' "$(node_of "$1")" 2>/dev/null; }
cluster_exists() { docker inspect "$(node_of "$1")" >/dev/null 2>&1; }
rdir() { echo "$work/region-$1"; }

# etcdctl from this host against region R's NodePort, as USER (root, or mirror-<origin>).
ectl() { # R USER ARGS...
  local r=$1 user=$2 d; shift 2; d=$(rdir "$r")
  "$etcdctl_bin" --endpoints "https://$(node_ip "$r"):$NODEPORT" --cacert "$d/ca.crt" \
    --cert "$d/client-$user.crt" --key "$d/client-$user.key" --dial-timeout 5s --command-timeout 10s "$@"
}

dump() { # REGIONS...
  local r
  for r in "$@"; do
    cluster_exists "$r" || { echo "===== aether-$r: no node container =====" >&2; continue; }
    echo "===== aether-$r: nodes, pods, describe, events =====" >&2
    {
      k "$r" get nodes -o wide; k "$r" get pods -A -o wide
      k "$r" -n "$NS" describe statefulset,pods,services
      k "$r" get events -A --sort-by=.lastTimestamp | tail -n 40
    } >&2 2>&1 || true
    local p
    for p in $(k "$r" -n "$NS" get pods -o name 2>/dev/null); do
      echo "===== aether-$r: logs of $p =====" >&2
      k "$r" -n "$NS" logs "$p" --all-containers --tail 60 >&2 2>&1 || true
      k "$r" -n "$NS" logs "$p" --all-containers --previous --tail 30 >&2 2>/dev/null || true
    done
    echo "===== aether-$r: the node's kubelet/containerd journal (last 60 lines) =====" >&2
    docker exec "$(node_of "$r")" journalctl --no-pager -u kubelet -u containerd 2>&1 | tail -n 60 >&2 || true
  done
}
fail() { echo "federation: FAILED: $*" >&2; dump "${regions[@]}"; exit 1; }

# wait_for WHAT SECONDS CMD...: poll CMD every 2 s until it succeeds or the deadline passes.
wait_for() {
  local what=$1 secs=$2 start=$SECONDS out; shift 2
  until out=$("$@" 2>&1); do
    ((SECONDS - start < secs)) || fail "$what: not within $secs s${out:+; the last attempt said: $(tail -n 3 <<<"$out")}"
    sleep 2
  done
  say "ok: $what after $((SECONDS - start)) s"
}

# --- Certificates ---------------------------------------------------------------------------------
# One CA per region (the region's etcd trusts it for clients and serves a certificate from it);
# EC P-256, 30 days.
openssl_leaf() { # DIR NAME CN EXT
  local d=$1 n=$2 cn=$3 ext=$4
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -keyout "$d/$n.key" -out "$d/$n.csr" \
    -subj "/CN=$cn" 2>/dev/null || die "openssl req for $cn failed"
  openssl x509 -req -in "$d/$n.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 30 -sha256 \
    -out "$d/$n.crt" -extfile <(printf '%s\n' "$ext") 2>/dev/null || die "openssl x509 (signing $cn) failed"
  rm -f "$d/$n.csr"
  chmod 0600 "$d/$n.key"
}
make_certs() { # REGION: CA and server certificate (the node's address and names as SANs), root's client cert
  local r=$1 d ip; d=$(rdir "$r"); ip=$(node_ip "$r")
  [[ -n $ip ]] || die "no address of $(node_of "$r") on the kind network"
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -keyout "$d/ca.key" -out "$d/ca.crt" \
    -days 30 -sha256 -subj "/CN=aether-$r registry etcd CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null \
    || die "openssl: the CA of region $r failed"
  chmod 0600 "$d/ca.key"
  local sans="DNS:registry-etcd,DNS:registry-etcd.$NS,DNS:registry-etcd.$NS.svc,DNS:registry-etcd.$NS.svc.cluster.local"
  sans+=",DNS:registry-etcd-0.registry-etcd.$NS.svc,DNS:$(node_of "$r"),DNS:localhost,IP:$ip,IP:127.0.0.1"
  openssl_leaf "$d" server registry-etcd "$(printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=%s' "$sans")"
  openssl_leaf "$d" client-root root "$(printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth')"
  echo "$ip" >"$d/node-ip"
}
mirror_cert() { # REGION ORIGIN: the client certificate mirror-<origin> uses on REGION's etcd
  local d; d=$(rdir "$1")
  [[ -f $d/client-mirror-$2.crt ]] && return 0
  openssl_leaf "$d" "client-mirror-$2" "mirror-$2" "$(printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth')"
  [[ -f $d/mirror-$2.password ]] || { openssl rand -hex 16 >"$d/mirror-$2.password"; chmod 0600 "$d/mirror-$2.password"; }
}

# --- One region's cluster and etcd ----------------------------------------------------------------
create_cluster() { # REGION
  local r=$1 cfg start log
  cfg=$work/kind-$r.yaml log=$work/kind-create-$r.log
  kind_config "$cfg"
  start=$SECONDS
  say "aether-$r: kind create cluster (log $log)"
  if ! timeout 600 "$bin_dir/kind" create cluster --name "aether-$r" --image "$node_image" --config "$cfg" \
      --kubeconfig "$kubeconfig" --retain >"$log" 2>&1; then
    cat "$log" >&2
    fail "kind create cluster --name aether-$r (log $log)"
  fi
  say "ok: aether-$r: kind create cluster after $((SECONDS - start)) s"
}

node_ready() { [[ $(k "$1" get node "$(node_of "$1")" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]; }
coredns_ready() {
  local want got
  want=$(k "$1" -n kube-system get deploy coredns -o jsonpath='{.spec.replicas}')
  got=$(k "$1" -n kube-system get deploy coredns -o jsonpath='{.status.readyReplicas}')
  [[ -n $want && $got == "$want" ]]
}
etcd_ready() { [[ $(k "$1" -n "$NS" get pod registry-etcd-0 -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]; }
etcd_answers() { ectl "$1" root endpoint health; }

deploy_etcd() { # REGION
  local r=$1 d ip; d=$(rdir "$r"); ip=$(node_ip "$r")
  k "$r" create namespace "$NS" --dry-run=client -o yaml | k "$r" apply -f - >/dev/null || fail "namespace $NS in aether-$r"
  k "$r" -n "$NS" create secret generic registry-etcd-server --from-file=ca.crt="$d/ca.crt" \
    --from-file=tls.crt="$d/server.crt" --from-file=tls.key="$d/server.key" --dry-run=client -o yaml \
    | k "$r" apply -f - >/dev/null || fail "Secret registry-etcd-server in aether-$r"
  # The data directory on the node, owned by the user etcd runs as (a hostPath keeps the data, and
  # so the users, when the pod goes away).
  docker exec "$(node_of "$r")" sh -c 'mkdir -p /var/lib/aether-registry-etcd && chown 65532:65532 /var/lib/aether-registry-etcd && chmod 0700 /var/lib/aether-registry-etcd' \
    || fail "preparing /var/lib/aether-registry-etcd on $(node_of "$r")"
  # --initial-cluster-token per region: with one name and one peer URL everywhere, etcd would
  # derive the same member and cluster ids in every region, and the operator (which tells etcd
  # clusters apart by cluster id) would refuse each peer as the region's own etcd (PeerIsOrigin).
  k "$r" -n "$NS" apply -f - >/dev/null <<YAML || fail "applying the registry etcd in aether-$r"
apiVersion: v1
kind: Service
metadata: {name: registry-etcd, labels: {app: registry-etcd}}
spec:
  type: NodePort
  selector: {app: registry-etcd}
  ports: [{name: client, port: 2379, targetPort: 2379, nodePort: $NODEPORT}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: registry-etcd, labels: {app: registry-etcd}}
spec:
  serviceName: registry-etcd
  replicas: 1
  selector: {matchLabels: {app: registry-etcd}}
  template:
    metadata: {labels: {app: registry-etcd}}
    spec:
      terminationGracePeriodSeconds: 10
      securityContext: {runAsUser: 65532, runAsGroup: 65532, fsGroup: 65532, runAsNonRoot: true}
      containers:
      - name: etcd
        image: $etcd_image
        imagePullPolicy: Never
        command: [/usr/local/bin/etcd]
        args:
        - --name=registry-etcd-0
        - --data-dir=/var/lib/etcd/data
        - --listen-client-urls=https://0.0.0.0:2379
        - --advertise-client-urls=https://registry-etcd.$NS.svc:2379,https://$ip:$NODEPORT
        - --listen-peer-urls=http://127.0.0.1:2380
        - --initial-advertise-peer-urls=http://127.0.0.1:2380
        - --initial-cluster=registry-etcd-0=http://127.0.0.1:2380
        - --initial-cluster-token=aether-registry-$r
        - --listen-metrics-urls=http://0.0.0.0:2381
        - --cert-file=/etc/etcd/tls/tls.crt
        - --key-file=/etc/etcd/tls/tls.key
        - --trusted-ca-file=/etc/etcd/tls/ca.crt
        - --client-cert-auth
        - --auto-compaction-retention=1h
        ports: [{name: client, containerPort: 2379}, {name: metrics, containerPort: 2381}]
        readinessProbe: {httpGet: {path: /readyz, port: 2381}, periodSeconds: 2, failureThreshold: 3}
        livenessProbe: {httpGet: {path: /livez, port: 2381}, periodSeconds: 10, failureThreshold: 6}
        securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
        volumeMounts:
        - {name: tls, mountPath: /etc/etcd/tls, readOnly: true}
        - {name: data, mountPath: /var/lib/etcd}
      volumes:
      - name: tls
        secret: {secretName: registry-etcd-server, defaultMode: 0440}
      - name: data
        hostPath: {path: /var/lib/aether-registry-etcd, type: Directory}
YAML
}

# Root and auth on region R's etcd (once; the data outlives the pod).
etcd_auth() { # REGION
  local r=$1 d; d=$(rdir "$r")
  if ectl "$r" root auth status 2>/dev/null | grep -q 'Authentication Status: true'; then return 0; fi
  [[ -f $d/root.password ]] || { openssl rand -hex 16 >"$d/root.password"; chmod 0600 "$d/root.password"; }
  ectl "$r" root user get root >/dev/null 2>&1 \
    || ectl "$r" root user add root --new-user-password="$(cat "$d/root.password")" >/dev/null \
    || fail "etcdctl user add root on aether-$r"
  ectl "$r" root user grant-role root root >/dev/null || fail "etcdctl user grant-role root root on aether-$r"
  ectl "$r" root auth enable >/dev/null || fail "etcdctl auth enable on aether-$r"
  say "aether-$r: etcd auth enabled (root: client certificate CN=root, or password in $d/root.password)"
}

# The least-privilege user mirror-<origin> on region R's etcd, through hack/etcd-mirror-role.sh.
mirror_user() { # REGION ORIGIN
  local r=$1 o=$2 d; d=$(rdir "$r")
  mirror_cert "$r" "$o"
  ectl "$r" root user get "mirror-$o" >/dev/null 2>&1 && return 0
  local tmpbin; tmpbin=$(mktemp -d /tmp/aether-etcdctl.XXXXXX)
  ln -s "$etcdctl_bin" "$tmpbin/etcdctl"
  PATH=$tmpbin:$PATH MIRROR_PASSWORD=$(cat "$d/mirror-$o.password") "$hack_dir/etcd-mirror-role.sh" "$o" \
    "https://$(node_ip "$r"):$NODEPORT" --cacert "$d/ca.crt" --cert "$d/client-root.crt" --key "$d/client-root.key" \
    >"$d/mirror-role-$o.log" 2>&1 || { rm -rf "$tmpbin"; cat "$d/mirror-role-$o.log" >&2; fail "hack/etcd-mirror-role.sh $o on aether-$r"; }
  rm -rf "$tmpbin"
  say "aether-$r: etcd user mirror-$o (read-write on /aether/v1/regions/$o/ and /aether/v1/federation/$o/ only)"
}

# Least privilege, checked from this host: mirror-<origin> writes its own subtree on R, not R's.
check_mirror_user() { # REGION ORIGIN
  local r=$1 o=$2 d out; d=$(rdir "$r")
  local pw; pw=$(cat "$d/mirror-$o.password")
  ectl "$r" "mirror-$o" --user "mirror-$o:$pw" put "/aether/v1/federation/$o/kind-probe" x >/dev/null \
    || fail "mirror-$o (password) cannot write /aether/v1/federation/$o/ on aether-$r"
  ectl "$r" "mirror-$o" del "/aether/v1/federation/$o/kind-probe" >/dev/null \
    || fail "mirror-$o (client certificate) cannot delete in /aether/v1/federation/$o/ on aether-$r"
  if out=$(ectl "$r" "mirror-$o" put "/aether/v1/regions/$r/kind-probe" x 2>&1); then
    ectl "$r" root del "/aether/v1/regions/$r/kind-probe" >/dev/null 2>&1 || true
    fail "mirror-$o could write into /aether/v1/regions/$r/ on aether-$r: not least privilege"
  fi
  grep -q 'permission denied' <<<"$out" || fail "mirror-$o writing /aether/v1/regions/$r/ on aether-$r: expected 'permission denied', saw: $out"
}

secret_of() { # CLUSTER NAME CA CERT KEY [USER PASSWORD_FILE]
  local c=$1 n=$2 args=(--from-file=ca.crt="$3" --from-file=tls.crt="$4" --from-file=tls.key="$5")
  # The password file ends in a newline (openssl rand); the Secret must hold the password alone:
  # the operator sends the key's bytes verbatim, and etcd refuses "<password>\n".
  local pw=$work/.secret-password.$$
  if [[ -n ${6:-} ]]; then
    (umask 077 && tr -d '\n' <"$7" >"$pw")
    args+=(--from-literal=username="$6" --from-file=password="$pw")
  fi
  k "$c" -n "$NS" create secret generic "$n" "${args[@]}" --dry-run=client -o yaml \
    | k "$c" -n "$NS" label --local -f - app.kubernetes.io/part-of=aether-kind-federation -o yaml \
    | k "$c" apply -f - >/dev/null || { rm -f "$pw"; fail "Secret $n in aether-$c"; }
  rm -f "$pw"
}

# From a pod in cluster R, with the Secret the operator would read, over the kind network to
# PEER's NodePort: a read of R's subtree on the peer, as mirror-R (client certificate).
probe_pod() { # REGION PEER
  local r=$1 p=$2 name="probe-$1-to-$2"
  k "$r" -n "$NS" delete pod "$name" --ignore-not-found --wait=true >/dev/null 2>&1 || true
  k "$r" -n "$NS" apply -f - >/dev/null <<YAML || fail "the probe pod $name"
apiVersion: v1
kind: Pod
metadata: {name: $name, labels: {app.kubernetes.io/part-of: aether-kind-federation}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  securityContext: {runAsUser: 65532, runAsGroup: 65532, fsGroup: 65532, runAsNonRoot: true}
  containers:
  - name: etcdctl
    image: $etcd_image
    imagePullPolicy: Never
    command: [/usr/local/bin/etcdctl]
    args: [--endpoints=https://$(node_ip "$p"):$NODEPORT, --cacert=/creds/ca.crt, --cert=/creds/tls.crt, --key=/creds/tls.key,
      --dial-timeout=5s, --command-timeout=10s, get, --prefix, --keys-only, --limit=1, /aether/v1/regions/$r/]
    volumeMounts: [{name: creds, mountPath: /creds, readOnly: true}]
  volumes:
  - name: creds
    secret: {secretName: registry-etcd-peer-$p, defaultMode: 0440}
YAML
}
probe_done() { [[ $(k "$1" -n "$NS" get pod "probe-$1-to-$2" -o jsonpath='{.status.phase}') == Succeeded ]]; }
probe_failed() { [[ $(k "$1" -n "$NS" get pod "probe-$1-to-$2" -o jsonpath='{.status.phase}') == Failed ]]; }
probe_wait() {
  local r=$1 p=$2 start=$SECONDS
  until probe_done "$r" "$p"; do
    if probe_failed "$r" "$p"; then
      echo "federation: the probe pod's output:" >&2; k "$r" -n "$NS" logs "probe-$r-to-$p" >&2 || true
      fail "a pod in aether-$r could not read its subtree on aether-$p's etcd with Secret registry-etcd-peer-$p"
    fi
    ((SECONDS - start < 120)) || fail "probe pod probe-$r-to-$p: not Succeeded within 120 s"
    sleep 2
  done
  say "ok: a pod in aether-$r reads /aether/v1/regions/$r/ on aether-$p's etcd ($(node_ip "$p"):$NODEPORT) as mirror-$r after $((SECONDS - start)) s"
  k "$r" -n "$NS" delete pod "probe-$r-to-$p" --wait=false >/dev/null 2>&1 || true
}

print_region() { # REGION ALL_REGIONS...
  local r=$1 p peers=() secrets=(); shift
  for p in "$@"; do
    [[ $p == "$r" ]] && continue
    peers+=("$p=https://$(node_ip "$p"):$NODEPORT")
    secrets+=("--set regionPeering.peerTlsSecrets.$p=registry-etcd-peer-$p")
  done
  echo "region $r: cluster aether-$r (context kind-aether-$r), node $(node_of "$r") $(node_ip "$r")"
  echo "  peers reach its etcd at: https://$(node_ip "$r"):$NODEPORT or https://$(node_of "$r"):$NODEPORT (docker's DNS on the kind network; pods resolve it too)   (CA: $(rdir "$r")/ca.crt)"
  echo "  inside aether-$r:        https://registry-etcd.$NS.svc:2379"
  echo "  helm flags for aether-$r: --set regionPeering.enabled=true --set regionPeering.region=$r" \
    "--set 'regionPeering.localEtcd.endpoints={https://registry-etcd.$NS.svc:2379}'" \
    "--set regionPeering.localEtcd.tlsSecret=registry-etcd-local" \
    "--set 'regionPeering.peerEtcd={$(IFS=,; echo "${peers[*]}")}'" "${secrets[@]}"
}

# --- Commands -------------------------------------------------------------------------------------
case $cmd in
up)
  need_root "the kind federation"
  ((${#regions[@]})) || regions=(a b)
  command -v openssl >/dev/null || die "openssl is needed for the etcd certificates (apt-get install openssl)"
  mkdir -p "$work" && chmod 0700 "$work"
  [[ -f $started_file ]] || engine_was_down=1
  t0=$SECONDS
  node_image=$("$kind_dir/node-image.sh") || die "the node image is not available (hack/kind/node-image.sh failed)"
  engine_up
  # dockerd started by this `up` (through node-image.sh): `down` stops it again.
  [[ -n ${engine_was_down:-} && -f $started_file ]] && touch "$work/dockerd-started-by-federation"
  kind_install
  [[ -x $kubectl_bin ]] || die "kubectl $KUBE_VERSION is missing from $(dirname "$kubectl_bin") (hack/kind/node-image.sh builds it)"
  [[ -x $etcdctl_bin ]] || die "etcdctl is missing from $tools_dir/bin: run 'make tools'"
  imgs=$("$kind_dir/images.sh") || die "the e2e images are not available (hack/kind/images.sh failed)"
  etcd_image=$(sed -n 's/^REGISTRY_ETCD_IMAGE=//p' <<<"$imgs")
  kubectl_image=$(sed -n 's/^HOOK_KUBECTL_IMAGE=//p' <<<"$imgs")
  say "images ready after $((SECONDS - t0)) s: $node_image, $etcd_image, $kubectl_image"

  for r in "${regions[@]}"; do
    d=$(rdir "$r")
    # A region's state belongs to one cluster: a new node container means new certificates.
    if cluster_exists "$r" && [[ -f $d/node-id && $(cat "$d/node-id") == "$(docker inspect -f '{{.Id}}' "$(node_of "$r")")" ]]; then
      say "aether-$r: exists, reusing it"
      continue
    fi
    if cluster_exists "$r"; then say "aether-$r: exists but was not made by this script's state in $d: deleting it"; fi
    "$bin_dir/kind" delete cluster --name "aether-$r" --kubeconfig "$kubeconfig" >/dev/null 2>&1 || true
    rm -rf "$d" && mkdir -p "$d"
    create_cluster "$r"
    docker inspect -f '{{.Id}}' "$(node_of "$r")" >"$d/node-id"
    touch "$d/new"
  done
  for r in "${regions[@]}"; do
    wait_for "aether-$r: node Ready" 180 node_ready "$r"
  done
  for r in "${regions[@]}"; do
    d=$(rdir "$r")
    # The images, into every cluster that lacks them (a reused cluster too: images.sh's tags change
    # with what went into them).
    missing=()
    for i in "$etcd_image" "$kubectl_image"; do
      docker exec "$(node_of "$r")" ctr -n k8s.io images ls -q "name==$i" | grep -qxF "$i" || missing+=("$i")
    done
    if ((${#missing[@]})); then
      start=$SECONDS
      "$bin_dir/kind" load docker-image "${missing[@]}" --name "aether-$r" >"$d/kind-load.log" 2>&1 \
        || { cat "$d/kind-load.log" >&2; fail "kind load docker-image ${missing[*]} into aether-$r"; }
      say "ok: aether-$r: kind load docker-image ${missing[*]} after $((SECONDS - start)) s"
    fi
    [[ -f $d/new ]] || continue
    wait_for "aether-$r: CoreDNS Ready" 180 coredns_ready "$r"
    make_certs "$r"
    deploy_etcd "$r"
    rm -f "$d/new"
  done
  for r in "${regions[@]}"; do
    wait_for "aether-$r: registry-etcd-0 Ready" 180 etcd_ready "$r"
    wait_for "aether-$r: etcd answers on $(node_ip "$r"):$NODEPORT over mTLS" 60 etcd_answers "$r"
    etcd_auth "$r"
  done
  # Every region's etcd is its own cluster (the operator compares cluster ids).
  declare -A cluster_of=()
  for r in "${regions[@]}"; do
    id=$(ectl "$r" root endpoint status -w fields 2>/dev/null | awk '/"ClusterID"/ {print $3}')
    [[ -n $id ]] || fail "aether-$r: etcdctl endpoint status shows no cluster id"
    [[ -z ${cluster_of[$id]:-} ]] || fail "aether-$r's etcd has the cluster id $id of aether-${cluster_of[$id]}'s: the operator would take one for the other (an etcd bootstrapped before --initial-cluster-token was set: federation.sh down, then up)"
    cluster_of[$id]=$r
  done
  # Users and Secrets for every ordered pair: on r's etcd a user mirror-<o> for every other region o;
  # in o's cluster the Secret registry-etcd-peer-<r> holding it.
  for r in "${regions[@]}"; do
    d=$(rdir "$r")
    secret_of "$r" registry-etcd-local "$d/ca.crt" "$d/client-root.crt" "$d/client-root.key"
    for o in "${regions[@]}"; do
      [[ $o == "$r" ]] && continue
      mirror_user "$r" "$o"
      check_mirror_user "$r" "$o"
      secret_of "$o" "registry-etcd-peer-$r" "$d/ca.crt" "$d/client-mirror-$o.crt" "$d/client-mirror-$o.key" \
        "mirror-$o" "$d/mirror-$o.password"
    done
  done
  say "ok: least privilege: every mirror-<origin> writes its own prefixes and is refused another region's"
  for r in "${regions[@]}"; do for p in "${regions[@]}"; do [[ $p == "$r" ]] || probe_pod "$r" "$p"; done; done
  for r in "${regions[@]}"; do for p in "${regions[@]}"; do [[ $p == "$r" ]] || probe_wait "$r" "$p"; done; done
  say "federation of ${regions[*]} up in $((SECONDS - t0)) s"
  echo "export KUBECONFIG=$kubeconfig"
  for r in "${regions[@]}"; do print_region "$r" "${regions[@]}"; done
  echo "uninstall hook image: $("$kind_dir/images.sh" --helm-set)"
  echo "one etcd member per region (single-member StatefulSet); the operator's local Secret uses etcd's root user"
  ;;
status)
  ((${#regions[@]})) || mapfile -t regions < <(known_regions)
  ((${#regions[@]})) || { say "no region set up (state: $work)"; "$kind_dir/engine.sh" status; exit 0; }
  PATH=$("$kind_dir/engine.sh" --print-bin):$PATH
  "$kind_dir/engine.sh" status
  up=()
  for r in "${regions[@]}"; do
    if ! /usr/bin/docker info >/dev/null 2>&1 || ! cluster_exists "$r"; then echo "region $r: no cluster aether-$r"; continue; fi
    up+=("$r")
  done
  for r in "${up[@]}"; do
    print_region "$r" "${up[@]}"
    echo "  etcd: $(k "$r" -n "$NS" get pod registry-etcd-0 -o jsonpath='{.status.phase} ready={.status.conditions[?(@.type=="Ready")].status}' 2>&1);" \
      "health: $(ectl "$r" root endpoint health 2>&1 | head -n 1)"
  done
  ;;
down)
  ((${#regions[@]})) || mapfile -t regions < <(known_regions)
  if /usr/bin/docker info >/dev/null 2>&1; then
    kind_install
    for r in "${regions[@]}"; do
      start=$SECONDS
      "$bin_dir/kind" delete cluster --name "aether-$r" --kubeconfig "$kubeconfig" >/dev/null 2>&1 || true
      /usr/bin/docker rm -f "$(node_of "$r")" >/dev/null 2>&1 || true
      say "aether-$r: deleted in $((SECONDS - start)) s"
    done
  fi
  for r in "${regions[@]}"; do rm -rf "$(rdir "$r")" "$work/kind-$r.yaml" "$work/kind-create-$r.log"; done
  [[ -n $(known_regions) ]] || rm -f "$kubeconfig"
  if [[ -f $work/dockerd-started-by-federation ]] && [[ -z $(known_regions) ]]; then
    if [[ -n $(/usr/bin/docker ps -q 2>/dev/null) ]]; then
      say "dockerd was started by 'up' but other containers run: leaving it (hack/kind/engine.sh stop stops it)"
    else
      "$kind_dir/engine.sh" stop
      rm -f "$work/dockerd-started-by-federation"
    fi
  fi
  ;;
*) die "usage: federation.sh up|down|status [regions...]" ;;
esac
