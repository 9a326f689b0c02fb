#!/usr/bin/env bash
# Builds a kind node image offline, from Debian's packages and Go modules only (no registry), and
# caches every piece by version under the tools cache, so that a second run takes seconds:
#
#   kind-kube-<kube>/        kubelet kubeadm kubectl kube-apiserver kube-controller-manager
#                            kube-scheduler kube-proxy, from k8s.io/kubernetes (hack/kind/kube)
#   kind-etcd-<etcd>/etcd    the control plane's etcd, at the version kubeadm expects (hack/kind/etcd)
#   coredns-<v>/coredns      go install github.com/coredns/coredns@<v>
#   kind-pause-<v>/pause     static C build of kubernetes' build/pause/linux/pause.c
#   kind-rootfs-<suite>-<key>/rootfs.tar   debootstrap --variant=minbase of Debian <suite>
#   kind-node-<kube>-<key>/image.tar       the node image (docker save), reloaded when docker lost it
#
# The node: systemd as PID 1, containerd/runc/CNI plugins from Debian (CRI with
# restrict_oom_score_adj = true: this VM refuses negative oom_score_adj), kind's base files from the
# kind module, /kind/version, a static bridge + host-local + portmap conflist (use it with
# `networking.disableDefaultCNI: true`: kindnetd is not buildable here), and the control plane,
# kube-proxy, CoreDNS, etcd and pause images preloaded into its containerd under the names
# `kubeadm config images list` gives. An entrypoint shim makes the cgroup mounts writable, since the
# node runs without a real --privileged (see engine.sh).
#
#   hack/kind/node-image.sh                build or reuse the image; print its name on stdout
#   hack/kind/node-image.sh --print-image  print the name it has (or would have), build nothing
#
# Needs: root, Go, Debian's apt (debootstrap, gcc, docker.io are installed when missing), the Go
# module proxy and Debian's mirror the first time. Logs of the long steps go to /tmp.
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

# Debian packages of the node (kind's base image list, minus what is only for storage drivers
# nobody here uses, plus containerd, runc and the CNI plugins, which kind builds itself).
NODE_PACKAGES=(systemd systemd-sysv conntrack iptables nftables iproute2 ethtool util-linux mount
  kmod libseccomp2 pigz bash ca-certificates jq procps containerd runc containernetworking-plugins)

key_of() { cat "$@" | sha256sum | cut -c1-12; }
node_key=$(key_of "$kind_dir/lib.sh" "$kind_dir/node-image.sh" "$kind_dir/kube/go.mod" "$kind_dir/kube/go.sum" \
  "$kind_dir/etcd/go.mod" "$kind_dir/etcd/go.sum")
IMAGE=aether.local/kind-node:$KUBE_VERSION-$node_key
if [[ ${1:-} == --print-image ]]; then echo "$IMAGE"; exit 0; fi

need_root "building the kind node image"
need_go
command -v flock >/dev/null || die "flock (util-linux) is needed"
engine_up
kind_install

node_cache=$tools_dir/kind-node-$KUBE_VERSION-$node_key
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  say "node image $IMAGE: present in docker"
  echo "$IMAGE"; exit 0
fi
if [[ -f $node_cache/image.tar ]]; then
  say "node image $IMAGE: loading the cached $node_cache/image.tar"
  docker load -i "$node_cache/image.tar" >/dev/null || die "docker load of $node_cache/image.tar failed"
  echo "$IMAGE"; exit 0
fi

total_start=$SECONDS
apt_need debootstrap gcc libc6-dev containerd

