"""Run one command as root inside a QEMU guest with a stock Debian kernel (IPVS, dummy, modules).

Test-bed code, not product code. The host kernel has no IPVS, so the tests
that need one run here: `run_in_vm(argv, cwd=..., env=...)` boots the kernel
that `vmkernel.prepare()` keeps ready, runs `argv` and returns its exit code
and output.

The guest:

- sees the host's `/` read-only over virtio-9p, under a tmpfs overlay: it runs
  the host's own Python, tools and checkout, and whatever it writes stays in
  guest memory and is gone at power-off. /tmp and /run are tmpfs of its own, so
  an xtables lock, a network namespace or a cluster state folder in the guest
  never meets the host's;
- has the unpacked kernel's modules as its /lib/modules (a second share), so
  `modprobe ip_vs` works;
- has no network device at all (`-nic none`): nothing can leave it. Only when asked (`tap=`), one
  virtio-net NIC on a tap device the caller made and put on the local cluster's bridge, for the
  guest's cluster nodes (localcluster.vmnodes); the guest then has no route out of 198.18.0.0/15;
- writes the command's output (stdout and stderr, merged) to a virtio serial
  port, which QEMU appends to a host file that we stream while it runs, and its
  exit code into a third, per-run share (`GUEST_RUN_DIR` inside), where the
  caller may also leave or pick up files (e.g. a junit XML).

QEMU runs under KVM only when a bounded probe shows that a stock kernel boots under it
(localcluster.vmaccel; cached once per machine), else under TCG (full emulation): this
machine's /dev/kvm is a PVM host on which a stock kernel never boots under -enable-kvm.
PROXYSHIFT_VM_ACCEL=tcg|kvm overrides the probe. A run that exceeds its timeout kills QEMU by
its pid.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from localcluster import vmaccel, vmkernel
from proxyshift.commands import stop_child

GUEST_RUN_DIR = "/run/proxyshift-vm"
OUTPUT_PORT = "proxyshift.out"
# Defaults that leave room beside the host's own work on 2 cores / 24 GiB: guest memory is
# only taken from the host as the guest touches it (about 1.5 GiB for the dataplane tests).
DEFAULT_MEMORY_MIB = 4096
DEFAULT_CPUS = 2
DEFAULT_TIMEOUT_SECONDS = 900.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KERNEL_CMDLINE = "console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init"
POLL_SECONDS = 0.2
NETDEV_ID = "psnet"
# Locally administered (02:...), 198.18.4.1's octets: the one NIC of a networked guest.
GUEST_MAC = "02:00:c6:12:04:01"


class OutputStream(Protocol):
    """Where the guest's output goes while it runs (a text file, sys.stderr, a tee of both)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class VmError(RuntimeError):
    """The guest could not be booted or did not report an exit code."""


@dataclass(frozen=True)
class VmResult:
    returncode: int | None  # None: the guest never reported one (timeout, crash)
    output: str
    timed_out: bool
    seconds: float
    console: str            # the kernel's and /init's messages (ttyS0)
    qemu_rss_mib: float | None  # QEMU's peak RSS, from the kernel's accounting of the reaped child
    accel: vmaccel.Accel = "tcg"

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def default_memory_mib() -> int:
    return _env_int("PROXYSHIFT_VM_MEMORY_MIB", DEFAULT_MEMORY_MIB)


def default_cpus() -> int:
    return _env_int("PROXYSHIFT_VM_CPUS", DEFAULT_CPUS)


STAGE2_TEMPLATE = Path(__file__).with_name("vm_stage2.sh")


