#!/usr/bin/env bash
# Release artifacts, all of one version: the workspace's (Cargo.toml `version`), which the chart's
# version and appVersion must equal.
#
#   hack/package.sh chart   `make chart`: target/chart/aether-federation-<version>.tgz
#   hack/package.sh krew    `make krew`: target/krew/aether-operator-v<version>-<os>-<arch>.tar.gz
#                           for every aether-operator binary built (target/release/ for this
#                           machine, target/<triple>/release/ for cross builds), and the krew
#                           plugin manifest target/krew/aether.yaml naming them with their sha256
#
# KREW_URL_BASE (default: the GitHub release of the version) is where the manifest says the
# archives are downloaded from; upload them there under the same names.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
chart=$root/charts/aether-federation
bin=${AETHER_TOOLS_BIN:-$HOME/.cache/aether-federation/tools/bin}
die() { echo "package: $*" >&2; exit 1; }

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml")
[[ -n $version ]] || die "no version in Cargo.toml's [workspace.package]"
chart_version=$(sed -n 's/^version: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$chart/Chart.yaml")
app_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$chart/Chart.yaml")
[[ $chart_version == "$version" && $app_version == "$version" ]] \
  || die "one version for everything: Cargo.toml says $version, Chart.yaml version $chart_version and appVersion $app_version"

case "${1:-}" in
  chart)
    helm=$bin/helm
    [[ -x $helm ]] || die "$helm is missing: run 'make tools'"
    out=$root/target/chart
    mkdir -p "$out"
    "$helm" lint "$chart" --kube-version 1.35.0 >/dev/null || die "helm lint failed: run it for the details"
    "$helm" package "$chart" --version "$version" --app-version "$version" --destination "$out" >/dev/null
    echo "package: $out/aether-federation-$version.tgz (chart $version, image ghcr.io/aether/aether-operator:$version)"
    ;;
  krew)
    out=$root/target/krew
    url_base=${KREW_URL_BASE:-https://github.com/aether/aether-federation/releases/download/v$version}
    rm -rf "$out" && mkdir -p "$out"
    # The binaries built: this machine's, and cross builds by Rust target triple.
    declare -A platforms=()
    host_os=$(uname -s | tr 'A-Z' 'a-z')
    case $(uname -m) in x86_64 | amd64) host_arch=amd64 ;; aarch64 | arm64) host_arch=arm64 ;; *) host_arch=$(uname -m) ;; esac
    [[ -x $root/target/release/aether-operator ]] && platforms[$host_os/$host_arch]=$root/target/release/aether-operator
    for triple in x86_64-unknown-linux-gnu x86_64-unknown-linux-musl aarch64-unknown-linux-gnu aarch64-unknown-linux-musl \
      x86_64-apple-darwin aarch64-apple-darwin; do
      binary=$root/target/$triple/release/aether-operator
      [[ -x $binary ]] || continue
      arch=${triple%%-*}; arch=${arch/x86_64/amd64}; arch=${arch/aarch64/arm64}
      case $triple in *linux*) os=linux ;; *darwin*) os=darwin ;; esac
      platforms[$os/$arch]=$binary
    done
    ((${#platforms[@]})) || die "no aether-operator binary built: cargo build --release -p aether-operator (make krew does)"
    manifest=$out/aether.yaml
    cat > "$manifest" <<YAML
# The krew plugin manifest of aether-operator $version: \`kubectl krew install --manifest=aether.yaml\`
# (with --archive=<the archive> offline). Written by \`make krew\` (hack/package.sh).
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: aether
spec:
  version: v$version
  homepage: https://github.com/aether/aether-federation
  shortDescription: Status and credential checks of an aether region federation
  description: |
    The aether region federation operator's command line, installed as kubectl-aether.
    \`kubectl aether status\` reads every region's RegionPeering through your kubeconfig's
    contexts and prints the origin x target matrix of mirrors (with --etcd, each target's copy
    read directly); it exits 1 unless every region is Ready and every mirror synced, so it fits
    a deploy gate. \`kubectl aether doctor\` checks one RegionPeering's etcd credentials: the
    Secrets, certificate expiry, connecting, least-privilege roles and clock skew.
  platforms:
YAML
    for platform in $(printf '%s\n' "${!platforms[@]}" | sort); do
      os=${platform%/*} arch=${platform#*/}
      archive=aether-operator-v$version-$os-$arch.tar.gz
      stage=$(mktemp -d)
      cp "${platforms[$platform]}" "$stage/aether-operator"
      cp "$root/README.md" "$stage/README.md"
      tar -C "$stage" --owner=0 --group=0 --mtime='1970-01-01' -czf "$out/$archive" aether-operator README.md
      rm -rf "$stage"
      sha=$(sha256sum "$out/$archive" | cut -d' ' -f1)
      cat >> "$manifest" <<YAML
    - selector:
        matchLabels:
          os: $os
          arch: $arch
      uri: $url_base/$archive
      sha256: $sha
      bin: aether-operator
YAML
      echo "package: $out/$archive"
    done
    echo "package: $manifest (v$version, ${#platforms[@]} platform(s))"
    ;;
  *)
    die "usage: hack/package.sh chart|krew"
    ;;
esac
