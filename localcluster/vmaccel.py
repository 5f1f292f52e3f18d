"""Which QEMU accelerator the guest boots under: KVM when a probe shows it runs a stock kernel, else TCG.

Test-bed code, not product code. /dev/kvm being there is not enough: on this project's machine it is
a PVM host, on which a stock kernel under -accel kvm never reaches its first command (it was still
decompressing after 10 minutes), while TCG gets there in 4-8 s. So the only trustworthy test is
the real thing, bounded: boot the pinned kernel under KVM running `true`, and take KVM only when
that exits 0 within PROBE_TIMEOUT_SECONDS. Everything else (no /dev/kvm, one we cannot open, QEMU
refusing KVM, the timeout) means TCG.

The verdict and its reason are cached under the VM cache folder, in a file named by a hash of what
decides it (the kernel pin, the host's kernel release, /dev/kvm's presence, the CPU's vmx/svm
flags, QEMU's version): a machine pays for the probe once, and a new kernel pin, host kernel or QEMU
probes again (deleting the file does too). No `main`: `localcluster vm -- true` prints the verdict, and this
module never imports vm (vm imports it).

PROXYSHIFT_VM_ACCEL=tcg skips all of it; PROXYSHIFT_VM_ACCEL=kvm insists on KVM and is an error,
with the probe's reason, when KVM does not work here (a hang would only show as a timeout minutes
later).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from localcluster import paths, vmkernel
from proxyshift.commands import CommandError, run

ACCEL_ENV = "PROXYSHIFT_VM_ACCEL"
# Well above TCG's 4-8 s (9-11 s at load 4) to the first guest command: a working KVM is faster
# than TCG, so it passes easily; a PVM host's hang costs this once per machine.
PROBE_TIMEOUT_SECONDS = 25.0
# A small guest: the probe only runs `true`.
PROBE_MEMORY_MIB = 512
PROBE_CPUS = 1
CACHE_VERSION = 1
QEMU_VERSION_TIMEOUT_SECONDS = 10.0
QEMU_VERSION_MAX_CHARS = 4096
# Reading /proc/cpuinfo: the flags line comes early; 1 MiB is far more than one CPU's block.
CPUINFO_MAX_BYTES = 1024 * 1024

Accel = Literal["tcg", "kvm"]
Source = Literal["env", "host", "cache", "probe"]


class VmAccelError(RuntimeError):
    """PROXYSHIFT_VM_ACCEL asks for something this machine cannot give."""


@dataclass(frozen=True)
class ProbeRun:
    """What a probe boot reported: run_in_vm's VmResult fields the verdict needs."""

    returncode: int | None
    timed_out: bool
    seconds: float


class ProbeRunner(Protocol):
    """Boots `kernel` under `accel` running `true` within `timeout` (vm.probe_runner in production).

    Raises RuntimeError (vm.VmError) on a guest that reports no exit code (QEMU refusing the
    accelerator, a crash)."""

    def __call__(self, kernel: vmkernel.GuestKernel, *, accel: Accel, timeout: float) -> ProbeRun: ...


@dataclass(frozen=True)
class AccelChoice:
    accel: Accel
    reason: str
    source: Source  # env: PROXYSHIFT_VM_ACCEL; host: no usable /dev/kvm; cache: an earlier probe; probe: just now
    cache_file: Path | None = None

    def describe(self) -> str:
        where = f" (cached in {self.cache_file})" if self.source == "cache" and self.cache_file else ""
        return f"accelerator {self.accel}: {self.reason}{where}"


@dataclass(frozen=True)
class HostFacts:
    """What decides whether KVM can run the pinned kernel here: the cache key."""

    kernel_pin: str      # <package>_<version> of the guest kernel
    host_release: str    # uname -r
    kvm_device: bool     # /dev/kvm exists
    cpu_flags: tuple[str, ...]  # which of vmx, svm the CPU shows (a PVM host shows neither)
    qemu_version: str = ""  # the first line of `qemu-system-x86_64 --version`: its KVM support can change

    def key(self) -> str:
        text = json.dumps({"v": CACHE_VERSION, "pin": self.kernel_pin, "host": self.host_release,
                           "kvm": self.kvm_device, "flags": list(self.cpu_flags), "qemu": self.qemu_version},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, object]:
        return {"kernelPin": self.kernel_pin, "hostRelease": self.host_release, "kvmDevice": self.kvm_device,
                "cpuFlags": list(self.cpu_flags), "qemuVersion": self.qemu_version}


