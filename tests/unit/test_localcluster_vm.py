"""The QEMU test bed's pure parts: kernel pin, vmlinux extraction, module closure, initramfs, QEMU argv."""

from __future__ import annotations

import lzma
import subprocess
from pathlib import Path

import pytest

from localcluster import vm, vmkernel

pytestmark = pytest.mark.unit


def test_the_kernel_pin_is_read_from_pins_env() -> None:
    pin = vmkernel.read_pin()
    assert pin.package.startswith("linux-image-") and pin.package.endswith("-amd64")
    assert pin.release == pin.package.removeprefix("linux-image-")
    assert len(pin.sha256) == 64 and int(pin.sha256, 16) >= 0
    assert vmkernel.cache_dir(pin).name == f"{pin.package}_{pin.version}"


def test_a_pins_file_without_the_kernel_is_an_error_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "pins.env").write_text("KUBERNETES_VERSION=v1.37.2\nVM_KERNEL_PACKAGE=linux-image-x\n")
    with pytest.raises(vmkernel.VmKernelError, match="VM_KERNEL_VERSION"):
        vmkernel.read_pin(tmp_path / "pins.env")


def test_vmlinux_is_the_elf_inside_the_xz_payload_even_after_a_false_magic() -> None:
    elf = b"\x7fELF" + bytes(range(256)) * 64
    payload = lzma.compress(elf, format=lzma.FORMAT_XZ)
    # A stray magic before the real stream (code bytes can look like one), trailing bytes after it.
    image = b"MZsetup" + vmkernel.XZ_MAGIC + b"garbage" + payload + b"\0" * 100 + b"tail"
    assert vmkernel.extract_vmlinux(image) == elf


def test_a_bzimage_without_an_xz_elf_is_refused() -> None:
    with pytest.raises(vmkernel.VmKernelError, match="no xz-compressed ELF"):
        vmkernel.extract_vmlinux(b"MZ" + lzma.compress(b"not an elf", format=lzma.FORMAT_XZ))


def _modules(tmp_path: Path) -> Path:
    d = tmp_path / "lib" / "modules" / "6.1.0-test"
    d.mkdir(parents=True)
    (d / "modules.dep").write_text(
        "kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/netfs/netfs.ko\n"
        "kernel/net/9p/9pnet.ko:\n"
        "kernel/fs/netfs/netfs.ko:\n"
        "kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio.ko\n"
        "kernel/drivers/virtio/virtio.ko:\n")
    (d / "modules.builtin").write_text("kernel/fs/overlayfs/overlay.ko\n")
    return d


def test_module_closure_puts_dependencies_first_once_and_skips_built_ins(tmp_path: Path) -> None:
    order = vmkernel.module_closure(_modules(tmp_path), ("9pnet_virtio", "9p", "overlay"))
    assert order == ["kernel/net/9p/9pnet.ko", "kernel/drivers/virtio/virtio.ko", "kernel/net/9p/9pnet_virtio.ko",
                     "kernel/fs/netfs/netfs.ko", "kernel/fs/9p/9p.ko"]


def test_module_closure_names_a_module_the_kernel_lacks(tmp_path: Path) -> None:
    with pytest.raises(vmkernel.VmKernelError, match="virtio_console"):
        vmkernel.module_closure(_modules(tmp_path), ("virtio_console",))


