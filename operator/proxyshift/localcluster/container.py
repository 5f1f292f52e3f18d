"""A tiny container launcher for the node simulator, plus network-namespace helpers.

Run as::

    python -m proxyshift.localcluster.container --netns ps-node-1 \\
        --bind /state/.../volumes/kube-proxy:/var/lib/kube-proxy:ro -- kube-proxy --config=...

It joins the node's network namespace, enters a private mount namespace,
bind-mounts each volume at its mountPath there (so two nodes' kube-proxies can
both read /var/lib/kube-proxy/config.conf without touching the host's view), and
execs the command, so the pid the simulator recorded is the container's pid.

Network namespace entry is a setns(2) here rather than `ip netns exec`: the
launcher must already be inside the node's network namespace when it remounts
/sys (a sysfs mount shows the namespace of whoever mounts it), the order of the
steps is then ours rather than iproute2's, and there is one exec instead of two.

Python 3.11 has no os.unshare/os.setns, hence ctypes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

NETNS_DIR = Path("/run/netns")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

T = TypeVar("T")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(netns: str) -> None:
    """Move the calling thread into the named network namespace (made by `ip netns add`)."""
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns({netns})")
    finally:
        os.close(fd)


def unshare_mounts() -> None:
    """Enter a private mount namespace whose mounts never propagate back to the host."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Without this, a shared root (systemd's default) would copy our binds into the host.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(value: str | None) -> bytes | None:
        return value.encode() if value is not None else None

    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount({source!r} -> {target!r})")


def run_in_netns(netns: str, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Call fn on a fresh thread that lives in `netns`, and return its result.

    setns(CLONE_NEWNET) changes only the calling thread, and sockets keep the
    namespace they were made in, so a short-lived thread is the cheapest way for
    a multi-threaded process (the simulator, pytest) to act inside a node.
    """
    box: dict[str, object] = {}

    def body() -> None:
        try:
            setns(netns)
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def parse_bind(spec: str) -> tuple[str, str, bool]:
    """SRC:DST[:ro] -> (src, dst, read_only)."""
    parts = spec.split(":")
    read_only = False
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        read_only = parts[2] == "ro"
        parts = parts[:2]
    if len(parts) != 2 or not parts[0] or not parts[1].startswith("/"):
        raise ValueError(f"bad --bind {spec!r}: want SRC:/ABS/DST[:ro]")
    return parts[0], parts[1], read_only


def _ensure_target(src_is_dir: bool, dst: Path, created: list[Path]) -> None:
    """Create the mount point (a dir for a dir, an empty file for a file), noting what was new.

    The new paths are visible on the host (mkdir is not namespaced); they are
    reported so `down` can remove them.
    """
    missing = []
    parent = dst if src_is_dir else dst.parent
    probe = parent
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    parent.mkdir(parents=True, exist_ok=True)
    created.extend(reversed(missing))
    if not src_is_dir and not dst.exists():
        dst.touch()
        created.append(dst)


def apply_binds(binds: list[tuple[str, str, bool]], created: list[Path]) -> None:
    # Every source is opened before the first mount: an emptyDir bound over /tmp would
    # otherwise hide the sources of the later binds (the state dir lives under /tmp).
    opened = []
    try:
        for src, dst, read_only in binds:
            if not Path(src).exists():
                raise FileNotFoundError(f"bind source {src} does not exist")
            opened.append((os.open(src, os.O_PATH | os.O_CLOEXEC), src, dst, read_only))
        # Shallow targets first, so a bind under another bind lands on top of it.
        for fd, _src, dst, read_only in sorted(opened, key=lambda b: b[2].rstrip("/").count("/")):
            _ensure_target(stat.S_ISDIR(os.fstat(fd).st_mode), Path(dst), created)
            _mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
            if read_only:
                _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    finally:
        for fd, *_ in opened:
            os.close(fd)


def _remount_sys(netns: str) -> None:
    # Like `ip netns exec`: /sys/class/net should list the node's interfaces, not the host's.
    try:
        _check(_libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
        _mount(netns, "/sys", "sysfs", 0)
    except OSError as exc:
        print(f"container: warning: could not remount /sys for {netns}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="proxyshift.localcluster.container", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--netns", help="network namespace to join (a name under /run/netns)")
    parser.add_argument("--bind", action="append", default=[], metavar="SRC:DST[:ro]")
    parser.add_argument("--workdir", default="/")
    parser.add_argument("--created-log", type=Path,
                        help="append every host path created as a mount point to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    binds = [parse_bind(spec) for spec in args.bind]

    if args.netns:
        setns(args.netns)
    unshare_mounts()
    if args.netns:
        _remount_sys(args.netns)
    created: list[Path] = []
    # Opened before the binds: a bind over /tmp would otherwise swallow the record.
    record = args.created_log.open("a") if args.created_log else None
    try:
        apply_binds(binds, created)
    finally:
        if record is not None:
            with contextlib.suppress(OSError), record:
                record.writelines(f"{path}\n" for path in created)
    os.chdir(args.workdir)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"container: cannot exec {command[0]}: {exc}", file=sys.stderr)
        raise SystemExit(127) from exc


if __name__ == "__main__":
    main()
