#!/usr/bin/env bash
# Installs the real parts the tests, the demo and the benchmarks run against, into a cache outside
# the checkout, keyed by version, so a fresh clone reuses what an earlier one built.
#
#   hack/tools.sh            build or reuse everything, print where it is
#   hack/tools.sh --print-bin  print the directory holding the binaries
#
# Everything lands in $AETHER_TOOLS_DIR (default ~/.cache/aether-federation/tools)/<name>-<version>/
# and is linked into $AETHER_TOOLS_DIR/bin, which the tests find through AETHER_TOOLS_BIN or that
# default path.
set -euo pipefail

KUBE_VERSION=v1.35.4      # kube-apiserver and kubectl; keep in step with hack/tools/kube/go.mod
ETCD_VERSION=v3.6.16      # the default etcd for tests; keep in step with hack/tools/etcd/go.mod
HELM_VERSION=v3.19.0
KUBECONFORM_VERSION=v0.7.0
PROMETHEUS_VERSION=v0.316.0  # promtool, for the alert rules' checks and unit tests
GOPHER_LUA_VERSION=v1.1.2    # Argo CD's Lua interpreter; keep in step with hack/tools/lua-health/go.mod
# `make image`: Zig (from PyPI's ziglang) as the C compiler and linker of the static musl builds
# for linux/amd64 and linux/arm64, driven by cargo-zigbuild (crates.io); crane (the Go module) to
# push the image from its OCI tarball.
ZIG_VERSION=0.14.1
CARGO_ZIGBUILD_VERSION=0.20.1
CRANE_VERSION=v0.22.1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tools_dir=${AETHER_TOOLS_DIR:-$HOME/.cache/aether-federation/tools}
bin_dir=$tools_dir/bin

if [[ "${1:-}" == "--print-bin" ]]; then
  echo "$bin_dir"
  exit 0
fi

die() { echo "tools: $*" >&2; exit 1; }
say() { echo "tools: $*"; }

# Look tools up outside the cache's own bin directory (make puts it first on PATH): linking
# protoc to itself would make a loop.
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$bin_dir" | paste -sd: -)
export PATH

command -v go >/dev/null || die "Go is needed to build kube-apiserver, etcd, helm, kubeconform and promtool; install Go 1.26.7+ (https://go.dev/doc/install)"
mkdir -p "$bin_dir"

