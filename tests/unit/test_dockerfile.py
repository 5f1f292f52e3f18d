"""The image carries exactly the tools the agent runs, and starts without a shell.

The tool list is read from the agent's code, not written down twice: every argument list the agent
hands to a call (`run([...])`, `runner([...])`, `self.run([...])`)
starts with the program's name, and the iptables save/restore names come from the flusher's own
IptablesTool. Each tool maps to the Debian package that ships it; the Dockerfile must install
that set of packages, no more (image size, attack surface) and no less (a ToolMissingError on a
node in the middle of a migration).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from proxyshift.agent.flush.iptables import IptablesTool

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "operator" / "proxyshift" / "agent"
DOCKERFILE = ROOT / "Dockerfile"

# Debian bookworm (the base image's release): which package ships each program.
TOOL_PACKAGES = {
    "iptables": "iptables", "ip6tables": "iptables",
    "iptables-save": "iptables", "iptables-restore": "iptables",
    "ip6tables-save": "iptables", "ip6tables-restore": "iptables",
    "iptables-nft-save": "iptables", "iptables-nft-restore": "iptables",
    "ip6tables-nft-save": "iptables", "ip6tables-nft-restore": "iptables",
    "iptables-legacy-save": "iptables", "iptables-legacy-restore": "iptables",
    "ip6tables-legacy-save": "iptables", "ip6tables-legacy-restore": "iptables",
    "nft": "nftables",
    "ip": "iproute2", "tc": "iproute2",
    "ipset": "ipset",
    "ipvsadm": "ipvsadm",
    "modprobe": "kmod",
    "conntrack": "conntrack",
}
# A program name: what argv[0] looks like (no flags, no paths, no spaces).
PROGRAM = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


def argv_lists(tree: ast.AST) -> list[list[str]]:
    """Literal argument lists passed to calls: [first string, ...] for each list argument of a call."""
    # Any: a non-string constant after the first string is kept as it is (what the call passes).
    found: list[list[Any]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if (isinstance(arg, ast.List) and arg.elts and isinstance(arg.elts[0], ast.Constant)
                    and isinstance(arg.elts[0].value, str)):
                found.append([e.value if isinstance(e, ast.Constant) else "?" for e in arg.elts])
    return found


def agent_tools() -> dict[str, set[str]]:
    """program -> files that run it."""
    tools: dict[str, set[str]] = {}
    for path in sorted(AGENT.rglob("*.py")):
        for argv in argv_lists(ast.parse(path.read_text(), str(path))):
            if PROGRAM.match(argv[0]):
                tools.setdefault(argv[0], set()).add(str(path.relative_to(ROOT)))
    for family in ("ipv4", "ipv6"):
        for backend in ("nft", "legacy", None):
            tool = IptablesTool(family, backend)
            for name in (tool.save, tool.restore):
                tools.setdefault(name, set()).add("operator/proxyshift/agent/flush/iptables.py (IptablesTool)")
    return tools


def logical_lines(text: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def apt_packages(text: str) -> set[str]:
    """Packages named by every `apt-get install` in a RUN instruction."""
    packages: set[str] = set()
    for line in logical_lines(text):
        if not line.upper().startswith("RUN "):
            continue
        for command in re.split(r"&&|;|\|\|", line[4:]):
            words = shlex.split(command)
            if words[:2] == ["apt-get", "install"]:
                packages |= {w for w in words[2:] if not w.startswith("-")}
    return packages


def test_agent_tools_are_known() -> None:
    tools = agent_tools()
    unknown = {t: sorted(files) for t, files in tools.items() if t not in TOOL_PACKAGES}
    assert not unknown, f"the agent runs programs with no known Debian package (add them to TOOL_PACKAGES): {unknown}"
    # The walk must see the tools we know the agent uses, or it is not looking at the code.
    assert {"nft", "ip", "ipset", "ipvsadm", "modprobe", "iptables"} <= set(tools)


def test_dockerfile_installs_exactly_the_agents_packages() -> None:
    needed = {TOOL_PACKAGES[t] for t in agent_tools()}
    installed = apt_packages(DOCKERFILE.read_text())
    assert installed == needed, f"missing: {sorted(needed - installed)}, not used: {sorted(installed - needed)}"


@pytest.mark.parametrize("instruction", ["ENTRYPOINT", "CMD"])
def test_entrypoint_and_cmd_are_exec_form(instruction: str) -> None:
    # Shell form would start /bin/sh -c: a shell in the image, and signals not reaching proxyshift.
    lines = [line for line in logical_lines(DOCKERFILE.read_text()) if line.upper().startswith(instruction + " ")]
    assert lines, f"the Dockerfile has no {instruction}"
    for line in lines:
        value = json.loads(line.split(None, 1)[1])
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), line
        # Exec form that merely starts a shell would be shell form in disguise.
        assert not value or Path(value[0]).name not in ("sh", "bash", "dash"), line


def test_parsers_see_what_they_should() -> None:
    assert apt_packages("RUN apt-get update \\\n && apt-get install -y --no-install-recommends a b \\\n"
                        " && rm -rf x\nRUN apt-get install -y c; echo d") == {"a", "b", "c"}
    tree = ast.parse("run(['nft', '-f', '-'], input=x)\nself.run(cmd)\nf(r, ['ipset', 'save'])\n__all__ = ['x']")
    assert argv_lists(tree) == [["nft", "-f", "-"], ["ipset", "save"]]
