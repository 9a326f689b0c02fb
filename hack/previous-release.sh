#!/usr/bin/env bash
# Builds the operator binary of the last release RELEASES lists, from its commit, into a cache
# outside the checkout keyed by that commit, and prints its path. The upgrade test
# (e2e/tests/upgrade.rs) runs it beside this tree's binary.
#
# The build shares this checkout's target directory, so that the dependencies the two trees have
# in common (the same Cargo.lock) are compiled once; this tree's own binary is linked again after
# it (its objects are still there), since both write target/debug/aether-operator.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
read -r version commit < <(awk '!/^#/ && NF { v = $1; c = $2 } END { print v, c }' RELEASES)
[[ -n ${commit:-} ]] || { echo "previous-release: RELEASES lists no release" >&2; exit 1; }
cache=${AETHER_CACHE_DIR:-$HOME/.cache/aether-federation}/releases/$version-$commit
if [[ -x $cache/aether-operator ]]; then
  echo "$cache/aether-operator"
  exit 0
fi
git cat-file -e "$commit^{commit}" 2>/dev/null ||
  { echo "previous-release: commit $commit of $version is not in this clone (a shallow clone? git fetch --unshallow)" >&2; exit 1; }
echo "previous-release: building the operator of $version ($commit), once" >&2
src=$(mktemp -d -t aether-release-XXXXXX)
trap 'rm -rf "$src"' EXIT
git archive "$commit" | tar -x -C "$src"
started=$SECONDS
# The release's dependencies built as this tree's are (its profile may differ), so they are shared.
(cd "$src" && CARGO_TARGET_DIR="$root/target" cargo build -q --config 'profile.dev.debug="line-tables-only"' \
  -p aether-operator --bin aether-operator)
mkdir -p "$cache.tmp"
cp "$root/target/debug/aether-operator" "$cache.tmp/aether-operator"
rm -rf "$cache" && mv "$cache.tmp" "$cache"
# This tree's binary back in its place.
cargo build -q -p aether-operator --bin aether-operator
echo "previous-release: built in $((SECONDS - started)) s" >&2
echo "$cache/aether-operator"
