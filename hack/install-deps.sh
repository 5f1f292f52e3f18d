#!/usr/bin/env bash
# Install everything proxyshift's demo and tests need on a fresh Debian machine.
# The Python side goes into the checkout's .venv (hack/venv.sh), never into the system python3.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

# gcc, libc6-dev: build tests/tools/realtime-offset, the shim that skews the agent's wall clock in
# tests/reliability (never in the image)
# qemu-system-x86, busybox-static: the vm test layer's guest (localcluster.vm); its
# kernel package is fetched and cached by the runner itself (pinned in localcluster/pins.env)
# clang-19: the Cilium agent (tests/dataplane/test_cilium_kpr.py, tests/e2e/test_cilium_localcluster.py)
# compiles its BPF datapath at start with `clang` (localcluster/cilium.py puts /usr/lib/llvm-19/bin first
# on its PATH); clang-14, Debian 12's default, leaves programs this kernel's verifier rejects. bpftool:
# those tests' proof that no BPF program is attached outside the simulated node (`bpftool cgroup tree`,
# `bpftool net show`)
# prometheus: for its promtool, which the unit layer runs on config/prometheus (the alert rules and
# the dashboard's expressions); its service is not wanted (stopped below where systemd started it)
DEBIAN_PACKAGES=(iptables nftables ipset conntrack iproute2 ipvsadm kmod procps openssl gcc libc6-dev
                 qemu-system-x86 busybox-static prometheus clang-19 bpftool)
# python3-venv: Debian's python3 makes no venv without it (ensurepip lives there); another python3
# (pyenv's, a python.org build) brings its own ensurepip and needs nothing from apt
if ! python3 -c 'import ensurepip' 2>/dev/null; then DEBIAN_PACKAGES+=(python3-venv); fi

missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "==> apt-get install ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then echo "need root to install ${missing[*]}" >&2; exit 1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    # Debian enables and starts the server it installs; only promtool is needed here.
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
else
  echo "==> Debian packages present: ${DEBIAN_PACKAGES[*]}"
fi

# Python: the project's own .venv from requirements/dev.lock (hack/venv.sh); the system python3 is
# never installed into (PEP 668 forbids it on Debian, and a machine-wide install would follow
# whichever checkout ran last).
./hack/venv.sh
