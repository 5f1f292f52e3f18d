"""`proxyshift` command line: one entry point, each subcommand in the module that owns the job.

Installed twice: as `proxyshift` and as `kubectl-proxyshift`, the name kubectl looks for on PATH so that
`kubectl proxyshift status` runs `kubectl-proxyshift status`. Exit codes (docs/cli.md): 0 done or
healthy, 1 not ready (or a node will fail preflight), 2 usage or input error, 130 interrupted.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_INTERRUPTED = 130  # what a shell reports for a command stopped with Ctrl-C (128 + SIGINT)

# subcommand -> (module, function, one-line help). Modules are imported lazily so
# `proxyshift crds` does not pay for kopf and `proxyshift agent` not for the planner.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "operator": ("proxyshift.controller.main", "main", "run the operator (kopf)"),
    "agent": ("proxyshift.agent.loop", "main", "run the node agent for one node"),
    "probe-server": ("proxyshift.agent.probe_server", "main",
                     "serve the behaviour probe's pod path (runs in the proxyshift-probe DaemonSet)"),
    "status": ("proxyshift.controller.status_view", "main", "show a policy's rollout"),
    "plan": ("proxyshift.controller.plan_view", "main", "show what a policy would do, change nothing"),
    "diagnose": ("proxyshift.controller.diagnose_view", "main",
                 "a Service's load per endpoint from the nodes' kernel counters, and why it is uneven"),
    "crds": ("proxyshift.api.crdgen", "main", "generate (or --check) the CRD YAML under crds/"),
    "crd-check": ("proxyshift.controller.crd_check", "main",
                  "whether a cluster's CRDs hold everything this version writes (before an upgrade)"),
    "restore-baseline": ("proxyshift.controller.restore", "main",
                         "uninstall: undo the affinity proxyshift added to the baseline kube-proxy"),
}


def invoked_as() -> str:
    """How the person typed the command: `kubectl proxyshift` when kubectl ran us as its plugin."""
    return "kubectl proxyshift" if Path(sys.argv[0]).name.startswith("kubectl-") else "proxyshift"


def usage() -> str:
    lines = [f"usage: {invoked_as()} <command> [args]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] == "--version":
        from proxyshift import __version__

        print(__version__)
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"proxyshift: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = entry
    from proxyshift.manifest import UsageError

    try:
        # Importing reads the PROXYSHIFT_* settings: a bad one is a UsageError too.
        handler: Callable[[list[str]], int | None] = getattr(importlib.import_module(module), function)
        return int(handler(args[1:]) or 0)
    except UsageError as exc:
        print(f"proxyshift {args[0]}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # `status --watch` runs until Ctrl-C: that is how it ends, not a crash worth a traceback.
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
