#!/usr/bin/env bash
# `make image`: the operator's image, built without a container engine.
#   - static binaries (musl) for linux/amd64 and linux/arm64: cargo-zigbuild, with Zig as the C
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

declare -A platforms=([x86_64-unknown-linux-musl]=linux/amd64 [aarch64-unknown-linux-musl]=linux/arm64)
rustup target add "${!platforms[@]}" >/dev/null
args=()
start=$SECONDS
for target in x86_64-unknown-linux-musl aarch64-unknown-linux-musl; do
  echo "image: building aether-operator $version for ${platforms[$target]} ($target)"
  cargo zigbuild --release --locked -p aether-operator --target "$target"
  binary=target/$target/release/aether-operator
  cp "$binary" "$out/aether-operator-$version-${platforms[$target]//\//-}"
  args+=(--binary "${platforms[$target]}=$binary")
done
python3 hack/oci-image.py --version "$version" --revision "$revision" --source "$source_url" \
  --created "$created" "${args[@]}" --out "$out"
python3 hack/sbom.py --version "$version" --target x86_64-unknown-linux-musl --target aarch64-unknown-linux-musl \
  --created "$created" --out "$out/aether-operator-$version.spdx.json"
echo "image: done in $((SECONDS - start)) s"
ls -l "$out" | sed 's/^/  /'
