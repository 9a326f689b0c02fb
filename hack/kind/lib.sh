# Sourced by the hack/kind scripts: the versions, the cache layout and small helpers.
# shellcheck shell=bash disable=SC2034  # the variables are the sourcing scripts'

KIND_VERSION=v0.33.0
KUBE_VERSION=v1.35.4       # keep in step with hack/kind/kube/go.mod (and hack/tools.sh's kubectl)
# What kubeadm $KUBE_VERSION expects (cmd/kubeadm/app/constants); node-image.sh checks them
# against `kubeadm config images list` and stops when they differ.
ETCD_VERSION=v3.6.6        # DefaultEtcdVersion 3.6.6-0; keep in step with hack/kind/etcd/go.mod
COREDNS_VERSION=v1.13.1    # CoreDNSVersion
PAUSE_VERSION=3.10.1       # PauseVersion
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${AETHER_DEBIAN_MIRROR:-http://deb.debian.org/debian}

kind_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tools_dir=${AETHER_TOOLS_DIR:-$HOME/.cache/aether-federation/tools}
bin_dir=$tools_dir/bin
log_dir=${AETHER_KIND_LOG_DIR:-/tmp}

die() { echo "${0##*/}: $*" >&2; exit 1; }
say() { echo "${0##*/}: $*" >&2; }

# Heavy work shares two cores with whoever else builds here.
heavy() { nice -n 19 "$@"; }

need_root() { [[ $(id -u) == 0 ]] || die "$* needs root (re-run as root or with sudo)"; }

# apt_need PACKAGE... : install Debian packages that are missing (apt-get update once per run).
apt_updated=
apt_need() {
  local missing=() p
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p"); done
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]}: install them with your package manager"
  need_root "installing ${missing[*]}"
  say "apt-get install ${missing[*]}"
  if [[ -z $apt_updated ]]; then
    heavy apt-get update -qq >/dev/null || die "apt-get update failed: Debian's package mirror is needed for ${missing[*]}"
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive heavy apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

need_go() { command -v go >/dev/null || die "Go is needed to build kind and the Kubernetes binaries; install Go 1.25+ (https://go.dev/doc/install)"; }

# with_lock PATH CMD...: run CMD holding an exclusive lock named after PATH's last component, in
# the cache's .locks directory (two runs never build the same thing at once).
with_lock() {
  local f=$tools_dir/.locks/${1##*/}; shift
  mkdir -p "$tools_dir/.locks"
  (flock 9; "$@") 9>"$f"
}

# The engine: Debian's docker.io, started when needed, and the docker wrapper first on PATH.
# kind_config FILE: a one-node cluster of the project's node image: no default CNI (the node
# image has a static bridge), and kubelet 1.35+ allowed on cgroup v1. Its API server is told it is
# one of three (--apiserver-count=3), as on a production control plane: the API server then keeps a
# new CRD "Installing" for 5 s before it is Established (apiextensions-apiserver waits that long
# when it has peers), which is what a first install by Argo CD or Helm meets there. With one API
# server the CRD is Established at once. The flag changes nothing else: the endpoint reconciler
# stays the default (lease).
kind_config() {
  local minor=${KUBE_VERSION#v1.}
  minor=${minor%%.*}
  {
    echo "kind: Cluster"
    echo "apiVersion: kind.x-k8s.io/v1alpha4"
    echo "networking:"
    echo "  disableDefaultCNI: true"
    echo "nodes:"
    echo "- role: control-plane"
    echo "kubeadmConfigPatches:"
    if ((minor >= 35)); then
      echo "- |"
      echo "  kind: KubeletConfiguration"
      echo "  failCgroupV1: false"
    fi
    if ((minor < 36)); then # kind writes kubeadm v1beta3 (extraArgs a map) below 1.36
      echo "- |"
      echo "  kind: ClusterConfiguration"
      echo "  apiServer:"
      echo "    extraArgs:"
      echo "      apiserver-count: \"3\""
    else # v1beta4: extraArgs a list of name/value
      echo "kubeadmConfigPatchesJSON6902:"
      echo "- group: kubeadm.k8s.io"
      echo "  version: v1beta4"
      echo "  kind: ClusterConfiguration"
      echo "  patch: |"
      echo "    - {op: add, path: /apiServer/extraArgs/-, value: {name: apiserver-count, value: \"3\"}}"
    fi
  } >"$1"
}

engine_up() {
  local b
  b=$("$kind_dir/engine.sh") || die "the container engine is not available (hack/kind/engine.sh failed)"
  PATH=$b:$PATH
  export PATH
  [[ $(command -v docker) == "$b/docker" ]] || die "the docker wrapper in $b is not first on PATH"
}

# kind from its Go module, cached by version and linked into the tools' bin.
kind_install() {
  local dest=$tools_dir/kind-$KIND_VERSION
  if [[ ! -x $dest/kind ]]; then
    need_go
    say "kind $KIND_VERSION: go install sigs.k8s.io/kind@$KIND_VERSION"
    local start=$SECONDS
    rm -rf "$dest.tmp"
    GOBIN=$dest.tmp CGO_ENABLED=0 heavy go install -trimpath "sigs.k8s.io/kind@$KIND_VERSION" \
      || die "go install sigs.k8s.io/kind@$KIND_VERSION failed (the Go module proxy is needed the first time)"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    say "kind $KIND_VERSION: built in $((SECONDS - start)) s"
  fi
  mkdir -p "$bin_dir"
  ln -sfn "$dest/kind" "$bin_dir/kind"
}
