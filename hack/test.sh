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

# Each phase's wall time, printed at the end: where a slow run spent it.
timings=()
phase_started=$SECONDS
took() {
  timings+=("$1: $((SECONDS - phase_started)) s")
  phase_started=$SECONDS
}

"$cargo" test --workspace --no-run --quiet || exit 1
took "build the tests"
failed=()
"$cargo" test --workspace --exclude aether-e2e --no-fail-fast || failed+=("unit and integration tests")
took "unit and integration tests"

image_built=true
"$make" image || { failed+=("make image"); image_built=false; }
took "make image"

soak_log=$(mktemp -t aether-soak.XXXXXX)
started=$SECONDS
"$cargo" test -p aether-operator --test soak -- --ignored --test-threads=5 >"$soak_log" 2>&1 &
soak=$!
trap 'kill "$soak" 2>/dev/null' EXIT

"$make" test-etcd34 || failed+=("the etcd 3.4 pass")
took "the etcd 3.4 pass (beside the soak tests)"
"$make" e2e || failed+=("e2e")
took "e2e (beside the soak tests)"
if $image_built; then
  "$cargo" test -p aether-e2e --test image || failed+=("the image's test")
fi
took "the image's test (beside the soak tests)"

if ! wait "$soak"; then
  failed+=("soak")
fi
took "the soak tests' rest"
trap - EXIT
echo "--- soak tests ($((SECONDS - started)) s) ---"
cat "$soak_log"
rm -f "$soak_log"
echo "--- wall time by phase (${SECONDS} s in all) ---"
printf '  %s\n' "${timings[@]}"

if ((${#failed[@]})); then
  echo "make test: failed: ${failed[*]}" >&2
  exit 1
fi
echo "make test: every suite passed"