# build NAME VERSION MODULE_DIR PACKAGE OUTPUT [LDFLAGS]: go build PACKAGE from a wrapper module
# into the cache (LDFLAGS, when given, are part of the cache key).
build_from_module() {
  local name=$1 version=$2 moddir=$3 pkg=$4 out=$5 ldflags=${6:-}
  local dest=$tools_dir/$name-$version
  [[ -z $ldflags ]] || dest=$dest-$(printf '%s' "$ldflags" | sha256sum | cut -c1-8)
  if [[ -x "$dest/$out" ]]; then
    say "$out $version: cached in $dest"
  else
    say "$out $version: building $pkg (this takes minutes the first time)"
    local start=$SECONDS
    mkdir -p "$dest.tmp"
    (cd "$moddir" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$dest.tmp/$out" "$pkg")
    mkdir -p "$dest" && mv "$dest.tmp/$out" "$dest/$out" && rmdir "$dest.tmp"
    say "$out $version: built in $((SECONDS - start)) s"
  fi
  ln -sf "$dest/$out" "$bin_dir/$out"
}

# go_install NAME VERSION PACKAGE: go install PACKAGE@VERSION into the cache.
go_install() {
  local name=$1 version=$2 pkg=$3
  local dest=$tools_dir/$name-$version
  if [[ -x "$dest/$name" ]]; then
    say "$name $version: cached in $dest"
  else
    say "$name $version: installing $pkg@$version"
    local start=$SECONDS
    GOBIN="$dest" CGO_ENABLED=0 go install -trimpath "$pkg@$version"
    say "$name $version: built in $((SECONDS - start)) s"
  fi
  ln -sf "$dest/$name" "$bin_dir/$name"
}

# Debian packages: protoc for etcd-client's build, etcd 3.4 for the compatibility pass (its etcdctl
# also has make-mirror).
apt_packages=()
command -v protoc >/dev/null || apt_packages+=(protobuf-compiler)
[[ -x /usr/bin/etcd ]] || apt_packages+=(etcd-server)
[[ -x /usr/bin/etcdctl ]] || apt_packages+=(etcd-client)
if ((${#apt_packages[@]})); then
  command -v apt-get >/dev/null || die "missing ${apt_packages[*]}: install them with your package manager"
  [[ $(id -u) == 0 ]] || die "missing ${apt_packages[*]}: run 'sudo apt-get install ${apt_packages[*]}' or re-run as root"
  say "apt-get install ${apt_packages[*]}"
  start=$SECONDS
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
  say "apt packages installed in $((SECONDS - start)) s"
fi
ln -sf "$(command -v protoc)" "$bin_dir/protoc"
ln -sf /usr/bin/etcd "$bin_dir/etcd-3.4"
ln -sf /usr/bin/etcdctl "$bin_dir/etcdctl-3.4"

build_from_module etcd "$ETCD_VERSION" "$here/tools/etcd" go.etcd.io/etcd/server/v3 etcd
build_from_module etcdctl "$ETCD_VERSION" "$here/tools/etcd" go.etcd.io/etcd/etcdctl/v3 etcdctl
build_from_module etcdutl "$ETCD_VERSION" "$here/tools/etcd" go.etcd.io/etcd/etcdutl/v3 etcdutl
# Built from the module, the binaries would say they are v0.0.0-master: stamp the version in, as a
# release build does, so that the API server reports it (Helm checks the chart's kubeVersion
# against it on install).
kube_minor=${KUBE_VERSION#v1.}
kube_ldflags="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${kube_minor%%.*} -X k8s.io/component-base/version.gitTreeState=clean"
build_from_module kube-apiserver "$KUBE_VERSION" "$here/tools/kube" k8s.io/kubernetes/cmd/kube-apiserver kube-apiserver "$kube_ldflags"
build_from_module kubectl "$KUBE_VERSION" "$here/tools/kube" k8s.io/kubernetes/cmd/kubectl kubectl "$kube_ldflags"
go_install helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm
go_install kubeconform "$KUBECONFORM_VERSION" github.com/yannh/kubeconform/cmd/kubeconform
go_install promtool "$PROMETHEUS_VERSION" github.com/prometheus/prometheus/cmd/promtool
# The Argo CD health scripts' runner is this repository's own code: its cache key is the
# interpreter's version and a digest of the sources, so any change to them rebuilds it.
lua_health_version=$GOPHER_LUA_VERSION-$(cat "$here"/tools/lua-health/{go.mod,go.sum,main.go} | sha256sum | cut -c1-12)
build_from_module aether-lua-health "$lua_health_version" "$here/tools/lua-health" . aether-lua-health

go_install crane "$CRANE_VERSION" github.com/google/go-containerregistry/cmd/crane

zig_dest=$tools_dir/ziglang-$ZIG_VERSION
if [[ -x "$zig_dest/ziglang/zig" ]]; then
  say "zig $ZIG_VERSION: cached in $zig_dest"
else
  command -v python3 >/dev/null || die "python3 (3.11+) is needed to install Zig from PyPI"
  say "zig $ZIG_VERSION: installing ziglang from PyPI"
  rm -rf "$zig_dest.tmp"
  python3 -m pip install --quiet --disable-pip-version-check --target "$zig_dest.tmp" "ziglang==$ZIG_VERSION"
  rm -rf "$zig_dest" && mv "$zig_dest.tmp" "$zig_dest"
fi
ln -sf "$zig_dest/ziglang/zig" "$bin_dir/zig"

zigbuild_dest=$tools_dir/cargo-zigbuild-$CARGO_ZIGBUILD_VERSION
if [[ -x "$zigbuild_dest/bin/cargo-zigbuild" ]]; then
  say "cargo-zigbuild $CARGO_ZIGBUILD_VERSION: cached in $zigbuild_dest"
else
  say "cargo-zigbuild $CARGO_ZIGBUILD_VERSION: building from crates.io"
  start=$SECONDS
  cargo install --quiet --locked cargo-zigbuild --version "=$CARGO_ZIGBUILD_VERSION" --root "$zigbuild_dest.tmp"
  rm -rf "$zigbuild_dest" && mv "$zigbuild_dest.tmp" "$zigbuild_dest"
  say "cargo-zigbuild $CARGO_ZIGBUILD_VERSION: built in $((SECONDS - start)) s"
fi
ln -sf "$zigbuild_dest/bin/cargo-zigbuild" "$bin_dir/cargo-zigbuild"

say "all tools in $bin_dir"