def test_the_initramfs_is_a_cpio_the_standard_tool_lists(tmp_path: Path) -> None:
    d = _modules(tmp_path)
    for rel in ("kernel/fs/9p/9p.ko", "kernel/net/9p/9pnet.ko", "kernel/fs/netfs/netfs.ko",
                "kernel/net/9p/9pnet_virtio.ko", "kernel/drivers/virtio/virtio.ko"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(b"\x7fELF module " + rel.encode())
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELF busybox")
    image = vmkernel.build_initramfs(tmp_path, "6.1.0-test", busybox=busybox, modules=("9pnet_virtio", "9p"))
    # busybox (busybox-static) is installed wherever the VM is used, and it lists newc archives.
    listing = subprocess.run(["busybox", "cpio", "-t", "-v"], input=image, capture_output=True, check=True,
                             timeout=30).stdout.decode()
    names = [line.split()[-1] for line in listing.splitlines() if line.strip()]
    assert names[:4] == ["bin", "dev", "proc", "sys"]
    assert {"init", "busybox", "dev/console", "modules.list", "modules/9p.ko", "modules/9pnet.ko"} <= set(names)
    console = next(line for line in listing.splitlines() if line.endswith("dev/console"))
    assert console.startswith("c")  # a character device node: init's stdio before devtmpfs
    assert vmkernel.init_script().encode() in image
    assert b"9pnet.ko\nvirtio.ko\n9pnet_virtio.ko\nnetfs.ko\n9p.ko\n" in image  # the insmod order


def test_stage2_quotes_every_argument_and_value() -> None:
    script = vm.stage2_script(["python3", "-c", "print('a b'); import sys"], "/work/my dir",
                              {"PYTHONPATH": "/x y", "EVIL": "$(reboot)"})
    assert "python3 -c 'print('\"'\"'a b'\"'\"'); import sys'" in script
    assert "cwd='/work/my dir'" in script
    assert "'EVIL=$(reboot)'" in script and "'PYTHONPATH=/x y'" in script
    assert f"{vm.GUEST_RUN_DIR}/rc" in script and "/proc/sysrq-trigger" in script


def test_qemu_gets_no_network_a_read_only_host_root_and_tcg(tmp_path: Path) -> None:
    pin = vmkernel.KernelPin("linux-image-6.1.0-test-amd64", "1", "0" * 64)
    kernel = vmkernel.GuestKernel(pin=pin, root=tmp_path, vmlinux=tmp_path / "vmlinux",
                                  initramfs=tmp_path / "i.cpio", modules_dir=tmp_path / "lib/modules")
    argv = vm.qemu_argv(kernel, tmp_path / "share", tmp_path / "out", tmp_path / "console", memory_mib=1024,
                        cpus=1, accel="tcg")
    joined = " ".join(argv)
    assert argv[argv.index("-nic") + 1] == "none" and "-nodefaults" in argv
    assert "netdev" not in joined and "user," not in joined
    root_share = argv[argv.index("-fsdev") + 1]
    assert "path=/," in root_share and "readonly=on" in root_share and "multidevs=remap" in root_share
    run_share = next(a for a in argv if "id=psrun" in a)
    assert "readonly" not in run_share
    assert argv[argv.index("-accel") + 1].startswith("tcg,thread=multi")
    assert argv[argv.index("-m") + 1] == "1024M" and argv[argv.index("-smp") + 1] == "1"


def test_qemu_gets_one_virtio_nic_on_the_given_tap_only_when_asked(tmp_path: Path) -> None:
    pin = vmkernel.KernelPin("linux-image-6.1.0-test-amd64", "1", "0" * 64)
    kernel = vmkernel.GuestKernel(pin=pin, root=tmp_path, vmlinux=tmp_path / "vmlinux",
                                  initramfs=tmp_path / "i.cpio", modules_dir=tmp_path / "lib/modules")
    argv = vm.qemu_argv(kernel, tmp_path / "share", tmp_path / "out", tmp_path / "console", memory_mib=1024,
                        cpus=1, accel="tcg", tap="pstap0")
    assert "-nic" not in argv and "-nodefaults" in argv
    netdev = argv[argv.index("-netdev") + 1]
    # An existing tap, no helper scripts (they would configure the host), no user-mode network.
    assert netdev == "tap,id=psnet,ifname=pstap0,script=no,downscript=no"
    assert argv.count("-netdev") == 1 and "user," not in " ".join(argv)
    device = next(a for a in argv if a.startswith("virtio-net-pci,"))
    assert "netdev=psnet" in device and f"mac={vm.GUEST_MAC}" in device
    for bad in ("", "a,b", "x" * 16):
        with pytest.raises(ValueError, match="tap"):
            vm.network_argv(bad)


def test_parse_env() -> None:
    assert vm.parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        vm.parse_env(["novalue"])
