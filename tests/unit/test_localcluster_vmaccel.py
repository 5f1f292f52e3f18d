"""The QEMU accelerator decision (localcluster.vmaccel) with a fake probe runner: no QEMU boots here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localcluster import vmaccel, vmkernel

pytestmark = pytest.mark.unit

PIN = vmkernel.KernelPin("linux-image-6.1.0-test-amd64", "1", "0" * 64)
CPUINFO_PVM = "processor\t: 0\nflags\t\t: fpu vme de pse tsc msr hypervisor\n"
CPUINFO_VMX = "processor\t: 0\nflags\t\t: fpu vme vmx de pse\n"


class FakeRunner:
    """Stands in for vm.probe_runner: records each boot and answers as told."""

    def __init__(self, *, returncode: int | None = 0, timed_out: bool = False, error: str | None = None) -> None:
        self.returncode, self.timed_out, self.error = returncode, timed_out, error
        self.calls: list[tuple[str, float]] = []

    def __call__(self, kernel: vmkernel.GuestKernel, *, accel: vmaccel.Accel, timeout: float) -> vmaccel.ProbeRun:
        self.calls.append((accel, timeout))
        if self.error is not None:
            raise RuntimeError(self.error)
        return vmaccel.ProbeRun(returncode=self.returncode, timed_out=self.timed_out,
                                seconds=timeout if self.timed_out else 1.5)


@pytest.fixture
def kernel(tmp_path: Path) -> vmkernel.GuestKernel:
    return vmkernel.GuestKernel(pin=PIN, root=tmp_path, vmlinux=tmp_path / "vmlinux", initramfs=tmp_path / "i.cpio",
                                modules_dir=tmp_path / "lib/modules")


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """A /dev/kvm that opens (a plain file stands in for the device) and a PVM host's cpuinfo."""
    kvm = tmp_path / "kvm"
    kvm.write_text("")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO_PVM)
    return {"kvm_device": kvm, "cpuinfo": cpuinfo, "cache_root": tmp_path / "cache"}


def choose(kernel: vmkernel.GuestKernel, runner: FakeRunner, host: dict[str, Path], env: dict[str, str] | None = None,
           release: str = "6.8.0-host", qemu: str = "QEMU emulator version 7.2.22") -> vmaccel.AccelChoice:
    return vmaccel.choose_accel(kernel, runner, env=env or {}, host_release=release, log=lambda _: None,
                                kvm_device=host["kvm_device"], cpuinfo=host["cpuinfo"], cache_root=host["cache_root"],
                                qemu_version=lambda: qemu)


def test_a_probe_that_times_out_means_tcg_with_the_reason_and_is_paid_once(
        kernel: vmkernel.GuestKernel, host: dict[str, Path]) -> None:
    runner = FakeRunner(returncode=None, timed_out=True)
    first = choose(kernel, runner, host)
    assert (first.accel, first.source) == ("tcg", "probe")
    assert "within 25 s" in first.reason and runner.calls == [("kvm", vmaccel.PROBE_TIMEOUT_SECONDS)]
    assert first.cache_file is not None and first.cache_file.parent == host["cache_root"]
    saved = json.loads(first.cache_file.read_text())
    assert saved["accel"] == "tcg" and saved["reason"] == first.reason
    assert saved["facts"] == {"kernelPin": PIN.key, "hostRelease": "6.8.0-host", "kvmDevice": True, "cpuFlags": [],
                              "qemuVersion": "QEMU emulator version 7.2.22"}
    # The second run reads the verdict: no second boot.
    second = choose(kernel, runner, host)
    assert (second.accel, second.reason, second.source) == ("tcg", first.reason, "cache")
    assert len(runner.calls) == 1
    assert "cached in" in second.describe() and second.describe().startswith("accelerator tcg: ")


def test_a_probe_that_runs_true_means_kvm(kernel: vmkernel.GuestKernel, host: dict[str, Path]) -> None:
    runner = FakeRunner(returncode=0)
    choice = choose(kernel, runner, host)
    assert (choice.accel, choice.source) == ("kvm", "probe") and "1.5 s" in choice.reason
    assert choose(kernel, runner, host).accel == "kvm" and len(runner.calls) == 1


