"""Build the pinned upstream binaries (control plane, kube-proxy, kubectl, etcd) once and cache them.

The first build compiles most of Kubernetes and takes many minutes on a small
machine, so it prints which binary it is on and how long it has run; later calls
find the stamp file and return at once. The cache folder is named by a hash of
everything that decides the output (go.mod, go.sum, cmd/, the ldflags), so a
changed pin builds into a fresh folder and never mixes versions.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from localcluster import paths
from proxyshift.commands import CommandError, run

# Built by one `go build` (see _go_build); the order is only that of the progress output.
K8S_COMMANDS = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
}
BINARIES = (*K8S_COMMANDS, "etcd")
STAMP_NAME = ".complete"
HEARTBEAT_SECONDS = 30.0
BUILD_TIMEOUT_SECONDS = 3 * 3600.0


class BuildError(RuntimeError):
    """The Go build failed or its inputs are not where they should be."""


@dataclass(frozen=True)
class Pins:
    kubernetes_version: str
    kubernetes_release_time: str
    etcd_version: str


def _module_version(go_mod: str, module: str) -> str:
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v\S+)", go_mod, re.M)
    if not match:
        raise BuildError(f"{module} is not required in localcluster/go.mod (run localcluster/pin.py)")
    return match.group(1)


def _release_time(module_dir: Path, version: str) -> str:
    """The release's tag time from the module cache, used as buildDate.

    A wall-clock build date would change the ldflags, hence the pin hash, on
    every call; the tag time is what the release itself carries and is stable.
    """
    out = run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
              timeout=900, env=_go_env())
    info = json.loads(out.stdout).get("Info")
    if not info:
        raise BuildError(f"go mod download gave no .info for k8s.io/kubernetes@{version}")
    stamp = json.loads(Path(info).read_text())["Time"]
    return stamp.replace(".000000000", "").replace("+00:00", "Z")


def read_pins(module_dir: Path | None = None) -> Pins:
    module_dir = module_dir or paths.go_module_dir()
    go_mod = (module_dir / "go.mod").read_text()
    version = _module_version(go_mod, "k8s.io/kubernetes")
    return Pins(
        kubernetes_version=version,
        kubernetes_release_time=_release_time(module_dir, version),
        etcd_version=_module_version(go_mod, "go.etcd.io/etcd/server/v3"),
    )


def ldflags(pins: Pins) -> str:
    """-X stamps so `--version` prints the pinned release, as the upstream Makefile would.

    One string serves every binary: -X of a package a binary does not link is
    ignored by the Go linker.
    """
    major, minor, _patch = pins.kubernetes_version.removeprefix("v").split(".", 2)
    k8s = {
        "gitVersion": pins.kubernetes_version,
        "gitMajor": major,
        "gitMinor": minor,
        # The module zip carries no commit; "unknown" is honest and parses as a string.
        "gitCommit": "unknown",
        "gitTreeState": "clean",
        "buildDate": pins.kubernetes_release_time,
    }
    flags = ["-s", "-w"]  # no symbol tables: the binaries shrink by a third
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.{key}={value}" for key, value in k8s.items()]
    flags.append(f"-X go.etcd.io/etcd/api/v3/version.GitSHA=module-{pins.etcd_version}")
    return " ".join(flags)


def pin_hash(module_dir: Path, flags: str) -> str:
    digest = hashlib.sha256()
    inputs = [module_dir / "go.mod", module_dir / "go.sum"]
    inputs += sorted(p for p in (module_dir / "cmd").rglob("*") if p.is_file())
    for path in inputs:
        digest.update(str(path.relative_to(module_dir)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    digest.update(flags.encode())
    return digest.hexdigest()[:16]


def bin_dir_for(module_dir: Path | None = None) -> Path:
    """The cache folder the current pins build into (whether or not it is built yet)."""
    module_dir = module_dir or paths.go_module_dir()
    return paths.cache_root() / pin_hash(module_dir, ldflags(read_pins(module_dir))) / "bin"


def is_complete(bin_dir: Path) -> bool:
    return (bin_dir / STAMP_NAME).is_file() and all((bin_dir / name).is_file() for name in BINARIES)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Static binaries (they run inside bare network namespaces), no VCS lookup
    # (the module is not a checkout of Kubernetes), and no stray go.work.
    env.update({"CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false", "GOWORK": "off"})
    return env


def _say(message: str) -> None:
    print(f"[localcluster build] {message}", file=sys.stderr, flush=True)


def _go_build(module_dir: Path, packages: dict[str, str], output_dir: Path, flags: str, log_path: Path) -> None:
    """One `go build -o <dir>/ pkg...` for every binary.

    One command instead of one per binary: Go then links a finished binary while it still compiles
    the packages of the next, and both cores stay busy through the tails where a single binary's
    build runs one compile at a time. Measured on the 2-core CI machine with a warm build cache
    (links only): 62 s as six commands, 40 s as one.
    """
    names = list(packages)
    argv = ["go", "build", "-trimpath", "-ldflags", flags, "-o", f"{output_dir}/", *packages.values()]
    started = time.monotonic()
    linked: list[str] = []
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        # A build runs for minutes: Popen + heartbeat instead of commands.run, so
        # the user sees it is alive and which binaries are linked so far.
        proc = subprocess.Popen(argv, cwd=module_dir, env=_go_env(),  # noqa: S603
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    proc.wait(timeout=HEARTBEAT_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - started
                    if elapsed > BUILD_TIMEOUT_SECONDS:
                        raise BuildError(f"go build exceeded {BUILD_TIMEOUT_SECONDS:g}s") from None
                    for name in names:
                        if name not in linked and (output_dir / name).exists():
                            linked.append(name)
                            _say(f"[{len(linked)}/{len(names)}] {name} linked ({elapsed:.0f}s)")
                    waiting = [name for name in names if name not in linked]
                    _say(f"  still building {', '.join(waiting)} ({elapsed:.0f}s)")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise BuildError(f"go build exited {proc.returncode}; log {log_path}:\n{tail}")


def build(*, force: bool = False, module_dir: Path | None = None) -> Path:
    """Build (if needed) the six binaries and return the folder that holds them."""
    module_dir = module_dir or paths.go_module_dir()
    if not (module_dir / "go.mod").is_file():
        raise BuildError(f"no Go module at {module_dir} (set PROXYSHIFT_REPO to the checkout)")
    try:
        pins = read_pins(module_dir)
    except CommandError as exc:
        raise BuildError(f"cannot read the pinned release: {exc}") from exc
    flags = ldflags(pins)
    bin_dir = paths.cache_root() / pin_hash(module_dir, flags) / "bin"
    if is_complete(bin_dir) and not force:
        return bin_dir
    bin_dir.mkdir(parents=True, exist_ok=True)
    # Two builds of one pin (two terminals, parallel test sessions) would write
    # the same temporary files; the second waits and then finds the stamp.
    with (bin_dir.parent / ".build.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"another build of these pins is running; waiting for it ({bin_dir})")
            fcntl.flock(lock, fcntl.LOCK_EX)
            if is_complete(bin_dir) and not force:
                return bin_dir
        return _build_locked(module_dir, pins, flags, bin_dir)


def _build_locked(module_dir: Path, pins: Pins, flags: str, bin_dir: Path) -> Path:
    (bin_dir / STAMP_NAME).unlink(missing_ok=True)
    log_path = bin_dir.parent / "build.log"
    packages = {**K8S_COMMANDS, "etcd": "./cmd/etcd"}
    _say(f"building Kubernetes {pins.kubernetes_version} + etcd {pins.etcd_version} into {bin_dir}")
    _say(f"(the first build compiles Kubernetes and takes a long time; log: {log_path})")
    total = time.monotonic()
    # `go build -o <dir>/` names each binary after its package's last path element.
    misnamed = [name for name, package in packages.items() if package.rsplit("/", 1)[-1] != name]
    if misnamed:
        raise BuildError(f"binaries not named after their package's last element: {misnamed}")
    # Built into a scratch folder, then renamed: an interrupted build never leaves a truncated
    # binary in bin/ that looks complete (tests that glob the cache for binaries look there).
    partial = bin_dir.parent / ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    _say(f"{len(packages)} binaries in one go build: {', '.join(packages)}")
    _go_build(module_dir, packages, partial, flags, log_path)
    missing = [name for name in packages if not (partial / name).is_file()]
    if missing:
        raise BuildError(f"go build succeeded but left no {', '.join(missing)} in {partial}; log {log_path}")
    for name in packages:
        (partial / name).replace(bin_dir / name)
    partial.rmdir()
    (bin_dir / STAMP_NAME).write_text(json.dumps({
        "kubernetes": pins.kubernetes_version, "etcd": pins.etcd_version, "ldflags": flags,
        "seconds": round(time.monotonic() - total, 1),
    }, indent=2) + "\n")
    _say(f"all binaries built in {time.monotonic() - total:.0f}s")
    return bin_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcluster.build",
                                     description="Build the pinned Kubernetes binaries; print their folder.")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache is complete")
    args = parser.parse_args(argv)
    try:
        print(build(force=args.force))
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
