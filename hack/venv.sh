#!/usr/bin/env bash
# Make the project virtualenv (.venv, or $VENV) from requirements/dev.lock; hack/install-deps.sh and
# `make venv` run it. The system python3 only creates the venv: nothing is installed into it.
# Idempotent: while the lock, pyproject.toml and the checkout's path are those the venv was made
# from, a second run only checks. Otherwise the venv is made afresh, so it never keeps packages a
# lock has dropped, nor scripts whose #! names a checkout that moved.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
LOCK=requirements/dev.lock
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input --quiet)

made_from="$(cat "$LOCK" pyproject.toml localcluster/pyproject.toml | sha256sum | cut -d' ' -f1) $(pwd)"
stamp="$VENV/.proxyshift-made-from"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$made_from" ] && [ -x "$VENV/bin/python" ] \
   && "$VENV/bin/python" -c 'import proxyshift, localcluster' 2>/dev/null; then
  echo "==> $VENV is up to date with $LOCK ($("$VENV/bin/python" -V))"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
echo "==> python3 -m venv $VENV (from $(command -v python3), $(python3 -V))"
python3 -m venv "$VENV"
# pip installs only uv, the lock's own pin with its hashes; uv then installs the lock in seconds where
# pip takes a minute or two.
uv_pin=$(mktemp)
trap 'rm -f "$uv_pin"' EXIT
awk '/^uv==/ {found = 1} found {print; if (!/\\$/) exit}' "$LOCK" > "$uv_pin"
[ -s "$uv_pin" ] || { echo "no uv pin in $LOCK (make lock puts it there)" >&2; exit 1; }
echo "==> $VENV: pip install --require-hashes $(head -1 "$uv_pin" | cut -d' ' -f1)"
"${PIP[@]}" install --require-hashes --no-deps -r "$uv_pin"
UV=("$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python")
echo "==> $VENV: uv pip install --require-hashes -r $LOCK"
"${UV[@]}" --require-hashes -r "$LOCK"
# Editable, so the agents the local cluster starts with the venv's interpreter import this
# checkout; the build backend comes from the lock (--no-build-isolation), not from an unpinned fetch.
# Two distributions: the operator (.) and the test bed (./localcluster), which the image never has.
echo "==> $VENV: uv pip install --no-deps --no-build-isolation -e . -e ./localcluster"
"${UV[@]}" --no-deps --no-build-isolation -e . -e ./localcluster
echo "$made_from" > "$stamp"
echo "==> $VENV ready in $(( $(date +%s) - start ))s"