@pytest.mark.parametrize(("runner", "words"), [
    (FakeRunner(error="the guest reported no exit code (qemu exited 1 after 0.1s)\nqemu: failed to initialize kvm"),
     "failed to initialize kvm"),
    (FakeRunner(returncode=1), "exited 1"),
])
def test_a_probe_that_fails_means_tcg_naming_why(kernel: vmkernel.GuestKernel, host: dict[str, Path],
                                                 runner: FakeRunner, words: str) -> None:
    choice = choose(kernel, runner, host)
    assert choice.accel == "tcg" and words in choice.reason


def test_without_a_usable_dev_kvm_nothing_is_probed(kernel: vmkernel.GuestKernel, host: dict[str, Path],
                                                    tmp_path: Path) -> None:
    runner = FakeRunner()
    absent = choose(kernel, runner, dict(host, kvm_device=tmp_path / "no-kvm"))
    assert (absent.accel, absent.source) == ("tcg", "host") and "no " in absent.reason
    # A directory cannot be opened read-write (EISDIR), also as root: an unopenable device.
    unopenable = choose(kernel, runner, dict(host, kvm_device=tmp_path))
    assert unopenable.accel == "tcg" and "cannot be opened" in unopenable.reason
    assert runner.calls == [] and not host["cache_root"].exists()


def test_a_change_in_what_decides_probes_again(kernel: vmkernel.GuestKernel, host: dict[str, Path]) -> None:
    runner = FakeRunner(returncode=None, timed_out=True)
    choose(kernel, runner, host)
    choose(kernel, runner, host, release="6.9.0-newer")   # the host kernel was upgraded
    host["cpuinfo"].write_text(CPUINFO_VMX)                # another CPU (or nested virtualisation turned on)
    choose(kernel, runner, host, release="6.9.0-newer")
    choose(kernel, runner, host, release="6.9.0-newer", qemu="QEMU emulator version 8.2.2")  # QEMU upgraded
    choose(kernel, runner, host, release="6.9.0-newer", qemu="QEMU emulator version 8.2.2")
    assert len(runner.calls) == 4
    assert len(list(host["cache_root"].glob("accel-*.json"))) == 4


def test_a_damaged_cache_file_is_probed_over(kernel: vmkernel.GuestKernel, host: dict[str, Path]) -> None:
    runner = FakeRunner(returncode=0)
    path = choose(kernel, runner, host).cache_file
    assert path is not None
    for junk in ("{not json", json.dumps({"version": vmaccel.CACHE_VERSION, "accel": "hvf", "reason": "x"}), "[]"):
        path.write_text(junk)
        assert choose(kernel, runner, host).source == "probe"
    assert len(runner.calls) == 4 and json.loads(path.read_text())["accel"] == "kvm"


def test_the_environment_overrides_the_probe(kernel: vmkernel.GuestKernel, host: dict[str, Path],
                                             tmp_path: Path) -> None:
    runner = FakeRunner(returncode=None, timed_out=True)
    tcg = choose(kernel, runner, host, env={vmaccel.ACCEL_ENV: "tcg"})
    assert (tcg.accel, tcg.source) == ("tcg", "env") and runner.calls == []
    # Explicit kvm where the probe shows it hangs: a clear error now, not a timeout minutes later.
    with pytest.raises(vmaccel.VmAccelError, match="KVM does not run a stock kernel here: the KVM probe did not"):
        choose(kernel, runner, host, env={vmaccel.ACCEL_ENV: "kvm"})
    with pytest.raises(vmaccel.VmAccelError, match="kvm but no "):
        choose(kernel, runner, dict(host, kvm_device=tmp_path / "no-kvm"), env={vmaccel.ACCEL_ENV: "kvm"})
    with pytest.raises(vmaccel.VmAccelError, match="expected tcg or kvm"):
        choose(kernel, runner, host, env={vmaccel.ACCEL_ENV: "hvf"})
    ok = FakeRunner(returncode=0)
    host["cache_root"] = host["cache_root"] / "other"
    kvm = choose(kernel, ok, host, env={vmaccel.ACCEL_ENV: "kvm"})
    assert (kvm.accel, kvm.source) == ("kvm", "env") and ok.calls == [("kvm", vmaccel.PROBE_TIMEOUT_SECONDS)]


def test_virtualisation_flags_come_from_the_flags_line() -> None:
    assert vmaccel.virtualisation_flags(CPUINFO_VMX) == ("vmx",)
    assert vmaccel.virtualisation_flags(CPUINFO_PVM) == ()
    assert vmaccel.virtualisation_flags("flags : svm vmx\n") == ("vmx", "svm")
    assert vmaccel.virtualisation_flags("") == ()
