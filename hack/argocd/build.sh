#!/usr/bin/env bash
# Argo CD for the kind e2e, built here from the Go module proxy and Debian's mirror, never pulled:
#
#   argocd v3.2.6       the multi-call binary (server, repo-server, application-controller, CLI)
#                       from github.com/argoproj/argo-cd/v3's module zip, as upstream's Makefile
#                       builds it (CGO off, its -X version flags), stripped: $tools_dir/argocd-v3.2.6/
#   aether.local/argocd:v3.2.6-<key>
#                       one image for Argo CD's components, redis and the in-cluster git server:
#                       Debian bookworm (debootstrap minbase: git, gpg, tini, redis-server) with
#                       argocd and helm, laid out as upstream's Dockerfile (user 999, /app/config),
#                       `docker import`ed and `docker save`d beside the cache so a lost docker store
#                       reloads in seconds
#   install.yaml        upstream's manifests/install.yaml, kept beside the binary for manifest.py
#
#   hack/argocd/build.sh           build or reuse; print ARGOCD_IMAGE=<ref> and ARGOCD_DIR=<dir>
#   hack/argocd/build.sh --print   print them, build nothing
#
# 3.2.x is the newest line that builds from the module proxy (3.3+ replace gitops-engine with a
# nested module the proxy does not serve). The first build takes 9-12 minutes of one core (niced)
# and 2 GB of Go's build cache.
set -euo pipefail
# shellcheck source=../kind/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../kind" && pwd)/lib.sh"

ARGOCD_VERSION=v3.2.6
ARGOCD_MODULE=github.com/argoproj/argo-cd/v3
HELM_VERSION=v3.19.0   # hack/tools.sh's; Argo CD's repo-server renders the chart with it
PKGS=(git ca-certificates gpg gpg-agent tini redis-server)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dest=$tools_dir/argocd-$ARGOCD_VERSION
helm_bin=$(ls -d "$tools_dir"/helm-"$HELM_VERSION"*/helm 2>/dev/null | head -n 1 || true)

image_key() { sha256sum "$dest/argocd" "$helm_bin" "${BASH_SOURCE[0]}" | cut -c1-64 | sha256sum | cut -c1-12; }
image_ref() { echo "aether.local/argocd:$ARGOCD_VERSION-$(image_key)"; }
print() { echo "ARGOCD_IMAGE=$(image_ref)"; echo "ARGOCD_DIR=$dest"; }

if [[ ${1:-} == --print ]]; then
  [[ -x $dest/argocd ]] || die "argocd $ARGOCD_VERSION is not built yet (hack/argocd/build.sh)"
  print
  exit 0
fi
[[ -n $helm_bin && -x $helm_bin ]] || die "helm $HELM_VERSION is missing from $tools_dir: run 'make tools'"

# --- The binary --------------------------------------------------------------------------------------
build_argocd() {
  [[ -x $dest/argocd && -f $dest/install.yaml ]] && return 0
  need_go
  local start=$SECONDS info zip src tmp
  say "argocd $ARGOCD_VERSION: building from $ARGOCD_MODULE (minutes the first time)"
  info=$(go mod download -json "$ARGOCD_MODULE@$ARGOCD_VERSION") \
    || die "go mod download $ARGOCD_MODULE@$ARGOCD_VERSION failed (the Go module proxy is needed the first time)"
  zip=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["Zip"])' <<<"$info")
  tmp=$(mktemp -d "$tools_dir/argocd-src.XXXXXX")
  # shellcheck disable=SC2064  # the directory is known now
  trap "rm -rf '$tmp'" RETURN
  (cd "$tmp" && unzip -q "$zip") || die "unzip $zip failed"
  src=$tmp/$ARGOCD_MODULE@$ARGOCD_VERSION
  chmod -R u+w "$src"
  local pkg=$ARGOCD_MODULE/common kubectl_version build_date
  kubectl_version=$(cd "$src" && go list -m k8s.io/client-go | awk '{print $NF}')
  build_date=$(python3 -c 'import json,sys; print(json.load(open(json.load(sys.stdin)["Info"]))["Time"])' <<<"$info")
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  (cd "$src" && CGO_ENABLED=0 heavy go build -trimpath -ldflags "-s -w -X $pkg.version=${ARGOCD_VERSION#v} \
      -X $pkg.buildDate=$build_date -X $pkg.gitCommit=module-zip -X $pkg.gitTreeState=clean \
      -X $pkg.gitTag=$ARGOCD_VERSION -X $pkg.kubectlVersion=$kubectl_version" -o "$dest.tmp/argocd" ./cmd) \
    || die "go build of argocd $ARGOCD_VERSION failed"
  cp "$src/manifests/install.yaml" "$src/hack/gpg-wrapper.sh" "$src/hack/git-verify-wrapper.sh" "$src/entrypoint.sh" "$dest.tmp/"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
  say "argocd $ARGOCD_VERSION: built in $((SECONDS - start)) s ($(du -h "$dest/argocd" | cut -f1))"
}