def virtualisation_flags(cpuinfo: str) -> tuple[str, ...]:
    """vmx (Intel VT-x) and svm (AMD-V), as far as the first CPU's flags line shows them."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            flags = set(value.split())
            return tuple(f for f in ("vmx", "svm") if f in flags)
    return ()


def _read_cpuinfo(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(CPUINFO_MAX_BYTES).decode(errors="replace")
    except OSError:
        return ""


def installed_qemu_version() -> str:
    """The first line of `qemu-system-x86_64 --version` (empty when it cannot be read: the boot says why)."""
    try:
        out = run(["qemu-system-x86_64", "--version"], timeout=QEMU_VERSION_TIMEOUT_SECONDS).stdout
    except CommandError:
        return ""
    return out[:QEMU_VERSION_MAX_CHARS].splitlines()[0].strip() if out.strip() else ""


def host_facts(pin: vmkernel.KernelPin, *, kvm_device: Path = Path("/dev/kvm"),
               cpuinfo: Path = Path("/proc/cpuinfo"), host_release: str | None = None,
               qemu_version: str = "") -> HostFacts:
    return HostFacts(kernel_pin=pin.key, host_release=host_release or os.uname().release,
                     kvm_device=kvm_device.exists(), cpu_flags=virtualisation_flags(_read_cpuinfo(cpuinfo)),
                     qemu_version=qemu_version)


def kvm_unusable(kvm_device: Path) -> str | None:
    """Why /dev/kvm cannot be used (None: it opens read-write, as QEMU needs)."""
    if not kvm_device.exists():
        return f"no {kvm_device}"
    try:
        fd = os.open(kvm_device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"{kvm_device} cannot be opened: {exc.strerror or exc}"
    os.close(fd)
    return None


def cache_file(facts: HostFacts, cache_root: Path | None = None) -> Path:
    return (cache_root or paths.vm_cache_root()) / f"accel-{facts.key()}.json"


def _read_cache(path: Path, facts: HostFacts) -> tuple[Accel, str] | None:
    """The cached verdict, when the file is ours and for these facts; anything else means probe again."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("facts") != facts.to_json() or data.get("version") != CACHE_VERSION:
        return None
    accel, reason = data.get("accel"), data.get("reason")
    if accel not in ("tcg", "kvm") or not isinstance(reason, str):
        return None
    return ("kvm" if accel == "kvm" else "tcg"), reason


def _write_cache(path: Path, facts: HostFacts, accel: Accel, reason: str, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "facts": facts.to_json(), "accel": accel, "reason": reason,
                               "probeSeconds": round(seconds, 1),
                               "probedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a verdict


def probe_kvm(kernel: vmkernel.GuestKernel, runner: ProbeRunner, *,
              timeout: float = PROBE_TIMEOUT_SECONDS) -> tuple[Accel, str, float]:
    """Boot the kernel under KVM running `true`: (verdict, reason, seconds)."""
    started = time.monotonic()
    try:
        run = runner(kernel, accel="kvm", timeout=timeout)
    except (RuntimeError, OSError) as exc:  # vm.VmError, or QEMU not starting: a verdict, not a crash
        # vm.VmError's first lines: "reported no exit code (qemu exited N ...)" and QEMU's own words.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2] or [type(exc).__name__]
        return "tcg", f"the KVM probe failed: {'; '.join(lines)[:300]}", time.monotonic() - started
    seconds = time.monotonic() - started
    if run.timed_out:
        return "tcg", (f"the KVM probe did not run `true` in a stock {kernel.release} within {timeout:g} s "
                       f"(TCG takes 4-8 s; a PVM host never boots it)"), seconds
    if run.returncode != 0:
        return "tcg", f"the KVM probe's `true` exited {run.returncode}", seconds
    return "kvm", f"the KVM probe ran `true` in a stock {kernel.release} in {run.seconds:.1f} s", seconds


def choose_accel(kernel: vmkernel.GuestKernel, runner: ProbeRunner, *, env: Mapping[str, str] | None = None,
                 kvm_device: Path = Path("/dev/kvm"), cpuinfo: Path = Path("/proc/cpuinfo"),
                 host_release: str | None = None, cache_root: Path | None = None,
                 timeout: float = PROBE_TIMEOUT_SECONDS, log: Callable[[str], None] = vmkernel.say,
                 qemu_version: Callable[[], str] = installed_qemu_version) -> AccelChoice:
    """TCG or KVM for this machine, and why (see the module's docstring)."""
    env = os.environ if env is None else env
    wanted = env.get(ACCEL_ENV, "").strip()
    if wanted not in ("", "tcg", "kvm"):
        raise VmAccelError(f"{ACCEL_ENV}={wanted!r}: expected tcg or kvm (or unset: probe)")
    if wanted == "tcg":
        return AccelChoice("tcg", f"{ACCEL_ENV}=tcg", "env")
    unusable = kvm_unusable(kvm_device)
    if unusable is not None:
        if wanted == "kvm":
            raise VmAccelError(f"{ACCEL_ENV}=kvm but {unusable}")
        return AccelChoice("tcg", unusable, "host")
    facts = host_facts(kernel.pin, kvm_device=kvm_device, cpuinfo=cpuinfo, host_release=host_release,
                       qemu_version=qemu_version())
    path = cache_file(facts, cache_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One prober at a time: a second session waits for the first one's verdict instead of booting
    # a second KVM guest beside it (and both timing out on a loaded machine).
    with open(path.with_name(".accel.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read_cache(path, facts)
        if cached is not None:
            accel, reason = cached
            choice = AccelChoice(accel, reason, "cache", path)
        else:
            log(f"probing KVM: a stock {kernel.release} under -accel kvm must run `true` within {timeout:g} s "
                f"(once per machine; cached in {path})")
            accel, reason, seconds = probe_kvm(kernel, runner, timeout=timeout)
            _write_cache(path, facts, accel, reason, seconds)
            choice = AccelChoice(accel, reason, "probe", path)
    if wanted == "kvm" and choice.accel != "kvm":
        raise VmAccelError(f"{ACCEL_ENV}=kvm but KVM does not run a stock kernel here: {choice.reason} "
                           f"(verdict in {path}; delete it to probe again, or unset {ACCEL_ENV} for TCG)")
    if wanted == "kvm":
        return AccelChoice("kvm", f"{ACCEL_ENV}=kvm; {choice.reason}", "env", path)
    return choice
