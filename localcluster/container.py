"""A tiny container launcher for the node simulator, plus network-namespace helpers.

Run as::

    python -m localcluster.container --netns ps-node-1 \\
        --bind /state/.../volumes/kube-proxy:/var/lib/kube-proxy:ro -- kube-proxy --config=...

It joins the node's cgroup v2 subtree (`--cgroup`: a node's Cilium agent attaches socket-LB
there, localcluster.cilium) and network namespace, enters a private mount namespace,
bind-mounts each volume at its mountPath there (so two nodes' kube-proxies can
both read /var/lib/kube-proxy/config.conf without touching the host's view), and
execs the command, so the pid the simulator recorded is the container's pid.

The securityContext (worked out by localcluster/security_context.py) is applied
last: `--read-only-root` remounts every mount but /proc, /sys, /dev and the
volumes read-only; `--uid/--gid/--caps/--no-new-privs` exec the command through
util-linux's setpriv, which sets the ids, the bounding, inheritable and ambient
capability sets and no_new_privs in one well-tested step. `--expose` makes the
"image" (this interpreter and checkout) reachable for a non-root user when it
lives under a private folder such as /root: a tmpfs over that folder holds the
exposed paths only, bound back read-only, as an image holds only its own files.

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
from typing import TypeVar, cast

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

NETNS_DIR = Path("/run/netns")
# Left writable by --read-only-root, as a container runtime leaves them: the kernel's views and /dev.
WRITABLE_SYSTEM_MOUNTS = ("/proc", "/sys", "/dev")

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
        raise cast(BaseException, box["error"])
    return cast(T, box["result"])


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


def _searchable(path: Path, uid: int, gid: int) -> bool:
    st = path.stat()
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid == gid:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def expose(paths: list[str], uid: int, gid: int) -> None:
    """Make each path reachable for uid:gid when a folder above it is private (e.g. /root, 0700).

    The top-most such folder gets a tmpfs of its own in this mount namespace, holding only the
    exposed paths, each bound back read-only: nothing else under it is visible, as in an image."""
    plan: dict[Path, list[tuple[int, Path]]] = {}
    try:
        for text in paths:
            path = Path(text).resolve()
            blocked = next((a for a in reversed(path.parents) if a != Path("/") and not _searchable(a, uid, gid)),
                           None)
            if blocked is None:
                continue
            plan.setdefault(blocked, []).append((os.open(path, os.O_PATH | os.O_CLOEXEC), path))
        for folder, entries in sorted(plan.items(), key=lambda item: len(item[0].parts)):
            _mount("tmpfs", str(folder), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
            for fd, path in sorted(entries, key=lambda entry: len(entry[1].parts)):
                path.mkdir(parents=True, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", str(path), None, MS_BIND | MS_REC)
                _mount(None, str(path), None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            # The tmpfs itself read-only too: the image's folders are not the container's to write.
            _mount(None, str(folder), None, MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_RDONLY)
    finally:
        for entries in plan.values():
            for fd, _ in entries:
                os.close(fd)


def _mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of this mount namespace, parents first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        # Octal escapes (\040 for a space) as the kernel writes them.
        point = fields[4].encode().decode("unicode_escape")
        points.append((point, set(fields[5].split(","))))
    return points


def _under(path: str, roots: tuple[str, ...] | list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def read_only_root(writable: list[str]) -> None:
    """Remount every mount read-only except the kernel's views, /dev and the writable volumes."""
    for point, options in _mount_points():
        if "ro" in options or _under(point, WRITABLE_SYSTEM_MOUNTS) or _under(point, writable):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= (MS_NOSUID if "nosuid" in options else 0) | (MS_NODEV if "nodev" in options else 0)
        flags |= MS_NOEXEC if "noexec" in options else 0
        try:
            _mount(None, point, None, flags)
        except OSError as exc:
            # A mount point hidden under a later mount cannot be reached by its path; what hides it
            # is remounted in its own turn.
            print(f"container: warning: {point} stays as it was: {exc}", file=sys.stderr)


def setpriv_argv(uid: int | None, gid: int | None, caps: str | None, no_new_privs: bool) -> list[str]:
    """The setpriv prefix that drops to uid:gid with exactly `caps` (comma list, "" for none)."""
    argv = ["setpriv"]
    if gid is not None:
        argv += ["--regid", str(gid), "--clear-groups"]
    if uid is not None:
        argv += ["--reuid", str(uid)]
    if caps is not None:
        wanted = "".join(f",+{c.strip().lower()}" for c in caps.split(",") if c.strip())
        for kind in ("--bounding-set", "--inh-caps", "--ambient-caps"):
            argv += [kind, f"-all{wanted}"]
    if no_new_privs:
        argv.append("--no-new-privs")
    return [*argv, "--"]


def _remount_sys(netns: str) -> None:
    # Like `ip netns exec`: /sys/class/net should list the node's interfaces, not the host's.
    try:
        _check(_libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
        _mount(netns, "/sys", "sysfs", 0)
    except OSError as exc:
        print(f"container: warning: could not remount /sys for {netns}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="localcluster.container", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--netns", help="network namespace to join (a name under /run/netns)")
    parser.add_argument("--cgroup", type=Path, help="cgroup v2 directory to join first (the node's: a Cilium "
                                                    "agent's socket-LB there translates the container's connects)")
    parser.add_argument("--bind", action="append", default=[], metavar="SRC:DST[:ro]")
    parser.add_argument("--workdir", default="/")
    parser.add_argument("--created-log", type=Path,
                        help="append every host path created as a mount point to this file")
    parser.add_argument("--uid", type=int, help="run the command as this user (runAsUser)")
    parser.add_argument("--gid", type=int, help="and this group (runAsGroup), with no supplementary groups")
    parser.add_argument("--caps", help="exactly these capabilities, comma-separated (empty: none); "
                                       "default: keep every one (privileged)")
    parser.add_argument("--no-new-privs", action="store_true", help="allowPrivilegeEscalation: false")
    parser.add_argument("--read-only-root", action="store_true", help="readOnlyRootFilesystem: true")
    parser.add_argument("--expose", action="append", default=[], metavar="PATH",
                        help="make PATH (the image's files) reachable for --uid below a private folder")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    binds = [parse_bind(spec) for spec in args.bind]

    if args.cgroup:
        (args.cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
    if args.netns:
        setns(args.netns)
    unshare_mounts()
    if args.netns:
        _remount_sys(args.netns)
    created: list[Path] = []
    # Opened before the binds: a bind over /tmp would otherwise swallow the record.
    record = args.created_log.open("a") if args.created_log else None
    try:
        if args.expose and args.uid not in (None, 0):
            expose(args.expose, args.uid, args.gid if args.gid is not None else 0)
        apply_binds(binds, created)
    finally:
        if record is not None:
            with contextlib.suppress(OSError), record:
                record.writelines(f"{path}\n" for path in created)
    if args.read_only_root:
        read_only_root([dst for _src, dst, read_only in binds if not read_only])
    os.chdir(args.workdir)
    if args.uid is not None or args.gid is not None or args.caps is not None or args.no_new_privs:
        command = [*setpriv_argv(args.uid, args.gid, args.caps, args.no_new_privs), *command]
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"container: cannot exec {command[0]}: {exc}", file=sys.stderr)
        raise SystemExit(127) from exc


if __name__ == "__main__":
    main()
