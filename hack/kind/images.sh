#!/usr/bin/env bash
# The e2e's own images, built here from the project's cached binaries (never pulled), each cached
# by version and a digest of what went in, and `docker save`d beside it so a lost docker store
# reloads in seconds:
#
#   aether.local/etcd:<etcd>-<key>      the registry etcd: etcd, etcdctl, etcdutl v3.6.16 from
#                                       hack/tools.sh's build (hack/tools/etcd), FROM a minimal root
#                                       (passwd/group, /tmp, /var/lib/etcd owned by 65532), no shell;
#                                       runs as 65532; TLS needs nothing more (Go's crypto/tls)
#   aether.local/kubectl:<kube>-<key>   the chart's uninstall hook (registry.k8s.io/kubectl in
#                                       values.yaml): hack/tools.sh's kubectl, entrypoint kubectl,
#                                       user 65532 (the hook's securityContext asks for it)
#
#   hack/kind/images.sh                  build or reuse both; print `NAME=ref` lines on stdout
#   hack/kind/images.sh --print          print the refs they have (or would have), build nothing
#   hack/kind/images.sh --helm-set       print the helm --set flags for the uninstall hook's image
#   hack/kind/images.sh load CLUSTER...  build/reuse, then `kind load docker-image` into each cluster
#
# Needs: root, the binaries of `make tools` (hack/tools.sh) in the tools cache, docker (started
# through engine.sh when absent). Nothing is downloaded.
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

REGISTRY_ETCD_VERSION=v3.6.16   # hack/tools.sh's ETCD_VERSION: the etcd the tests and the mirror run against
HOOK_KUBECTL_VERSION=v1.35.4    # hack/tools.sh's KUBE_VERSION and the chart's uninstallHook.image.tag

etcd_bin_dir=$tools_dir/etcd-$REGISTRY_ETCD_VERSION
etcdctl_bin_dir=$tools_dir/etcdctl-$REGISTRY_ETCD_VERSION
etcdutl_bin_dir=$tools_dir/etcdutl-$REGISTRY_ETCD_VERSION
kubectl_bin=$(ls -d "$tools_dir"/kubectl-"$HOOK_KUBECTL_VERSION"*/kubectl 2>/dev/null | head -n 1 || true)

# The key: the binaries' digests and this script's text (a changed layout builds anew).
bin_key() { sha256sum "$@" "${BASH_SOURCE[0]}" | cut -c1-64 | sha256sum | cut -c1-12; }
etcd_ref() {
  local b
  for b in "$etcd_bin_dir/etcd" "$etcdctl_bin_dir/etcdctl" "$etcdutl_bin_dir/etcdutl"; do
    [[ -x $b ]] || die "$b is missing: run 'make tools' (hack/tools.sh builds etcd $REGISTRY_ETCD_VERSION)"
  done
  echo "aether.local/etcd:$REGISTRY_ETCD_VERSION-$(bin_key "$etcd_bin_dir/etcd" "$etcdctl_bin_dir/etcdctl" "$etcdutl_bin_dir/etcdutl")"
}
kubectl_ref() {
  [[ -n $kubectl_bin && -x $kubectl_bin ]] || die "kubectl $HOOK_KUBECTL_VERSION is missing from $tools_dir/kubectl-$HOOK_KUBECTL_VERSION*: run 'make tools'"
  echo "aether.local/kubectl:$HOOK_KUBECTL_VERSION-$(bin_key "$kubectl_bin")"
}
helm_set() {
  local ref=$1
  echo "--set regionPeering.uninstallHook.image.repository=${ref%:*} --set regionPeering.uninstallHook.image.tag=${ref##*:} --set regionPeering.uninstallHook.image.pullPolicy=Never"
}

case ${1:-} in
--print) echo "REGISTRY_ETCD_IMAGE=$(etcd_ref)"; echo "HOOK_KUBECTL_IMAGE=$(kubectl_ref)"; exit 0 ;;
--helm-set) helm_set "$(kubectl_ref)"; exit 0 ;;
''|load) ;;
*) die "usage: images.sh [--print | --helm-set | load CLUSTER...]" ;;
esac

need_root "building the e2e images"
engine_up

# A minimal root: no shell, no package manager; the user the pods run as; a writable /tmp.
minimal_root() { # DIR
  local d=$1
  mkdir -p "$d/etc" "$d/tmp" "$d/usr/local/bin" && chmod 1777 "$d/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$d/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$d/etc/group"
  printf 'hosts: files dns\n' >"$d/etc/nsswitch.conf"
}
# Copies a static binary into the root, stripped when binutils' strip is there (a third smaller).
put_bin() { # SRC DEST
  file -L "$1" 2>/dev/null | grep -q 'statically linked' || die "$1 is not a static binary (the image has no libc)"
  if command -v strip >/dev/null; then strip -o "$2" "$1" 2>/dev/null || cp "$1" "$2"; else cp "$1" "$2"; fi
  chmod 0755 "$2"
}

