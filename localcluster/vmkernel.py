"""The QEMU guest's kernel: fetch the pinned Debian kernel package, unpack it, cache it.

Test-bed code, not product code. The host kernel has no IPVS, no dummy driver
and no loadable modules, so `vm.py` boots a stock Debian 12 kernel under QEMU.
This module's one job is to have that kernel ready on disk:

- `apt-get download` of the package pinned in localcluster/pins.env (checked
  against the pinned sha256; `apt-get update` once if apt does not know it);
- `dpkg-deb -x` into the cache and `depmod -b` (the package's postinst would
  do that; we never install it into the host's /boot);
- the uncompressed ELF `vmlinux`, cut out of the bzImage's xz payload: QEMU
  boots an ELF with a PVH note directly, which skips the bzImage's
  self-decompression (about 3.5 s to the first guest command instead of 6 s
  under TCG);
- the busybox initramfs (`initramfs.cpio`, newc format written here, no cpio
  binary needed) with the few modules the guest needs before it can mount
  anything: virtio_pci, 9p, 9pnet_virtio, virtio_console, overlay and their
  dependencies.

Everything lives under ~/.cache/proxyshift/vm/<package>_<version>/; a
`.complete` stamp marks a finished unpack, and each step writes to a temporary
name first, so an interrupted fetch never looks finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import lzma
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from localcluster import paths

STAMP_NAME = ".complete"
XZ_MAGIC = b"\xfd7zXZ\x00"
BUSYBOX_PACKAGE = "busybox-static"  # a static binary: it runs in a bare initramfs
# Modules the initramfs loads before it can mount the host's root (9p over virtio-pci), write
# its output (virtio console ports) and stack a tmpfs over the read-only share (overlay); and
# virtio_net (with failover, net_failover) for a guest given a NIC (vm.run_in_vm(tap=...)): the guest
# has no udev to load a PCI device's driver. Without a NIC it binds nothing.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "virtio_console", "overlay", "virtio_net")
APT_TIMEOUT_SECONDS = 900.0
STEP_TIMEOUT_SECONDS = 300.0

Say = Callable[[str], None]


class VmKernelError(RuntimeError):
    """The pinned kernel could not be fetched or prepared."""


def say(message: str) -> None:
    print(f"[vm] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class KernelPin:
    package: str
    version: str
    sha256: str

    @property
    def release(self) -> str:
        """The kernel release the package installs ("linux-image-6.1.0-57-amd64" -> "6.1.0-57-amd64")."""
        return self.package.removeprefix("linux-image-")

    @property
    def key(self) -> str:
        return f"{self.package}_{self.version}"


@dataclass(frozen=True)
class GuestKernel:
    """A kernel ready to boot: the files vm.py hands to QEMU."""

    pin: KernelPin
    root: Path          # the unpacked package
    vmlinux: Path
    initramfs: Path
    modules_dir: Path   # <root>/lib/modules: shared into the guest as its /lib/modules

    @property
    def release(self) -> str:
        return self.pin.release


def read_pin(pins_file: Path | None = None) -> KernelPin:
    """The VM_KERNEL_* lines of localcluster/pins.env (the one place the kernel is pinned)."""
    pins_file = pins_file or paths.go_module_dir() / "pins.env"
    values: dict[str, str] = {}
    for line in pins_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    try:
        return KernelPin(values["VM_KERNEL_PACKAGE"], values["VM_KERNEL_VERSION"], values["VM_KERNEL_SHA256"])
    except KeyError as exc:
        raise VmKernelError(f"{pins_file} has no {exc.args[0]}") from exc


def cache_dir(pin: KernelPin) -> Path:
    return paths.vm_cache_root() / pin.key


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One preparer per pin at a time (two test sessions may start together)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _run(argv: list[str], *, cwd: Path | None = None, timeout: float = STEP_TIMEOUT_SECONDS) -> str:
    if shutil.which(argv[0]) is None:
        raise VmKernelError(f"{argv[0]} not found (hack/install-deps.sh installs what the VM needs)")
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,  # noqa: S603
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise VmKernelError(f"{' '.join(argv)} timed out after {timeout:g}s") from exc
    if proc.returncode != 0:
        tail = "; ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise VmKernelError(f"{' '.join(argv)} exited {proc.returncode}: {tail}")
    return proc.stdout


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(pin: KernelPin, into: Path, *, log: Say = say) -> Path:
    """`apt-get download <package>=<version>` into `into`, checked against the pinned sha256."""
    deb = into / f"{pin.package}_{pin.version}_amd64.deb"
    if deb.exists() and _sha256(deb) == pin.sha256:
        return deb
    spec = f"{pin.package}={pin.version}"
    # As root apt would drop to the _apt user, who cannot write into the cache folder.
    argv = ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", spec]
    log(f"apt-get download {spec}")
    try:
        _run(argv, cwd=into, timeout=APT_TIMEOUT_SECONDS)
    except VmKernelError as first:
        log(f"apt-get download failed ({first}); apt-get update and once more")
        _run(["apt-get", "update", "-q"], timeout=APT_TIMEOUT_SECONDS)
        _run(argv, cwd=into, timeout=APT_TIMEOUT_SECONDS)
    found = _sha256(deb) if deb.exists() else None
    if found != pin.sha256:
        raise VmKernelError(f"{deb.name}: sha256 {found} differs from the pin {pin.sha256} "
                            "(localcluster/pins.env)")
    return deb


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage whose payload is xz (Debian's CONFIG_KERNEL_XZ).

    The xz stream starts at its magic inside the setup/decompressor code; what
    follows the stream (padding, the decompressor's tail) is left over, not an error.
    """
    start = bzimage.find(XZ_MAGIC)
    while start >= 0:
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        try:
            elf = decompressor.decompress(bzimage[start:])
        except lzma.LZMAError:
            elf = b""
        if elf.startswith(b"\x7fELF"):
            return elf
        start = bzimage.find(XZ_MAGIC, start + 1)
    raise VmKernelError("no xz-compressed ELF kernel found in the bzImage")


