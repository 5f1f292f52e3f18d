# proxyshift developer entry points. `make demo` is the main job, `make test` runs every test.
SHELL := /bin/bash
# Every target runs the project's .venv (`make venv`: hack/venv.sh, from requirements/dev.lock), never
# the system python3. Its bin/ goes first on PATH for the console scripts (proxyshift, localcluster,
# kubectl-proxyshift) and for whatever the tests start by name.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
PYTEST ?= $(PYTHON) -m pytest
export PATH := $(abspath $(VENV))/bin:$(PATH)
# What a target that runs $(PYTHON) needs first: the venv, unless PYTHON names another interpreter.
PY := $(if $(filter $(VENV)/bin/python,$(PYTHON)),venv)
export PYTHONUNBUFFERED := 1
# `make lock` keeps every pin the constraints allow; `make lock UPGRADE=1` moves them to the newest.
LOCK_FLAGS := --python-version 3.11 --generate-hashes $(if $(UPGRADE),--upgrade)

.PHONY: help setup deps venv lock lint crds crds-check binaries go-tools cluster-up cluster-down cluster-status \
        test test-unit test-dataplane test-e2e test-reliability test-vm vm-test bench demo clean

help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: deps ## install system packages and the project's .venv (idempotent)

deps:
	@./hack/install-deps.sh

venv: ## only the Python side: .venv from requirements/dev.lock (remade when the lock changes)
	@VENV=$(VENV) ./hack/venv.sh

# The image's runtime pins (requirements.lock, the Dockerfile's) first; the dev lock is compiled under
# them as constraints, so .venv runs the versions the image ships.
lock: venv ## regenerate requirements.lock and requirements/dev.lock from pyproject.toml (uv, in .venv)
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_FLAGS) -o requirements.lock
	$(VENV)/bin/uv pip compile pyproject.toml requirements/venv.in --extra dev -c requirements.lock \
	    $(LOCK_FLAGS) -o requirements/dev.lock

lint: $(PY) ## ruff over the whole tree, mypy over the package, the test bed, bench/ and tests/ (strict on the pure core)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy
	PYTHON=$(PYTHON) ./hack/mypy-tests.sh

crds: $(PY) ## regenerate crds/ and docs/crd-reference.md from the pydantic models
	$(PYTHON) -m proxyshift.cli crds

crds-check: $(PY) ## fail when the committed CRDs differ from the models
	$(PYTHON) -m proxyshift.cli crds --check

binaries: go-tools ## build the pinned upstream Kubernetes and etcd binaries and the tests' Go tools (cached)
	$(PYTHON) -m localcluster.build

# The tools the unit layer runs: not the Cilium agent, whose first build takes minutes.
UNIT_GO_TOOLS := argocd-health-runner helm

go-tools: $(PY) ## build the tests' pinned Go tools (GO_TOOLS="..." for some: argocd-health-runner, helm, cilium-agent; cached)
	$(PYTHON) -m localcluster.gotools $(GO_TOOLS)

cluster-up: binaries ## start the local cluster (3 nodes: pools blue=2, green=1)
	$(PYTHON) -m localcluster.cli up --pools blue=2,green=1

cluster-down: $(PY) ## stop the local cluster and remove everything it made
	$(PYTHON) -m localcluster.cli down

cluster-status: $(PY)
	$(PYTHON) -m localcluster.cli status

# One command as root in the QEMU guest (stock Debian kernel with IPVS); default: a smoke check.
VM_CMD ?= sh -c 'uname -r && modprobe ip_vs && ip link add kube-ipvs0 type dummy && ipvsadm -Ln && echo vm ok'
vm-test: $(PY) ## boot the QEMU guest and run VM_CMD in it (fetches the pinned kernel the first time)
	$(PYTHON) -m localcluster.cli vm -- $(VM_CMD)

test-unit: setup ## pure tests (fast, no root once setup has run)
	$(PYTHON) -m localcluster.gotools $(UNIT_GO_TOOLS)
	$(PYTEST) -m unit

test-dataplane: go-tools ## root + network namespaces with real iptables/nft (and the confined Cilium agent)
	$(PYTEST) -m dataplane

test-vm: binaries ## one QEMU guest with IPVS runs the vm_guest tests (kube-proxy ipvs, preflight, flush)
	$(PYTEST) -m vm

test-e2e: binaries ## on the local cluster
	$(PYTEST) -m e2e

test-reliability: binaries
	$(PYTEST) -m reliability

# The Go builds run in the background while lint and the unit layer run (hack/test-all.sh says how);
# the other layers then run in a second pytest session.
test: setup ## everything CI runs: lint, crds-check, every layer (binaries built beside lint and unit)
	PYTHON=$(PYTHON) MAKE=$(MAKE) ./hack/test-all.sh

bench: setup binaries ## benchmarks (print tables); setup: the system tools they run (iptables, nft, QEMU)
	$(PYTHON) bench/run_all.py

demo: setup binaries ## the main job: local cluster, operator, pool blue iptables -> nftables, live progress
	$(PYTHON) -m localcluster.demo

clean: cluster-down