# build_image REF BUILDER: docker import of the root BUILDER lays out (and IMPORT_CHANGES), cached.
build_image() {
  local ref=$1 builder=$2 name=${1#aether.local/}
  local cache=$tools_dir/kind-img-${name//:/-}
  if docker image inspect "$ref" >/dev/null 2>&1; then
    [[ -f $cache/image.tar ]] || { mkdir -p "$cache.tmp" && docker save "$ref" >"$cache.tmp/image.tar" && rm -rf "$cache" && mv "$cache.tmp" "$cache"; } \
      || die "docker save $ref failed"
    return 0
  fi
  if [[ -f $cache/image.tar ]]; then
    docker load -i "$cache/image.tar" >/dev/null || die "docker load of $cache/image.tar failed"
    return 0
  fi
  local start=$SECONDS work
  work=$(mktemp -d "/tmp/aether-img.XXXXXX")
  minimal_root "$work/root"
  "$builder" "$work/root"
  local changes=()
  for c in "${IMPORT_CHANGES[@]}"; do changes+=(--change "$c"); done
  tar -C "$work/root" --numeric-owner --owner=0 --group=0 -c . | docker import "${changes[@]}" - "$ref" >/dev/null \
    || { rm -rf "$work"; die "docker import of $ref failed"; }
  rm -rf "$work"
  mkdir -p "$cache.tmp" && docker save "$ref" >"$cache.tmp/image.tar" || die "docker save $ref failed"
  rm -rf "$cache" && mv "$cache.tmp" "$cache"
  # Earlier keys of the same image are not used again.
  local old
  for old in "$tools_dir"/kind-img-"${name%%:*}"-*; do [[ $old == "$cache" || ! -d $old ]] || rm -rf "$old"; done
  say "$ref: built in $((SECONDS - start)) s ($(du -h "$cache/image.tar" | cut -f1), cached in $cache)"
}

etcd_root() {
  put_bin "$etcd_bin_dir/etcd" "$1/usr/local/bin/etcd"
  put_bin "$etcdctl_bin_dir/etcdctl" "$1/usr/local/bin/etcdctl"
  put_bin "$etcdutl_bin_dir/etcdutl" "$1/usr/local/bin/etcdutl"
  mkdir -p "$1/var/lib/etcd" && chown 65532:65532 "$1/var/lib/etcd" && chmod 0700 "$1/var/lib/etcd"
}
kubectl_root() { put_bin "$kubectl_bin" "$1/usr/local/bin/kubectl"; }

ETCD_IMAGE=$(etcd_ref)
KUBECTL_IMAGE=$(kubectl_ref)
IMPORT_CHANGES=('ENTRYPOINT ["/usr/local/bin/etcd"]' 'USER 65532:65532' 'ENV PATH=/usr/local/bin' 'EXPOSE 2379 2380' 'WORKDIR /var/lib/etcd')
with_lock "kind-img-etcd" build_image "$ETCD_IMAGE" etcd_root
IMPORT_CHANGES=('ENTRYPOINT ["/usr/local/bin/kubectl"]' 'USER 65532:65532' 'ENV PATH=/usr/local/bin' 'ENV HOME=/tmp')
with_lock "kind-img-kubectl" build_image "$KUBECTL_IMAGE" kubectl_root

# Check them: the binaries run in the image and say their versions.
got=$(docker run --rm --network none "$ETCD_IMAGE" --version 2>&1 | sed -n 's/^etcd Version: //p')
[[ v$got == "$REGISTRY_ETCD_VERSION" ]] || die "$ETCD_IMAGE: etcd --version says '$got', expected $REGISTRY_ETCD_VERSION"
got=$(docker run --rm --network none "$KUBECTL_IMAGE" version --client -o json 2>/dev/null | sed -n 's/.*"gitVersion": "\(.*\)".*/\1/p' | head -n 1)
[[ $got == "$HOOK_KUBECTL_VERSION" ]] || die "$KUBECTL_IMAGE: kubectl version --client says '$got', expected $HOOK_KUBECTL_VERSION"

if [[ ${1:-} == load ]]; then
  shift
  kind_install
  for c in "$@"; do
    start=$SECONDS
    "$bin_dir/kind" load docker-image "$ETCD_IMAGE" "$KUBECTL_IMAGE" --name "$c" >"$log_dir/aether-kind-$c-load-images.log" 2>&1 \
      || { cat "$log_dir/aether-kind-$c-load-images.log" >&2; die "kind load docker-image into $c failed"; }
    say "loaded $ETCD_IMAGE and $KUBECTL_IMAGE into $c in $((SECONDS - start)) s"
  done
fi
say "uninstall hook image for helm: $(helm_set "$KUBECTL_IMAGE")"
echo "REGISTRY_ETCD_IMAGE=$ETCD_IMAGE"
echo "HOOK_KUBECTL_IMAGE=$KUBECTL_IMAGE"