# --- The Debian root filesystem ---------------------------------------------------------------------
rootfs_key=$(printf '%s\n' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "${NODE_PACKAGES[@]}" | sha256sum | cut -c1-12)
rootfs_dir=$tools_dir/kind-rootfs-$DEBIAN_SUITE-$rootfs_key
build_rootfs() {
  [[ -f $rootfs_dir/rootfs.tar ]] && { say "rootfs $DEBIAN_SUITE: cached in $rootfs_dir"; return 0; }
  local start=$SECONDS log=$log_dir/aether-kind-debootstrap.log tmp=$rootfs_dir.tmp
  say "rootfs $DEBIAN_SUITE: debootstrap --variant=minbase from $DEBIAN_MIRROR (log $log)"
  rm -rf "$tmp" && mkdir -p "$tmp/root"
  heavy debootstrap --variant=minbase --include="$(IFS=,; echo "${NODE_PACKAGES[*]}")" \
    "$DEBIAN_SUITE" "$tmp/root" "$DEBIAN_MIRROR" >"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; die "debootstrap of $DEBIAN_SUITE from $DEBIAN_MIRROR failed (log $log)"; }
  rm -rf "$tmp/root/var/lib/apt/lists/"* "$tmp/root/var/cache/apt/"*.bin "$tmp/root/var/cache/apt/archives/"*.deb
  heavy tar -C "$tmp/root" --numeric-owner -cf "$tmp/rootfs.tar" .
  rm -rf "$tmp/root"
  rm -rf "$rootfs_dir" && mv "$tmp" "$rootfs_dir"
  say "rootfs $DEBIAN_SUITE: built in $((SECONDS - start)) s"
}
with_lock "$rootfs_dir.lock" build_rootfs

# --- Binaries -----------------------------------------------------------------------------------
etcd_dir=$tools_dir/kind-etcd-$ETCD_VERSION
build_etcd() {
  [[ -x $etcd_dir/etcd ]] && { say "etcd $ETCD_VERSION: cached in $etcd_dir"; return 0; }
  local start=$SECONDS log=$log_dir/aether-kind-etcd-build.log
  say "etcd $ETCD_VERSION: building (log $log)"
  mkdir -p "$etcd_dir.tmp"
  (cd "$kind_dir/etcd" && CGO_ENABLED=0 heavy go build -trimpath -o "$etcd_dir.tmp/etcd" go.etcd.io/etcd/server/v3) >"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; die "building etcd $ETCD_VERSION failed (log $log)"; }
  mkdir -p "$etcd_dir" && mv "$etcd_dir.tmp/etcd" "$etcd_dir/etcd" && rm -rf "$etcd_dir.tmp"
  say "etcd $ETCD_VERSION: built in $((SECONDS - start)) s"
}
with_lock "$etcd_dir.lock" build_etcd

coredns_dir=$tools_dir/coredns-$COREDNS_VERSION
build_coredns() {
  [[ -x $coredns_dir/coredns ]] && { say "coredns $COREDNS_VERSION: cached in $coredns_dir"; return 0; }
  local start=$SECONDS log=$log_dir/aether-kind-coredns-build.log
  say "coredns $COREDNS_VERSION: go install github.com/coredns/coredns@$COREDNS_VERSION (log $log)"
  rm -rf "$coredns_dir.tmp"
  (cd /tmp && GOBIN=$coredns_dir.tmp CGO_ENABLED=0 heavy go install -trimpath "github.com/coredns/coredns@$COREDNS_VERSION") >"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; die "building coredns $COREDNS_VERSION failed (log $log)"; }
  rm -rf "$coredns_dir" && mv "$coredns_dir.tmp" "$coredns_dir"
  say "coredns $COREDNS_VERSION: built in $((SECONDS - start)) s"
}
with_lock "$coredns_dir.lock" build_coredns

