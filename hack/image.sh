#!/usr/bin/env bash
# `make image`: the operator's image, built without a container engine.
#   - static binaries (musl) for linux/amd64 and linux/arm64 (AETHER_IMAGE_PLATFORMS picks): cargo-zigbuild, with Zig as the C
#     compiler (ring) and the linker, from `make tools`;
#   - the image: an OCI image layout and its tarball, a multi-arch index over one FROM-scratch
#     image per platform (the binary, user 65532, OCI labels for source, revision and version),
#     byte for byte reproducible from a commit (hack/oci-image.py);
#   - its SBOM beside it: SPDX 2.3, every crate compiled in (hack/sbom.py).
# Output in target/image/: aether-operator-<version>.oci.tar (and .oci/, the layout),
# aether-operator-<version>.spdx.json, and the two binaries. Push the layout (the directory; the
# tarball unpacked is the same) with
#   crane push target/image/aether-operator-<version>.oci <registry>/aether-operator:<version>
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bin=${AETHER_TOOLS_BIN:-$HOME/.cache/aether-federation/tools/bin}
die() { echo "image: $*" >&2; exit 1; }
[[ -x $bin/cargo-zigbuild && -x $bin/zig ]] || die "cargo-zigbuild and zig are missing: run 'make tools'"
export PATH=$bin:$PATH

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[[ -n $version ]] || die "no version in Cargo.toml's [workspace.package]"
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[[ -z $(git status --porcelain 2>/dev/null) ]] || revision=$revision-dirty
created=$(git log -1 --format=%ct 2>/dev/null || date +%s)
source_url=${AETHER_IMAGE_SOURCE:-https://github.com/aether/aether-operator}
out=target/image
mkdir -p "$out"

# AETHER_IMAGE_PLATFORMS: which of the two to build (comma-separated; both by default). `make test`
# builds the host's only: the image's test runs that binary, and the other costs minutes.
declare -A triples=([linux/amd64]=x86_64-unknown-linux-musl [linux/arm64]=aarch64-unknown-linux-musl)
declare -A platforms=()
targets=()
IFS=, read -ra wanted <<<"${AETHER_IMAGE_PLATFORMS:-linux/amd64,linux/arm64}"
for platform in linux/amd64 linux/arm64; do  # the index lists them in this order, whatever was asked
  for w in "${wanted[@]}"; do
    [[ $w == "$platform" ]] && { platforms[${triples[$platform]}]=$platform; targets+=("${triples[$platform]}"); }
  done
done
for w in "${wanted[@]}"; do
  [[ -n ${triples[$w]:-} ]] || die "AETHER_IMAGE_PLATFORMS: $w is not linux/amd64 or linux/arm64"
done
rustup target add "${targets[@]}" >/dev/null
rm -f "$out/aether-operator-$version"-linux-*  # a platform built before and not asked for now
args=()
sbom_targets=()
start=$SECONDS
for target in "${targets[@]}"; do
  echo "image: building aether-operator $version for ${platforms[$target]} ($target)"
  cargo zigbuild --release --locked -p aether-operator --target "$target"
  binary=target/$target/release/aether-operator
  cp "$binary" "$out/aether-operator-$version-${platforms[$target]//\//-}"
  args+=(--binary "${platforms[$target]}=$binary")
  sbom_targets+=(--target "$target")
done
python3 hack/oci-image.py --version "$version" --revision "$revision" --source "$source_url" \
  --created "$created" "${args[@]}" --out "$out"
python3 hack/sbom.py --version "$version" "${sbom_targets[@]}" \
  --created "$created" --out "$out/aether-operator-$version.spdx.json"
echo "image: done in $((SECONDS - start)) s"
ls -l "$out" | sed 's/^/  /'
