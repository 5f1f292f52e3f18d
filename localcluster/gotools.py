"""Small pinned Go programs the tests run (not the cluster binaries), built once and cached.

A tool is either the module's own main package or an upstream command that the module pins with a
`tool` directive in its go.mod (helm: `helm.sh/helm/v3/cmd/helm` at the version its go.mod requires).

Each tool is its own Go module in the checkout, with a committed go.sum. It builds into
`~/.cache/proxyshift/tools/<name>/<source-hash>/<name>`, the hash taken over every file of the
module and the build flags, so an edited source or pin builds into a fresh folder and a test never
runs a binary made from other sources. `make go-tools` (and so `make binaries`) builds them all; a
test that needs one calls `built(name)` and fails, rather than building during a test run, when it
is absent.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from localcluster import paths
from proxyshift.commands import CommandError, run

# The Cilium agent's cold build takes ~7 minutes of both cores; beside other work (make test builds it
# in the background, at nice 10) it exceeded 900 s, so the bound is the cluster build's order of size.
BUILD_TIMEOUT_SECONDS = 3600.0
# -mod=mod: the modules come from the proxy against the committed go.sum, with no vendor folder.
GOFLAGS = "-mod=mod -buildvcs=false"
LDFLAGS = "-s -w"
BUILD_ARGS = ("build", "-trimpath", "-ldflags", LDFLAGS)  # before each tool's own -X settings

HELM_VERSION_LDFLAGS = (
    "-X helm.sh/helm/v3/internal/version.version=v3.22.0",
    *(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersion{part}={number}"
      for pkg in ("lint/rules", "chartutil") for part, number in (("Major", 1), ("Minor", 37))),
)


@dataclass(frozen=True)
class GoTool:
    name: str
    module: str  # the module folder, relative to the checkout
    purpose: str
    # What `go build` builds inside the module: "." for a tool whose main package is the module's own,
    # or an upstream main package that the module's go.mod pins with a `tool` directive.
    package: str = "."
    # -X settings the upstream release build links in (appended to -s -w; part of the source hash).
    ldflags: tuple[str, ...] = ()
    # Build tags the upstream release build sets (part of the source hash).
    tags: tuple[str, ...] = ()


TOOLS = {
    tool.name: tool
    for tool in (
        GoTool("argocd-health-runner", "tests/tools/argocd-health-runner",
               "runs config/argocd's health script under gopher-lua as Argo CD does"),
        GoTool("helm", "tests/tools/helm", "lints and renders charts/proxyshift; installs it in the chart e2e",
               package="helm.sh/helm/v3/cmd/helm",
               # As helm's own Makefile links them: without the Kubernetes version of its client-go
               # (v0.37 -> 1.37), helm would take every cluster for 1.20 and refuse kubeVersion >=1.30.
               ldflags=HELM_VERSION_LDFLAGS),
        GoTool("cilium-agent", "tests/tools/cilium-agent",
               "Cilium's agent (kube-proxy replacement), run confined to one simulated node",
               package="github.com/cilium/cilium/daemon",
               # As Cilium's own static build: the pure-Go user lookup instead of libc's (CGO is off).
               tags=("osusergo",)),
    )
}


class GoToolError(RuntimeError):
    """The tool is unknown, its module is missing, or `go build` failed."""


def _tool(name: str) -> GoTool:
    try:
        return TOOLS[name]
    except KeyError:
        raise GoToolError(f"unknown Go tool {name!r} (known: {', '.join(sorted(TOOLS))})") from None


def module_dir(name: str) -> Path:
    return paths.repo_root() / _tool(name).module


def source_hash(module: Path, ldflags: tuple[str, ...] = (), tags: tuple[str, ...] = ()) -> str:
    """sha256 over every file of the module (names and contents) and the build flags."""
    files = sorted(p for p in module.rglob("*") if p.is_file())
    if not any(p.name == "go.mod" for p in files):
        raise GoToolError(f"no Go module at {module} (set PROXYSHIFT_REPO to the checkout)")
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(module)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    digest.update(f"{GOFLAGS}\0{' '.join(BUILD_ARGS)}".encode())
    if ldflags:  # only then: the hashes (and caches) of tools without their own flags stay as they were
        digest.update(f"\0{' '.join(ldflags)}".encode())
    if tags:
        digest.update(f"\0tags {','.join(tags)}".encode())
    return digest.hexdigest()[:16]


def binary_path(name: str) -> Path:
    """Where the binary for the current sources is (or will be) built."""
    tool = _tool(name)
    return paths.tools_cache_root() / name / source_hash(module_dir(name), tool.ldflags, tool.tags) / name


def built(name: str) -> Path | None:
    """The binary built from the current sources, or None when `make go-tools` has not built it."""
    path = binary_path(name)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build_hint(name: str) -> str:
    return (f"{name} is not built for the sources in {_tool(name).module}: run `make go-tools` "
            f"(`make binaries` does it too; needs Go and the Go module proxy)")


def _build_args(tool: GoTool) -> list[str]:
    tags = ["-tags", ",".join(tool.tags)] if tool.tags else []
    return ["build", "-trimpath", "-ldflags", " ".join((LDFLAGS, *tool.ldflags)), *tags]


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"CGO_ENABLED": "0", "GOFLAGS": GOFLAGS, "GOWORK": "off"})
    return env


def build(name: str, *, force: bool = False) -> Path:
    """Build `name` (if needed) and return the binary's path."""
    module = module_dir(name)
    output = binary_path(name)
    if output.is_file() and not force:
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    # Two sessions building the same sources: the second waits, then finds the binary.
    with (output.parent / ".build.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if output.is_file() and not force:
            return output
        # Linked to a temporary name, then renamed: an interrupted build leaves nothing that
        # `built()` would take for a finished binary.
        partial = output.with_name(f".{name}.partial")
        try:
            run(["go", "-C", str(module), *_build_args(_tool(name)), "-o", str(partial), _tool(name).package],
                timeout=BUILD_TIMEOUT_SECONDS, env=_go_env())
        except CommandError as exc:
            raise GoToolError(f"building {name} from {module}: {exc}") from exc
        partial.replace(output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcluster.gotools",
                                     description="Build the pinned Go tools the tests run; print their paths.")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: all ({', '.join(sorted(TOOLS))})")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache has the binary")
    args = parser.parse_args(argv)
    try:
        for name in args.names or sorted(TOOLS):
            print(build(name, force=args.force))
    except GoToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
