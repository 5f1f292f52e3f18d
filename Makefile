# proxyshift developer entry points. `make demo` is the main job, `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest
export PYTHONUNBUFFERED := 1

.PHONY: help setup deps lint crds crds-check binaries go-tools cluster-up cluster-down cluster-status \
        test test-unit test-dataplane test-e2e test-reliability test-vm vm-test bench demo clean

help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: deps ## install system packages and Python dependencies (idempotent)

deps:
	@./hack/install-deps.sh

lint: ## ruff over the whole tree, mypy over the pure core (api, planner, render) and the operator wiring
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

crds: ## regenerate crds/ and docs/crd-reference.md from the pydantic models
	$(PYTHON) -m proxyshift.cli crds

crds-check: ## fail when the committed CRDs differ from the models
	$(PYTHON) -m proxyshift.cli crds --check

binaries: go-tools ## build the pinned upstream Kubernetes and etcd binaries and the tests' Go tools (cached)
	$(PYTHON) -m proxyshift.localcluster.build

go-tools: ## build only the tests' small pinned Go tools (argocd-health-runner, helm; cached: seconds, helm minutes the first time)
	$(PYTHON) -m proxyshift.localcluster.gotools

cluster-up: binaries ## start the local cluster (3 nodes: pools blue=2, green=1)
	$(PYTHON) -m proxyshift.localcluster.cli up --pools blue=2,green=1

cluster-down: ## stop the local cluster and remove everything it made
	$(PYTHON) -m proxyshift.localcluster.cli down

cluster-status:
	$(PYTHON) -m proxyshift.localcluster.cli status

# One command as root in the QEMU guest (stock Debian kernel with IPVS); default: a smoke check.
VM_CMD ?= sh -c 'uname -r && modprobe ip_vs && ip link add kube-ipvs0 type dummy && ipvsadm -Ln && echo vm ok'
vm-test: ## boot the QEMU guest and run VM_CMD in it (fetches the pinned kernel the first time)
	$(PYTHON) -m proxyshift.localcluster.cli vm -- $(VM_CMD)

test-unit: ## pure tests (fast, no root)
	$(PYTEST) -m unit

test-dataplane: ## root + network namespaces with real iptables/nft
	$(PYTEST) -m dataplane

test-vm: binaries ## one QEMU guest with IPVS runs the vm_guest tests (kube-proxy ipvs, preflight, flush)
	$(PYTEST) -m vm

test-e2e: binaries ## on the local cluster
	$(PYTEST) -m e2e

test-reliability: binaries
	$(PYTEST) -m reliability

test: setup lint crds-check binaries ## everything CI runs: every layer, in one pytest session
	$(PYTEST)

bench: binaries ## benchmarks (print tables)
	$(PYTHON) bench/run_all.py

demo: setup binaries ## the main job: local cluster, operator, pool blue iptables -> nftables, live progress
	$(PYTHON) -m proxyshift.demo

clean: cluster-down
