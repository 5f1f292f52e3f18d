"""The node simulator's container launcher applies a securityContext (issue 15, item 3).

Each test starts a process through `python -m localcluster.container`, as the simulator
does, and looks at what the process can do: its capability sets, a read-only root with writable
volumes, another user reaching only the exposed "image" files, and the agent's own cleanup with
the capabilities its DaemonSet grants and without NET_ADMIN.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster.security_context import confinement
from tests.support.kp_rules import iptables_mode_rules

pytestmark = pytest.mark.dataplane
ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator"
NET_ADMIN_AND_RAW = 0x3000  # bits 12 and 13


def launch(ns: Any, args: list[str], command: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "localcluster.container", "--netns", ns.name,
            "--created-log", str(tmp_path / "created.log"), *args, "--", *command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(OPERATOR)})


def status_field(text: str, name: str, base: int = 16) -> int:
    line = next(line for line in text.splitlines() if line.startswith(f"{name}:"))
    return int(line.split()[1], base)


def test_exactly_the_granted_capabilities(netns: Any, tmp_path: Path) -> None:
    granted = launch(netns, ["--uid", "0", "--gid", "0", "--caps", "NET_ADMIN,NET_RAW"],
                     ["cat", "/proc/self/status"], tmp_path)
    assert granted.returncode == 0, granted.stderr
    for field in ("CapEff", "CapPrm", "CapBnd"):
        assert status_field(granted.stdout, field) == NET_ADMIN_AND_RAW, field
    none = launch(netns, ["--uid", "65532", "--gid", "65532", "--caps", "", "--no-new-privs"],
                  ["cat", "/proc/self/status"], tmp_path)
    assert none.returncode == 0, none.stderr
    assert all(status_field(none.stdout, f) == 0 for f in ("CapEff", "CapPrm", "CapBnd", "CapAmb"))
    assert status_field(none.stdout, "NoNewPrivs", 10) == 1
    assert status_field(none.stdout, "Uid", 10) == 65532 and status_field(none.stdout, "Gid", 10) == 65532


def test_read_only_root_keeps_volumes_and_dev_writable(netns: Any, tmp_path: Path) -> None:
    volume, mount, other = tmp_path / "volume", tmp_path / "mnt", tmp_path / "other"
    volume.mkdir()
    mount.mkdir()
    script = ("import errno, pathlib, sys\n"
              f"pathlib.Path({str(mount / 'written')!r}).write_text('ok')\n"
              "open('/dev/null', 'w').write('x')\n"
              "try:\n"
              f"    pathlib.Path({str(other)!r}).write_text('no')\n"
              "except OSError as exc:\n"
              "    sys.exit(0 if exc.errno == errno.EROFS else 3)\n"
              "sys.exit(4)\n")
    done = launch(netns, ["--read-only-root", "--bind", f"{volume}:{mount}"], [sys.executable, "-c", script],
                  tmp_path)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert (volume / "written").read_text() == "ok"  # through the writable volume
    assert not other.exists()


def test_another_user_sees_only_the_exposed_paths_of_a_private_folder(netns: Any, tmp_path: Path) -> None:
    private = tmp_path / "home"
    (private / "image").mkdir(parents=True)
    (private / "image" / "file").write_text("image content")
    (private / "secret").write_text("not for the container")
    (private / "image").chmod(0o755)
    (private / "image" / "file").chmod(0o644)
    (private / "secret").chmod(0o644)
    private.chmod(0o700)
    tmp_path.chmod(0o755)
    user = ["--uid", "65532", "--gid", "65532", "--caps", ""]
    refused = launch(netns, user, ["cat", str(private / "image" / "file")], tmp_path)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr
    exposed = launch(netns, [*user, "--expose", str(private / "image")],
                     [sys.executable, "-c", f"import os; print(sorted(os.listdir({str(private)!r})))"], tmp_path)
    assert exposed.returncode == 0, exposed.stderr
    assert exposed.stdout.strip() == "['image']"
    read = launch(netns, [*user, "--expose", str(private / "image")], ["cat", str(private / "image" / "file")],
                  tmp_path)
    assert read.returncode == 0 and read.stdout == "image content", read.stderr


def agent_container() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = yaml.safe_load_all((ROOT / "config" / "agent" / "daemonset.yaml").read_text())
    spec = next(d for d in docs if d and d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def agent_cleanup(netns: Any, tmp_path: Path, spec: dict[str, Any], container: dict[str, Any]
                  ) -> tuple[int, dict[str, Any], str]:
    args = confinement(spec, container, "proxyshift").launcher_args()
    # the agent's writable hostPath volume, as the simulator binds it under a read-only root
    args += ["--bind", "/run/xtables.lock:/run/xtables.lock"]
    done = launch(netns, args, [sys.executable, "-m", "proxyshift.cli", "agent", "cleanup", "--remove", "iptables",
                                "--target", "nftables"], tmp_path)
    return done.returncode, json.loads(done.stdout or "{}"), done.stderr


def test_the_agent_cleans_up_with_its_manifest_capabilities_and_not_without_net_admin(netns: Any,
                                                                                       tmp_path: Path) -> None:
    Path("/run/xtables.lock").touch()
    spec, container = agent_container()
    netns.restore(iptables_mode_rules(20))
    weaker = copy.deepcopy(container)
    weaker["securityContext"]["capabilities"]["add"] = ["NET_RAW"]
    code, report, stderr = agent_cleanup(netns, tmp_path, spec, weaker)
    assert code != 0 and not report.get("ok"), (code, report, stderr)
    assert report["message"].startswith("the kernel refused the agent: its container needs CAP_NET_ADMIN"), report
    assert "Permission denied (you must be root)" in report["message"]
    assert "KUBE-SERVICES" in netns.save()  # nothing was removed
    code, report, stderr = agent_cleanup(netns, tmp_path, spec, container)
    assert code == 0 and report["ok"], (code, report, stderr)
    assert "KUBE-SERVICES" not in netns.save()