pause_dir=$tools_dir/kind-pause-$PAUSE_VERSION
build_pause() {
  [[ -x $pause_dir/pause ]] && { say "pause $PAUSE_VERSION: cached in $pause_dir"; return 0; }
  local src
  src=$(cd / && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')/build/pause/linux/pause.c
  [[ -f $src ]] || die "pause's source is missing: $src (k8s.io/kubernetes@$KUBE_VERSION in the module cache)"
  grep -q "^TAG ?= $PAUSE_VERSION\$" "$(dirname "$src")/../Makefile" \
    || die "k8s.io/kubernetes@$KUBE_VERSION's build/pause is not pause $PAUSE_VERSION: update PAUSE_VERSION in hack/kind/lib.sh"
  mkdir -p "$pause_dir.tmp"
  heavy gcc -Os -Wall -Werror -static -DVERSION="v$PAUSE_VERSION-aether" -o "$pause_dir.tmp/pause" "$src" \
    || die "gcc -static of $src failed (needs gcc and libc6-dev)"
  mkdir -p "$pause_dir" && mv "$pause_dir.tmp/pause" "$pause_dir/pause" && rm -rf "$pause_dir.tmp"
  say "pause $PAUSE_VERSION: built"
}
with_lock "$pause_dir.lock" build_pause

# The Kubernetes binaries last: the longest build, and the one that reuses most of what
# hack/tools.sh's kube-apiserver build left in Go's build cache.
KUBE_BINS=(kubelet kubeadm kubectl kube-apiserver kube-controller-manager kube-scheduler kube-proxy)
kube_dir=$tools_dir/kind-kube-$KUBE_VERSION
build_kube() {
  local minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
  # Stamped as a release build is (kubeadm checks the kubelet's version and picks image tags by its
  # own), and stripped as a release build is (-s -w): a third smaller, and only the link differs
  # from hack/tools.sh's build, so Go's build cache serves both.
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  [[ -f $kube_dir/.ldflags && $(cat "$kube_dir/.ldflags") == "$ld" ]] || rm -rf "$kube_dir"
  local b missing=()
  for b in "${KUBE_BINS[@]}"; do [[ -x $kube_dir/$b ]] || missing+=("$b"); done
  ((${#missing[@]})) || { say "kubernetes $KUBE_VERSION: cached in $kube_dir"; return 0; }
  local pkgs=() start=$SECONDS log=$log_dir/aether-kind-kube-build.log
  for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  say "kubernetes $KUBE_VERSION: building ${missing[*]} (cold: 10-40 minutes on 2 busy cores; log $log)"
  mkdir -p "$kube_dir.tmp"
  (cd "$kind_dir/kube" && CGO_ENABLED=0 heavy go build -trimpath -ldflags "$ld" -o "$kube_dir.tmp/" "${pkgs[@]}") >"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; die "building ${missing[*]} from k8s.io/kubernetes@$KUBE_VERSION failed (log $log)"; }
  mkdir -p "$kube_dir"
  for b in "${missing[@]}"; do mv "$kube_dir.tmp/$b" "$kube_dir/$b"; done
  printf '%s' "$ld" >"$kube_dir/.ldflags"
  rm -rf "$kube_dir.tmp"
  say "kubernetes $KUBE_VERSION: built in $((SECONDS - start)) s"
}
with_lock "$kube_dir.lock" build_kube

# --- What kubeadm expects -------------------------------------------------------------------------
got=$("$kube_dir/kubeadm" version -o short) || die "$kube_dir/kubeadm does not run"
[[ $got == "$KUBE_VERSION" ]] || die "kubeadm says it is $got, not $KUBE_VERSION: remove $kube_dir and re-run"
mapfile -t expected < <("$kube_dir/kubeadm" config images list --kubernetes-version "$KUBE_VERSION" 2>/dev/null)
((${#expected[@]})) || die "kubeadm config images list --kubernetes-version $KUBE_VERSION printed nothing"
declare -A image_of=(
  [registry.k8s.io/kube-apiserver:$KUBE_VERSION]=kube-apiserver
  [registry.k8s.io/kube-controller-manager:$KUBE_VERSION]=kube-controller-manager
  [registry.k8s.io/kube-scheduler:$KUBE_VERSION]=kube-scheduler
  [registry.k8s.io/kube-proxy:$KUBE_VERSION]=kube-proxy
  [registry.k8s.io/coredns/coredns:$COREDNS_VERSION]=coredns
  [registry.k8s.io/pause:$PAUSE_VERSION]=pause
  [registry.k8s.io/etcd:${ETCD_VERSION#v}-0]=etcd
)
for ref in "${expected[@]}"; do
  [[ -n ${image_of[$ref]:-} ]] || die "kubeadm $KUBE_VERSION expects image $ref, which this script does not build (versions in hack/kind/lib.sh: etcd $ETCD_VERSION, coredns $COREDNS_VERSION, pause $PAUSE_VERSION)"
done
((${#expected[@]} == ${#image_of[@]})) || die "kubeadm $KUBE_VERSION expects ${expected[*]}; this script builds ${!image_of[*]}"

# --- Assembly -------------------------------------------------------------------------------------
build_node() {
  docker image inspect "$IMAGE" >/dev/null 2>&1 && return 0
  local start=$SECONDS work=$node_cache.tmp kind_files
  kind_files=$(cd / && go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')/images/base/files
  [[ -d $kind_files ]] || die "kind's base files are missing: $kind_files (go mod download sigs.k8s.io/kind@$KIND_VERSION)"
  rm -rf "$work" && mkdir -p "$work"
  local root=$work/root images=$work/images
  mkdir -p "$root" "$images"
  say "node image: assembling in $work"

  # The component images, as docker sees them, then one archive for the node's containerd.
  local base=$work/static-base
  mkdir -p "$base/etc" "$base/tmp" "$base/usr/local/bin" && chmod 1777 "$base/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$base/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$base/etc/group"
  printf 'hosts: files dns\n' >"$base/etc/nsswitch.conf"
  static_image() { # REF BINARY PATH_IN_IMAGE
    local d=$work/img-${1//[\/:]/_}
    cp -a "$base" "$d" && mkdir -p "$d$(dirname "$3")" && cp "$2" "$d$3"
    tar -C "$d" --numeric-owner --owner=0 --group=0 -c . \
      | docker import --change "ENTRYPOINT [\"$3\"]" - "$1" >/dev/null || die "docker import of $1 failed"
    rm -rf "$d"
  }
  local ref refs=()
  for ref in "${expected[@]}"; do
    case ${image_of[$ref]} in
    kube-apiserver|kube-controller-manager|kube-scheduler) static_image "$ref" "$kube_dir/${image_of[$ref]}" "/usr/local/bin/${image_of[$ref]}" ;;
    etcd) static_image "$ref" "$etcd_dir/etcd" /usr/local/bin/etcd ;;
    coredns) static_image "$ref" "$coredns_dir/coredns" /coredns ;;
    pause) static_image "$ref" "$pause_dir/pause" /pause ;;
    kube-proxy) # needs iptables, conntrack and a shell: the Debian root filesystem (without the
      # node's container runtime, CNI plugins and documentation) plus the binary
      cp "$rootfs_dir/rootfs.tar" "$work/kube-proxy.tar"
      tar --delete --wildcards -f "$work/kube-proxy.tar" './usr/bin/containerd*' ./usr/bin/ctr ./usr/sbin/runc \
        './usr/lib/cni/*' './usr/share/locale/*' './usr/share/doc/*' './usr/share/man/*' \
        || die "trimming the kube-proxy image's root filesystem failed"
      mkdir -p "$work/kp/usr/local/bin" && cp "$kube_dir/kube-proxy" "$work/kp/usr/local/bin/"
      tar -C "$work/kp" --numeric-owner --owner=0 --group=0 -rf "$work/kube-proxy.tar" ./usr/local/bin/kube-proxy
      docker import --change 'ENTRYPOINT ["/usr/local/bin/kube-proxy"]' "$work/kube-proxy.tar" "$ref" >/dev/null \
        || die "docker import of $ref failed"
      rm -rf "$work/kp" "$work/kube-proxy.tar" ;;
    esac
    refs+=("$ref")
  done
  docker save "${refs[@]}" >"$images/images.tar" || die "docker save of the component images failed"
  docker rmi "${refs[@]}" >/dev/null

  # The root filesystem: Debian, then kind's base files as kind's base Dockerfile lays them out.
  tar -C "$root" --numeric-owner -xpf "$rootfs_dir/rootfs.tar"
  install -m 0755 "$kind_files"/usr/local/bin/* "$root/usr/local/bin/"
  mkdir -p "$root/kind" "$root/LICENSES" && cp -r "$kind_files/kind/." "$root/kind/"
  find "$root/kind" -type f -exec chmod 0644 {} + && chmod 0755 "$root/kind" "$root/kind/bin" "$root"/kind/bin/*
  cp "$kind_files"/LICENSES/* "$root/LICENSES/"
  (cd "$kind_files/etc" && find . -type f) | while read -r f; do install -D -m 0644 "$kind_files/etc/$f" "$root/etc/$f"; done
  # containerd, runc and the CNI plugins are Debian's: put them where kind's units look.
  ln -sf /usr/bin/containerd "$root/usr/local/bin/containerd"
  mkdir -p "$root/opt/cni/bin"
  for f in "$root"/usr/lib/cni/*; do ln -sf "/usr/lib/cni/${f##*/}" "$root/opt/cni/bin/${f##*/}"; done
  local cfg=$root/etc/containerd/config.toml
  sed -i -e "s#sandbox_image = \".*\"#sandbox_image = \"registry.k8s.io/pause:$PAUSE_VERSION\"#" \
    -e 's#restrict_oom_score_adj = false#restrict_oom_score_adj = true#' "$cfg"
  grep -q "sandbox_image = \"registry.k8s.io/pause:$PAUSE_VERSION\"" "$cfg" || die "kind's containerd config has no sandbox_image line to set"
  grep -q 'restrict_oom_score_adj = true' "$cfg" || die "kind's containerd config has no restrict_oom_score_adj line to set"
  chroot "$root" sh -c "ctr oci spec | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {\"path\": \"/kind/bin/mount-product-files.sh\"}' | jq 'del(.process.rlimits)'" \
    >"$root/etc/containerd/cri-base.json" || die "ctr oci spec in the node's root failed"
  [[ -s $root/etc/containerd/cri-base.json ]] || die "ctr oci spec in the node's root printed nothing"
  # systemd as kind's base image sets it up.
  find "$root/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
  rm -f "$root"/lib/systemd/system/multi-user.target.wants/* "$root"/etc/systemd/system/*.wants/* \
    "$root"/lib/systemd/system/local-fs.target.wants/* "$root"/lib/systemd/system/sockets.target.wants/*udev* \
    "$root"/lib/systemd/system/sockets.target.wants/*initctl* "$root"/lib/systemd/system/basic.target.wants/*
  echo "ReadKMsg=no" >>"$root/etc/systemd/journald.conf"
  ln -sf /usr/lib/systemd/systemd "$root/sbin/init"
  chroot "$root" systemctl enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null 2>&1 \
    || die "systemctl enable in the node's root failed"
  chroot "$root" systemctl mask systemd-binfmt.service >/dev/null 2>&1
  mkdir -p "$root/etc/kubernetes/manifests"
  # Kubernetes.
  install -m 0755 "$kube_dir/kubelet" "$kube_dir/kubeadm" "$kube_dir/kubectl" "$root/usr/bin/"
  echo "$KUBE_VERSION" >"$root/kind/version"
  # Pod networking without kindnetd: one node, one bridge (the node's podCIDR is 10.244.0.0/24
  # with kind's default podSubnet).
  mkdir -p "$root/etc/cni/net.d"
  cat >"$root/etc/cni/net.d/10-aether-bridge.conflist" <<'JSON'
{
  "cniVersion": "0.4.0",
  "name": "aether-bridge",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  # The entrypoint shim: without a real --privileged, Docker mounts the cgroup hierarchies
  # read-only; kind's entrypoint and systemd need them writable.
  cat >"$root/usr/local/bin/aether-entrypoint" <<'SH'
#!/bin/bash
# Installed by hack/kind/node-image.sh: runs before kind's entrypoint.
findmnt -rn -o TARGET | grep '^/sys/fs/cgroup' | while read -r m; do
  mount -o remount,bind,rw "$m" 2>/dev/null || echo "aether-entrypoint: could not remount $m read-write" >&2
done
exec "$@"
SH
  chmod 0755 "$root/usr/local/bin/aether-entrypoint"

  # Preload: a containerd of its own on this host (same Debian version as the node's) writes the
  # images into the node's /var/lib/containerd, unpacked on first use as kind's own build does.
  local state=/run/aether-kind-build-$$ sock
  sock=$state/containerd.sock
  mkdir -p "$state"
  cat >"$state/config.toml" <<EOF
version = 2
root = "$root/var/lib/containerd"
state = "$state/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
EOF
  /usr/bin/containerd --config "$state/config.toml" >"$log_dir/aether-kind-preload-containerd.log" 2>&1 &
  local cpid=$!
  for _ in $(seq 1 40); do [[ -S $sock ]] && break; sleep 0.25; done
  [[ -S $sock ]] || { kill "$cpid" 2>/dev/null; die "the preload containerd did not start (log $log_dir/aether-kind-preload-containerd.log)"; }
  if ! ctr --address "$sock" --namespace k8s.io images import --label=io.cri-containerd.pinned=pinned \
      --all-platforms --no-unpack --digests "$images/images.tar" >"$log_dir/aether-kind-preload.log" 2>&1; then
    kill "$cpid"; wait "$cpid" || true
    die "ctr images import into the node's containerd failed (log $log_dir/aether-kind-preload.log)"
  fi
  local listed
  listed=$(ctr --address "$sock" --namespace k8s.io images ls -q)
  kill "$cpid"; wait "$cpid" || true
  rm -rf "$state"
  for ref in "${refs[@]}"; do grep -qxF "$ref" <<<"$listed" || die "image $ref is missing from the node's containerd after the import"; done
  rm -rf "$images"

  say "node image: importing into docker as $IMAGE"
  heavy tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENV container=docker' \
    --change 'ENTRYPOINT ["/usr/local/bin/aether-entrypoint", "/usr/local/bin/entrypoint", "/sbin/init"]' \
    - "$IMAGE-flat" >/dev/null || die "docker import of the node image failed"
  rm -rf "$root"
  # `docker import --change` takes no STOPSIGNAL: one metadata-only build step adds it (systemd
  # shuts down on SIGRTMIN+3), from the local image, with the classic builder (no registry).
  printf 'FROM %s\nSTOPSIGNAL SIGRTMIN+3\n' "$IMAGE-flat" | DOCKER_BUILDKIT=0 docker build -q -t "$IMAGE" - >/dev/null \
    || die "docker build of the node image's STOPSIGNAL step failed"
  docker rmi "$IMAGE-flat" >/dev/null
  docker save "$IMAGE" >"$work/image.tar" || die "docker save $IMAGE failed"
  rm -rf "$node_cache" && mv "$work" "$node_cache"
  # Images of earlier versions of these scripts are not used again: drop them (about 1 GB each).
  local old
  for old in "$tools_dir"/kind-node-*; do
    [[ $old == "$node_cache" || ! -d $old ]] || { say "removing the stale $old"; rm -rf "$old"; }
  done
  docker images --format '{{.Repository}}:{{.Tag}}' aether.local/kind-node | grep -vxF "$IMAGE" | xargs -r docker rmi >/dev/null 2>&1 || true
  say "node image $IMAGE: assembled in $((SECONDS - start)) s (cached in $node_cache/image.tar)"
}
with_lock "$node_cache.lock" build_node
say "node image ready in $((SECONDS - total_start)) s"
echo "$IMAGE"
