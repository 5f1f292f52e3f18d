#!/usr/bin/env bash
# `make test`: lint and every test layer, with the Go builds overlapped with lint, the unit layer and,
# for the slowest one, the cluster layers that do not need it.
#
# On a machine without the cached binaries the Go builds (the Kubernetes binaries and etcd, then the
# tests' Go tools) take minutes of both cores, while lint and the unit layer run on about one core
# and need none of it but the unit layer's two small tools (argocd-health-runner, helm). So:
#
#   background (nice 10): the unit layer's tools, then `localcluster.build`
#   foreground:           lint, crds-check, the unit layer (waits for its two tools, built first)
#   then:                 wait for those builds (their log is printed; a failed build fails the run);
#   background (nice 19): the other tools (the Cilium agent: ~7 minutes of both cores cold)
#   foreground:           every other layer but the Cilium tests (`-m "not unit and not cilium"`:
#                         dataplane, e2e, reliability, vm), which wait on timeouts and processes more
#                         than they compute, so the niced build takes the idle CPU
#   then:                 wait for the Cilium build, and the tests that run its agent (`-m cilium`)
#
# The build commands are the ones `make binaries` runs, with their cache stamps and locks: a
# foreground command that needs a binary the background is building waits on the same lock and then
# finds it. With everything cached the builds return within seconds and this is the old order.
# Arguments go to every pytest session (e.g. a path to narrow a trial run); `make test` passes none.
# Usage: PYTHON=.venv/bin/python MAKE=make hack/test-all.sh [PYTEST-ARGS...]
set -euo pipefail
# One function, called on the last line: bash reads a script as it runs it, and this one runs for most
# of an hour; a checkout or an edit of the file meanwhile must not change what the running one does.
# A background build's log, printed from its start while it runs; returns the build's exit code.
await_build() {
  local pid=$1 log=$2 follow status=0
  tail -n +1 -f --pid="$pid" "$log" &
  follow=$!
  wait "$pid" || status=$?
  wait "$follow" || true
  return "$status"
}

main() {
  cd "$(dirname "$0")/.."
  : "${PYTHON:?PYTHON names the interpreter (make test sets it)}"
  MAKE=${MAKE:-make}
  PYTEST=("$PYTHON" -m pytest)
  UNIT_GO_TOOLS=(argocd-health-runner helm)

  log=$(mktemp -t proxyshift-go-builds.XXXXXX)
  started=$(date +%s)
  # Job control on: the background job gets its own process group, so an early exit (lint failed,
  # Ctrl-C) stops its `go build` with it rather than leaving it running.
  set -m
  (
    set -e
    nice -n 10 "$PYTHON" -m localcluster.gotools "${UNIT_GO_TOOLS[@]}"
    nice -n 10 "$PYTHON" -m localcluster.build
  ) >"$log" 2>&1 &
  builds=$!
  set +m
  tools=""
  tools_log=$(mktemp -t proxyshift-go-tools.XXXXXX)
  cleanup() {
    if [[ -n $builds ]]; then kill -- -"$builds" 2>/dev/null || true; fi
    if [[ -n $tools ]]; then kill -- -"$tools" 2>/dev/null || true; fi
    rm -f "$log" "$tools_log"
  }
  trap cleanup EXIT
  echo "==> Go builds started in the background (pid $builds, log $log)"

  "$MAKE" --no-print-directory lint crds-check
  "$PYTHON" -m localcluster.gotools "${UNIT_GO_TOOLS[@]}"
  unit=0
  "${PYTEST[@]}" -m unit --durations=10 "$@" || unit=$?
  echo "==> unit layer exited $unit at $(( $(date +%s) - started ))s; waiting for the Go builds:"

  build=0
  await_build "$builds" "$log" || build=$?
  builds=""
  echo "==> Go builds exited $build at $(( $(date +%s) - started ))s"
  if (( build != 0 )); then
    echo "==> FAIL: a Go build failed (log above); the layers that run the binaries did not run" >&2
    exit "$build"
  fi

  set -m
  # every other tool (the Cilium agent): what `make binaries` builds besides
  nice -n 19 "$PYTHON" -m localcluster.gotools >"$tools_log" 2>&1 &
  tools=$!
  set +m
  echo "==> Go tools (the Cilium agent) building in the background (pid $tools, log $tools_log)"

  rest=0
  "${PYTEST[@]}" -m "not unit and not cilium" --durations=40 "$@" || rest=$?
  echo "==> the cluster layers but Cilium's exited $rest at $(( $(date +%s) - started ))s; waiting for the Go tools:"

  tool=0
  await_build "$tools" "$tools_log" || tool=$?
  tools=""
  echo "==> Go tools exited $tool at $(( $(date +%s) - started ))s"
  cilium=0
  if (( tool != 0 )); then
    echo "==> FAIL: a Go tool's build failed (log above); the tests that run the Cilium agent did not run" >&2
    cilium=$tool
  else
    # Exit code 5: nothing collected (a narrowed trial run without Cilium tests), not a failure.
    "${PYTEST[@]}" -m cilium --durations=10 "$@" || cilium=$?
    if (( cilium == 5 )); then cilium=0; fi
  fi
  echo "==> unit layer exited $unit, the other layers $rest, the Cilium tests $cilium, in $(( $(date +%s) - started ))s"
  (( unit == 0 && rest == 0 && cilium == 0 ))
}

main "$@"
