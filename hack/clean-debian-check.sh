#!/usr/bin/env bash
# Run `make test-unit` from nothing in a clean Debian 12 root, as a new user's machine would:
# debootstrap with only python3, make, git and ca-certificates, a git clone of BRANCH, then
# `make test-unit` (which installs the Debian packages, makes .venv and builds the Go tools).
# docs/development.md records a run. As root; the root folder is kept for a look afterwards.
#
#   hack/clean-debian-check.sh [ROOT_DIR [BRANCH]]
#
# Go is the one thing taken from this machine: Debian 12's golang (1.19) is older than the tools'
# go.mod asks for (1.26), and the machines this project runs on bring Go in /usr/local/go, so that
# folder is bound read-only into the root. Everything else comes from Debian's packages, PyPI and
# the Go module proxy. The mounts live in a private mount namespace and go away with it.
# TLS trust is the machine's too: where it reaches the registries through a proxy with its own
# CA, a fresh root's bundle would refuse them, so the machine's bundle is bound over the root's
# (read-only) and SSL_CERT_FILE / PIP_CERT name it (uv reads only SSL_CERT_FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:-/var/tmp/proxyshift-bookworm}
BRANCH=${2:-$(git rev-parse --abbrev-ref HEAD)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
GO_ROOT=${GO_ROOT:-/usr/local/go}
CA_BUNDLE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}

if [ "$(id -u)" -ne 0 ]; then echo "needs root (debootstrap, chroot)" >&2; exit 1; fi
command -v debootstrap >/dev/null || { echo "apt-get install debootstrap first" >&2; exit 1; }
[ -x "$GO_ROOT/bin/go" ] || { echo "no Go in $GO_ROOT (set GO_ROOT)" >&2; exit 1; }
[ -f "$CA_BUNDLE" ] || { echo "no CA bundle $CA_BUNDLE (set SSL_CERT_FILE)" >&2; exit 1; }

if [ ! -x "$ROOT/usr/bin/python3" ]; then
  echo "==> debootstrap bookworm $ROOT"
  nice -n 10 debootstrap --variant=minbase --include=python3,make,git,ca-certificates \
    bookworm "$ROOT" "$MIRROR"
fi
# No init runs in the root: package scripts must not try to start services (prometheus's would).
printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d" && chmod +x "$ROOT/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
rm -rf "$ROOT/root/proxyshift"
git clone --quiet --branch "$BRANCH" "$(git rev-parse --path-format=absolute --git-common-dir)" \
  "$ROOT/root/proxyshift"
mkdir -p "$ROOT/usr/local/go"

echo "==> in $ROOT: cd /root/proxyshift && make test-unit ($(git -C "$ROOT/root/proxyshift" log --oneline -1))"
start=$(date +%s)
# shellcheck disable=SC2016  # expanded inside the root
nice -n 10 unshare --mount --propagation private -- bash -c '
  set -euo pipefail
  root=$1 go_root=$2 ca_bundle=$3
  mount -t proc proc "$root/proc"
  mount -t sysfs sys "$root/sys"
  mount --rbind /dev "$root/dev"
  mount --bind "$go_root" "$root/usr/local/go" && mount -o remount,bind,ro "$root/usr/local/go"
  bundle=/etc/ssl/certs/ca-certificates.crt
  mount --bind "$ca_bundle" "$root$bundle" && mount -o remount,bind,ro "$root$bundle"
  exec chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
    SSL_CERT_FILE=$bundle PIP_CERT=$bundle \
    PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    bash -c "set -euo pipefail
             cd /root/proxyshift && hack/system-python-packages.sh > /tmp/system-python.before
             time make test-unit
             hack/system-python-packages.sh > /tmp/system-python.after
             diff -u /tmp/system-python.before /tmp/system-python.after
             echo \"==> the system python3 is unchanged:\"; cat /tmp/system-python.after"
' bash "$ROOT" "$GO_ROOT" "$CA_BUNDLE"
echo "==> make test-unit in the clean root passed in $(( $(date +%s) - start ))s"