# --- The image ---------------------------------------------------------------------------------------
rootfs() { # the Debian root, cached by suite, mirror and packages
  local key tar tmp start=$SECONDS
  key=$(printf '%s\n' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "${PKGS[@]}" | sha256sum | cut -c1-12)
  tar=$tools_dir/argocd-rootfs-$DEBIAN_SUITE-$key.tar
  if [[ ! -f $tar ]]; then
    apt_need debootstrap
    tmp=$(mktemp -d "$tools_dir/argocd-rootfs.XXXXXX")
    heavy debootstrap --variant=minbase --include="$(IFS=,; echo "${PKGS[*]}")" "$DEBIAN_SUITE" "$tmp/root" "$DEBIAN_MIRROR" \
      >"$tmp/debootstrap.log" 2>&1 || { tail -n 20 "$tmp/debootstrap.log" >&2; rm -rf "$tmp"; die "debootstrap failed (Debian's mirror $DEBIAN_MIRROR is needed the first time)"; }
    # What an image does not need: docs, man pages, locales, apt's lists and caches.
    rm -rf "$tmp"/root/usr/share/{doc,man,info,locale}/* "$tmp"/root/var/lib/apt/lists/* \
      "$tmp"/root/var/cache/apt/* "$tmp"/root/var/log/*
    tar -C "$tmp/root" --numeric-owner -cf "$tar.tmp" . && mv "$tar.tmp" "$tar"
    rm -rf "$tmp"
    say "argocd image: Debian root built in $((SECONDS - start)) s ($(du -h "$tar" | cut -f1))"
  fi
  echo "$tar"
}

build_image() {
  local ref=$1 saved=$2 root_tar work r start=$SECONDS
  if docker image inspect "$ref" >/dev/null 2>&1; then return 0; fi
  if [[ -f $saved ]]; then
    docker load -i "$saved" >/dev/null && return 0
  fi
  root_tar=$(rootfs)
  work=$(mktemp -d "$tools_dir/argocd-img.XXXXXX")
  r=$work/root
  mkdir -p "$r" && tar -C "$r" --numeric-owner -xpf "$root_tar"
  install -m 0755 "$dest/argocd" "$r/usr/local/bin/argocd"
  local l
  for l in argocd-server argocd-repo-server argocd-cmp-server argocd-application-controller argocd-dex \
    argocd-notifications argocd-applicationset-controller argocd-k8s-auth argocd-commit-server; do
    ln -s /usr/local/bin/argocd "$r/usr/local/bin/$l"
  done
  install -m 0755 "$helm_bin" "$r/usr/local/bin/helm"
  install -m 0755 "$dest/gpg-wrapper.sh" "$dest/git-verify-wrapper.sh" "$dest/entrypoint.sh" "$r/usr/local/bin/"
  ln -s /usr/local/bin/entrypoint.sh "$r/usr/local/bin/uid_entrypoint.sh"
  # Upstream's `useradd -r -u 999 argocd`, without running the root's tools.
  grep -q '^argocd:' "$r/etc/group" || echo 'argocd:x:999:' >>"$r/etc/group"
  grep -q '^argocd:' "$r/etc/passwd" || echo 'argocd:x:999:999::/home/argocd:/bin/sh' >>"$r/etc/passwd"
  mkdir -p "$r/home/argocd" && chown 999:0 "$r/home/argocd" && chmod 0775 "$r/home/argocd"
  mkdir -p "$r/app/config/ssh" "$r/app/config/tls" "$r/app/config/gpg/source" "$r/app/config/gpg/keys" "$r/etc/ssh"
  touch "$r/app/config/ssh/ssh_known_hosts"
  ln -sfn /app/config/ssh/ssh_known_hosts "$r/etc/ssh/ssh_known_hosts"
  chown 999 "$r/app/config/gpg/keys" && chmod 0700 "$r/app/config/gpg/keys"
  chmod 1777 "$r/tmp"
  tar -C "$r" --numeric-owner -c . | docker import \
    --change 'ENTRYPOINT ["/usr/bin/tini", "--"]' --change 'USER 999' --change 'WORKDIR /home/argocd' \
    --change 'ENV USER=argocd' --change 'ENV HOME=/home/argocd' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$ref" >/dev/null || { rm -rf "$work"; die "docker import of $ref failed"; }
  rm -rf "$work"
  mkdir -p "${saved%/*}"
  docker save "$ref" >"$saved.tmp" && mv "$saved.tmp" "$saved"
  # What the pods run must run in it.
  docker run --rm --network none "$ref" sh -c 'argocd version --client --short && helm version --short && git --version && redis-server --version' >&2 \
    || die "$ref: a binary does not run in the image"
  say "argocd image $ref: built in $((SECONDS - start)) s ($(du -h "$saved" | cut -f1) saved)"
}

need_root "building the Argo CD image"
with_lock "$dest" build_argocd
engine_up
ref=$(image_ref)
with_lock "$tools_dir/argocd-image" build_image "$ref" "$tools_dir/argocd-image-${ref##*:}/image.tar"
print