def stage2_script(argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> str:
    """The guest's PID 1 after switch_root (vm_stage2.sh): finish the mounts, run argv, report, power off.

    Every value is shell-quoted into the template: the command and environment reach the guest's
    `env -i` exactly as given.
    """
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    command = " ".join(shlex.quote(a) for a in argv)
    text = STAGE2_TEMPLATE.read_text()
    for key, value in (("@OUTPUT_PORT@", OUTPUT_PORT), ("@RUN_DIR@", GUEST_RUN_DIR), ("@CWD@", shlex.quote(cwd)),
                       ("@ENV@", assignments), ("@COMMAND@", command)):
        text = text.replace(key, value)
    return text


def network_argv(tap: str | None, mac: str = GUEST_MAC) -> list[str]:
    """No network device at all, or one virtio-net NIC on an existing tap device (no QEMU scripts:
    the caller made the tap and put it on the bridge, and removes it)."""
    if tap is None:
        return ["-nic", "none"]  # no network device at all: nothing the guest does can leave it
    if not tap or "," in tap or len(tap) > 15:
        raise ValueError(f"bad tap device name {tap!r}")
    return ["-netdev", f"tap,id={NETDEV_ID},ifname={tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev={NETDEV_ID},mac={mac}"]


def qemu_argv(kernel: vmkernel.GuestKernel, run_share: Path, output: Path, console: Path, *,
              memory_mib: int, cpus: int, accel: vmaccel.Accel, tap: str | None = None) -> list[str]:
    accel_arg = "tcg,thread=multi,tb-size=256" if accel == "tcg" else accel

    def share(tag: str, path: Path, *, readonly: bool, remap: bool = False) -> list[str]:
        opts = f"local,id={tag},path={path},security_model=none"
        opts += ",readonly=on" if readonly else ""
        # The host's / spans several filesystems; remap keeps inode numbers unique across them.
        opts += ",multidevs=remap" if remap else ""
        return ["-fsdev", opts, "-device", f"virtio-9p-pci,fsdev={tag},mount_tag={tag}"]

    return [
        "qemu-system-x86_64", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-accel", accel_arg, "-machine", "pc", "-cpu", "max", "-smp", str(cpus), "-m", f"{memory_mib}M",
        "-kernel", str(kernel.vmlinux), "-initrd", str(kernel.initramfs), "-append", KERNEL_CMDLINE,
        *network_argv(tap),
        "-serial", f"file:{console}",
        *share("hostroot", Path("/"), readonly=True, remap=True),
        *share("psmodules", kernel.modules_dir, readonly=True),
        *share("psrun", run_share, readonly=False),
        "-device", "virtio-serial-pci",
        "-chardev", f"file,id=psout,path={output}",
        "-device", f"virtserialport,chardev=psout,name={OUTPUT_PORT}",
    ]


def _say(message: str) -> None:
    print(f"[vm] {message}", file=sys.stderr, flush=True)


def run_in_vm(argv: Sequence[str], *, cwd: str | Path = "/", env: Mapping[str, str] | None = None,
              timeout: float = DEFAULT_TIMEOUT_SECONDS, memory_mib: int | None = None, cpus: int | None = None,
              run_dir: Path | None = None, stream: OutputStream | None = None,
              kernel: vmkernel.GuestKernel | None = None, tap: str | None = None,
              stop: threading.Event | None = None, accel: vmaccel.Accel | None = None) -> VmResult:
    """Boot the guest, run `argv` as root in `cwd` with exactly `env` (plus PATH/HOME defaults).

    `run_dir` (a host folder) is the guest's GUEST_RUN_DIR; without it a temporary
    one is made and removed. `stream` gets the output while it runs. `tap`: the guest's one NIC
    is on this existing tap device (default: no network device). `stop` set by another thread
    stops QEMU like a timeout does (the result then has timed_out set). `accel`: tcg or kvm; by
    default vmaccel.choose_accel decides (PROXYSHIFT_VM_ACCEL, else the cached probe verdict).
    """
    if not argv:
        raise ValueError("run_in_vm needs a command")
    kernel = kernel or vmkernel.prepare()
    if shutil.which("qemu-system-x86_64") is None:
        raise VmError("qemu-system-x86_64 not found: install qemu-system-x86 (hack/install-deps.sh)")
    guest_env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
    memory_mib = memory_mib or default_memory_mib()
    cpus = cpus or default_cpus()
    if accel is None:
        choice = vmaccel.choose_accel(kernel, probe_runner)
        _say(choice.describe())
        accel = choice.accel
    work = Path(tempfile.mkdtemp(prefix="proxyshift-vm-"))
    share = run_dir or work / "share"
    share.mkdir(parents=True, exist_ok=True)
    (share / "rc").unlink(missing_ok=True)
    (share / "stage2.sh").write_text(stage2_script(argv, str(cwd), guest_env))
    output, console = work / "output", work / "console.log"
    output.touch()
    cmd = qemu_argv(kernel, share, output, console, memory_mib=memory_mib, cpus=cpus, accel=accel, tap=tap)
    _say(f"booting {kernel.release} ({accel}, {cpus} vCPU, {memory_mib} MiB): {' '.join(shlex.quote(a) for a in argv)}")
    started = time.monotonic()
    timed_out = False
    chunks: list[str] = []
    rss: float | None = None
    try:
        with open(work / "qemu.log", "wb") as qemu_log, open(output, "rb") as reader:
            # setpriv --pdeathsig: the kernel kills QEMU when this thread dies, even by SIGKILL, which no
            # finally sees (a killed test run once left a guest running; it still held the tap and 1.5 GB).
            proc = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", *cmd],  # noqa: S603 - argument list
                                    stdin=subprocess.DEVNULL, stdout=qemu_log, stderr=subprocess.STDOUT)
            try:
                while proc.poll() is None:
                    if time.monotonic() - started > timeout:
                        timed_out = True
                        _say(f"timeout after {timeout:g}s: stopping qemu (pid {proc.pid})")
                        break
                    if stop is not None and stop.is_set():
                        timed_out = True
                        _say(f"asked to stop: stopping qemu (pid {proc.pid})")
                        break
                    _drain(reader, chunks, stream)
                    time.sleep(POLL_SECONDS)
            finally:
                # Always by its pid, also on KeyboardInterrupt or a failing stream: no qemu outlives us.
                stop_child(proc, grace=3)
                rss = _peak_rss_mib()
            _drain(reader, chunks, stream)
        seconds = time.monotonic() - started
        rc_file = share / "rc"
        returncode = int(rc_file.read_text().strip()) if rc_file.exists() and not timed_out else None
        console_text = console.read_text(errors="replace") if console.exists() else ""
        if returncode is None and not timed_out:
            qemu_text = (work / "qemu.log").read_text(errors="replace")
            raise VmError(f"the guest reported no exit code (qemu exited {proc.returncode} after {seconds:.1f}s)\n"
                          f"qemu: {qemu_text[-2000:]}\nconsole: {console_text[-4000:]}\n"
                          f"output: {''.join(chunks)[-2000:]}")
        _say(f"guest exited {returncode if not timed_out else 'timeout'} after {seconds:.1f}s")
        return VmResult(returncode=returncode, output="".join(chunks), timed_out=timed_out, seconds=seconds,
                        console=console_text, qemu_rss_mib=rss, accel=accel)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def probe_runner(kernel: vmkernel.GuestKernel, *, accel: vmaccel.Accel, timeout: float) -> vmaccel.ProbeRun:
    """vmaccel's probe boot: `true` in a small guest, through the same QEMU start, timeout and kill
    by pid as every run (a KVM guest that hangs is stopped like any other)."""
    result = run_in_vm(["true"], timeout=timeout, memory_mib=vmaccel.PROBE_MEMORY_MIB, cpus=vmaccel.PROBE_CPUS,
                       kernel=kernel, accel=accel)
    return vmaccel.ProbeRun(returncode=result.returncode, timed_out=result.timed_out, seconds=result.seconds)