def module_closure(modules_dir: Path, wanted: tuple[str, ...]) -> list[str]:
    """Paths (relative to lib/modules/<release>) of `wanted` and their dependencies, dependencies first."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, sep, rest = line.partition(":")
        if not sep:
            continue
        deps[path] = rest.split()
        by_name[Path(path).name.split(".ko", 1)[0].replace("-", "_")] = path
    builtin = {Path(line.strip()).name.split(".ko", 1)[0].replace("-", "_")
               for line in (modules_dir / "modules.builtin").read_text().splitlines() if line.strip()}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps.get(path, []):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name in builtin:
            continue
        if name not in by_name:
            raise VmKernelError(f"module {name} is neither built in nor in {modules_dir}/modules.dep")
        visit(by_name[name])
    return order


def _cpio_entry(name: str, mode: int, data: bytes = b"", *, rdev: tuple[int, int] = (0, 0), ino: int) -> bytes:
    """One record of the "newc" cpio format the kernel unpacks an initramfs from."""
    encoded = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0]
    header = b"070701" + b"".join(f"{f:08x}".encode() for f in fields)
    out = header + encoded
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
    return out


# The guest's boot scripts are files beside this module, not strings in it: they run inside the
# guest (busybox sh before switch_root, the host's sh after it), never as a host process.
INIT_SCRIPT_FILE = Path(__file__).with_name("vm_init.sh")


def init_script() -> str:
    return INIT_SCRIPT_FILE.read_text()



def find_busybox() -> Path:
    found = shutil.which("busybox")
    if found is None:
        raise VmKernelError(f"busybox missing: install {BUSYBOX_PACKAGE} (hack/install-deps.sh)")
    return Path(found)


def build_initramfs(kernel_root: Path, release: str, *, busybox: Path | None = None,
                    modules: tuple[str, ...] = INITRAMFS_MODULES) -> bytes:
    """A newc cpio: busybox, /init, /dev/console and the modules (with deps) that /init insmods."""
    busybox = busybox or find_busybox()
    modules_dir = kernel_root / "lib" / "modules" / release
    closure = module_closure(modules_dir, modules)
    entries: list[tuple[str, int, bytes, tuple[int, int]]] = [
        (d, 0o040755, b"", (0, 0)) for d in ("bin", "dev", "proc", "sys", "modules")
    ]
    entries.append(("dev/console", 0o020600, b"", (5, 1)))  # init's stdio before devtmpfs is mounted
    entries.append(("busybox", 0o100755, busybox.read_bytes(), (0, 0)))
    entries.append(("init", 0o100755, init_script().encode(), (0, 0)))
    names = [Path(p).name for p in closure]
    entries.append(("modules.list", 0o100644, ("\n".join(names) + "\n").encode(), (0, 0)))
    entries += [(f"modules/{Path(p).name}", 0o100644, (modules_dir / p).read_bytes(), (0, 0)) for p in closure]
    out = b"".join(_cpio_entry(n, m, d, rdev=r, ino=i + 1) for i, (n, m, d, r) in enumerate(entries))
    return out + _cpio_entry("TRAILER!!!", 0, ino=0)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def prepare(pin: KernelPin | None = None, *, log: Say = say) -> GuestKernel:
    """The pinned kernel, ready to boot; fetched and unpacked only the first time."""
    pin = pin or read_pin()
    base = cache_dir(pin)
    root = base / "root"
    modules_dir = root / "lib" / "modules"
    with _locked(base):
        if not (base / STAMP_NAME).exists():
            started = time.monotonic()
            log(f"preparing kernel {pin.key} in {base}")
            deb = download(pin, base, log=log)
            staging = base / "root.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
            log(f"dpkg-deb -x {deb.name}")
            _run(["dpkg-deb", "-x", str(deb), str(staging)])
            log(f"depmod -b ... {pin.release}")
            _run(["depmod", "-b", str(staging), pin.release])
            os.replace(staging, root)
            log("extracting vmlinux from the bzImage")
            _write_atomic(base / "vmlinux", extract_vmlinux((root / "boot" / f"vmlinuz-{pin.release}").read_bytes()))
            deb.unlink()  # 70 MB we no longer need: everything is unpacked
            (base / STAMP_NAME).write_text(f"{pin.package}={pin.version}\n")
            log(f"kernel ready in {time.monotonic() - started:.1f}s")
        busybox = find_busybox()
        # The initramfs depends on our init script and the host's busybox, not only on the pin:
        # name it by their hash so an edited script never boots a stale image.
        tag = hashlib.sha256(init_script().encode() + busybox.read_bytes() + "|".join(INITRAMFS_MODULES).encode())
        initramfs = base / f"initramfs-{tag.hexdigest()[:12]}.cpio"
        if not initramfs.exists():
            log(f"building {initramfs.name}")
            _write_atomic(initramfs, build_initramfs(root, pin.release, busybox=busybox))
    return GuestKernel(pin=pin, root=root, vmlinux=base / "vmlinux", initramfs=initramfs, modules_dir=modules_dir)


def main() -> int:
    kernel = prepare()
    print(kernel.vmlinux)
    return 0


if __name__ == "__main__":
    sys.exit(main())
