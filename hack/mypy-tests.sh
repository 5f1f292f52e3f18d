#!/usr/bin/env bash
# mypy over tests/, one run per test layer (`make lint` runs it after the package's run).
# Why one run per layer, not one run over tests/: pytest imports the test folders in its default
# "prepend" mode (no __init__.py in them), so each folder is its own import root. Its conftest.py is the
# top-level module `conftest` and its modules import their siblings by bare name (`from simulator
# import ...`). mypy gives one module name to each file, so in a single run the layers' conftest.py
# collide ("Duplicate module named 'conftest'") and a bare sibling import resolves only with its folder
# on the search path. Each run adds its one folder to mypy_path ([tool.mypy] in pyproject.toml) and
# checks that folder's files with the same settings; tests/support, tests/conftest.py and bench/ are
# importable packages and modules, checked with the package in [tool.mypy] files.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LAYERS=(${MYPY_TEST_LAYERS:-unit dataplane e2e reliability vm vm/guest})
status=0
for layer in "${LAYERS[@]}"; do
  dir=tests/$layer
  echo "==> mypy $dir"
  MYPYPATH=$dir "$PYTHON" -m mypy "$dir"/*.py || status=1
done
exit $status