def _drain(reader: BinaryIO, chunks: list[str], stream: OutputStream | None) -> None:
    data = reader.read()
    if data:
        text = data.decode(errors="replace")
        chunks.append(text)
        if stream is not None:
            stream.write(text)
            stream.flush()


def _peak_rss_mib() -> float | None:
    """Largest RSS of any reaped child so far (ru_maxrss, KiB on Linux): QEMU's, when it is the biggest."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --env {item!r}: expected NAME=VALUE")
        env[key] = value
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cwd", default=None, help="working directory in the guest (default: the current one)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment of the command (PATH, HOME, LANG and PYTHONPATH are passed by default)")
    parser.add_argument("--memory", type=int, default=None, help=f"guest MiB (default {DEFAULT_MEMORY_MIB})")
    parser.add_argument("--cpus", type=int, default=None, help=f"guest vCPUs (default {DEFAULT_CPUS})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS)
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")


def main_from_args(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("error: vm needs a command: vm -- CMD ARGS...", file=sys.stderr)
        return 2
    env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH") if k in os.environ}
    env.update(parse_env(args.env))
    try:
        result = run_in_vm(argv, cwd=args.cwd or os.getcwd(), env=env, timeout=args.timeout,
                           memory_mib=args.memory, cpus=args.cpus, stream=sys.stdout)
    except vmaccel.VmAccelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # run_in_vm has already stopped and reaped qemu in its finally.
        _say("interrupted; qemu stopped")
        return 130
    if result.timed_out:
        return 124
    return result.returncode if result.returncode is not None else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vm", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
