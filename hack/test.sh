#!/usr/bin/env bash
# The suites of `make test` after the lints: unit, property and integration tests against real
# etcd and kube-apiserver; the image (`make image`) and its test (the federation on the image's
# binary); the mirror and lease suites again on etcd 3.4, and the multi-region e2e. The soak tests
# (minutes at the CRD defaults, mostly waiting: 25 s partitions, 16k leases held for three TTLs, ten
# idle minutes) run beside the 3.4 pass, the e2e and the image's test instead of after them,
# once the image's release builds are done; their output is printed when they end.
set -uo pipefail
cd "$(dirname "$0")/.."
cargo=${CARGO:-cargo}
make=${MAKE:-make}

"$cargo" test --workspace --no-run --quiet || exit 1
failed=()
"$cargo" test --workspace --exclude aether-e2e --no-fail-fast || failed+=("unit and integration tests")

image_built=true
"$make" image || { failed+=("make image"); image_built=false; }

soak_log=$(mktemp -t aether-soak.XXXXXX)
started=$SECONDS
"$cargo" test -p aether-operator --test soak -- --ignored --test-threads=5 >"$soak_log" 2>&1 &
soak=$!
trap 'kill "$soak" 2>/dev/null' EXIT

"$make" test-etcd34 || failed+=("the etcd 3.4 pass")
"$make" e2e || failed+=("e2e")
if $image_built; then
  "$cargo" test -p aether-e2e --test image || failed+=("the image's test")
fi

if ! wait "$soak"; then
  failed+=("soak")
fi
trap - EXIT
echo "--- soak tests ($((SECONDS - started)) s) ---"
cat "$soak_log"
rm -f "$soak_log"

if ((${#failed[@]})); then
  echo "make test: failed: ${failed[*]}" >&2
  exit 1
fi
echo "make test: every suite passed"
