#!/usr/bin/env bash
# mypy over tests/, one run per test layer (`make lint` runs it after the package's run).
# Why one run per layer, not one run over tests/: pytest imports the test folders in its default
# "prepend" mode (no __init__.py in them), so each folder is its own import root. Its conftest.py is the
# top-level module `conftest` and its modules import their siblings by bare name (`from simulator
# import ...`). mypy gives one module name to each file, so in a single run the layers' conftest.py
# collide ("Duplicate module named 'conftest'") and a bare sibling import resolves only with its folder
# on the search path. Each run adds its one folder to mypy_path ([tool.mypy] in pyproject.toml) and
# checks that folder's files with the same settings; tests/support, tests/conftest.py and bench/ are
# importable packages and modules, checked with the package in [tool.mypy] files. (mypy has no per-folder
# search path in its config, and naming the files tests.unit.x would leave `from simulator import` unresolved.)
# The runs share .mypy_cache, so the package they all import is analysed once; MYPY_TEST_LAYERS picks layers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ALL_LAYERS="unit dataplane e2e reliability vm vm/guest"
# shellcheck disable=SC2206  # the list splits on spaces
LAYERS=(${MYPY_TEST_LAYERS:-$ALL_LAYERS})
# A new test folder must join the list, or its files would go unchecked without anyone noticing.
for dir in $(find tests -name '*.py' -not -path 'tests/support/*' -printf '%h\n' | sort -u); do
  [ "$dir" = tests ] && continue  # tests/conftest.py: in [tool.mypy] files
  case " $ALL_LAYERS " in
    *" ${dir#tests/} "*) ;;
    *) echo "hack/mypy-tests.sh: $dir is not in ALL_LAYERS" >&2; exit 1 ;;
  esac
done
status=0
for layer in "${LAYERS[@]}"; do
  dir=tests/$layer
  echo "==> mypy $dir"
  MYPYPATH=$dir "$PYTHON" -m mypy "$dir"/*.py || status=1
done
exit $status
