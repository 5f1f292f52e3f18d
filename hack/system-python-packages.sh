#!/usr/bin/env bash
# Print what the system python3 (the first on PATH, outside any venv) has installed: `pip list -v`
# (names, versions, locations, so a re-pointed editable install shows too), or the same from
# importlib.metadata where that python3 has no pip (Debian's without python3-pip). .ci/run and
# hack/clean-debian-check.sh print it before and after a run and fail when it changed.
set -euo pipefail
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/\.venv/bin$' | paste -sd: -)
py=$(command -v python3)
echo "# $py ($("$py" -V 2>&1))"
if "$py" -c 'import pip' 2>/dev/null; then
  "$py" -m pip list -v --disable-pip-version-check 2>/dev/null
else
  echo "# no pip in this interpreter: its distributions from importlib.metadata"
  "$py" -c 'import importlib.metadata as m
found = sorted(m.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
for d in found:
    print(d.metadata["Name"], d.version, d.locate_file(""))
if not found:
    print("# (none)")'
fi
