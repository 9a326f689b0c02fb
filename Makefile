# The project's entry points. `make demo` and `make test` are the two a user needs.
SHELL := /bin/bash
TOOLS_BIN := $(shell hack/tools.sh --print-bin)
export AETHER_TOOLS_BIN := $(TOOLS_BIN)
export PATH := $(TOOLS_BIN):$(PATH)
CARGO ?= cargo

.PHONY: all tools build manifests crds image chart krew test test-soak test-etcd34 lint fmt bench demo e2e e2e-kind lint-chart check-alerts clean

all: build

## tools: build or reuse kube-apiserver, kubectl, etcd, helm, kubeconform (cached outside the checkout)
tools:
	hack/tools.sh

build:
	$(CARGO) build --workspace --all-targets

## manifests: regenerate the CRDs (crds/, config/, the chart) and the RBAC from operator/src
manifests:
	$(CARGO) run -q -p aether-operator -- manifests --root .
crds: manifests

## image: static musl binaries for linux/amd64 and linux/arm64 and the OCI image (a multi-arch
## index, FROM scratch, user 65532) as target/image/aether-operator-<version>.oci.tar, with its SBOM;
## no container engine (hack/image.sh)
image: tools
	hack/image.sh

## chart: the Helm chart packaged as target/chart/aether-federation-<version>.tgz; one version for
## everything: Cargo.toml's, which Chart.yaml's version and appVersion must equal (hack/package.sh)
chart: tools
	hack/package.sh chart

## krew: the kubectl plugin (kubectl aether status|doctor) of the same version: an archive per built
## platform and the krew manifest naming them, in target/krew/ (KREW_URL_BASE: where they are served)
krew:
	$(CARGO) build --release -p aether-operator
	hack/package.sh krew

## demo: two regions on this machine, an operator each; shows the federation and a region's mirror lapsing
demo: tools
	$(CARGO) build -q -p aether-operator -p aether-e2e
	target/debug/aether-demo

## test: formatting, lints, unit and integration tests against real etcd and kube-apiserver, the
## e2e, and the soak tests beside the e2e (hack/test.sh)
test: tools lint
	$(MAKE) check-alerts
	CARGO=$(CARGO) MAKE=$(MAKE) hack/test.sh

## test-soak: the soak tests alone (the lease promise at the CRD defaults and with 16k leases, and
## eight origins syncing into a peer held to 3 % of a core, which needs root)
test-soak: tools
	$(CARGO) test -p aether-operator --test soak -- --ignored --test-threads=7
	$(CARGO) test -p aether-operator --test overload -- --ignored

## check-alerts: the alert rules rendered by the chart (defaults and tuned values): promtool check and
## unit tests, the kustomize copy equal to the default rendering, the dashboard's queries
check-alerts: tools
	hack/check-alerts.sh

## e2e: the multi-region scenario (2 then 3 regions) on local real parts
e2e: tools
	$(CARGO) build -q -p aether-operator
	$(CARGO) test -p aether-e2e --test e2e -- --test-threads=1

## lint-chart: helm lint, kubeconform -strict, server-side dry run of the chart and config/default,
## and helm install -> upgrade -> uninstall against a real kube-apiserver
lint-chart: tools
	$(CARGO) test -p aether-operator --test chart

## e2e-kind: the scenario on two kind clusters built offline (hack/kind/): the image and chart
## this tree ships, installed with Helm; visibility, data path both ways, a leader handoff (root)
e2e-kind: image chart
	hack/kind/e2e.sh

## bench: the mirror's and the drain's throughput, latency and memory (prints a table)
bench: tools
	$(CARGO) build -q --release -p aether-operator -p aether-bench
	target/release/aether-bench

## test-etcd34: the mirror's and the leases' suites again, on Debian's etcd 3.4
test-etcd34: tools
	AETHER_ETCD=3.4 $(CARGO) test -p aether-operator --test mirror --test leases --no-fail-fast

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
