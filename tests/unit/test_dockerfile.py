"""The image carries exactly the tools the agent runs, and starts without a shell.

The tool list is read from the agent's code, not written down twice: every argument list the agent
writes as a literal starts with the program's name, wherever it stands (handed to a call, `run([...])`,
or kept for later, as preflight's version asks and the inventory's IPVS reads are), and the iptables
save/restore names come from the flusher's own IptablesTool. Each tool maps to the Debian package that
ships it; the Dockerfile must install that set of packages, no more (image size, attack surface) and
no less (a ToolMissingError on a node in the middle of a migration).
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


def argv_lists(tree: ast.AST) -> list[list[Any]]:
    """Argv-shaped literals anywhere in `tree`: [first string, ...] for every list literal that starts with a string,
    and for every tuple literal that starts with one and holds an option ("-x", "--x") after it."""
    # The agent writes its data sequences of words as tuples ("ipv4", "ipv6"), its argvs as lists (metrics.py's
    # label names became tuples for this scan): a tuple of plain words is data, so a tuple argv is known by an
    # option (one of plain words, ("ipset", "save"), would be missed: an argv is written as a list). An argv may
    # stand outside any call (preflight's `asks`, inventory._ipvs's `argvs`), so the whole tree is walked, not
    # only call arguments. `__all__` is a list of names, never a command.
    exported = {id(node.value) for node in ast.walk(tree)
                if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
                and any(isinstance(t, ast.Name) and t.id == "__all__"
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))}
    # Any: a non-string constant after the first string is kept as it is (what the argv holds).
    found: list[list[Any]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.List | ast.Tuple) or id(node) in exported:
            continue
        if not (node.elts and isinstance(node.elts[0], ast.Constant) and isinstance(node.elts[0].value, str)):
            continue
        words = [e.value if isinstance(e, ast.Constant) else "?" for e in node.elts]
        if isinstance(node, ast.Tuple) and not any(isinstance(w, str) and w.startswith("-") for w in words[1:]):
            continue
        found.append(words)
    return found


def agent_tools(package: Path = AGENT, root: Path = ROOT) -> dict[str, set[str]]:
    """program -> files (relative to `root`) that run it."""
    tools: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for argv in argv_lists(ast.parse(path.read_text(), str(path))):
            if PROGRAM.match(argv[0]):
                tools.setdefault(argv[0], set()).add(str(path.relative_to(root)))
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


def unknown_tools(tools: dict[str, set[str]]) -> dict[str, list[str]]:
    """The programs with no known Debian package, and where they are run."""
    return {t: sorted(files) for t, files in tools.items() if t not in TOOL_PACKAGES}


def test_agent_tools_are_known() -> None:
    tools = agent_tools()
    unknown = unknown_tools(tools)
    assert not unknown, f"the agent runs programs with no known Debian package (add them to TOOL_PACKAGES): {unknown}"
    # The walk must see the tools we know the agent uses, or it is not looking at the code.
    assert {"nft", "ip", "ipset", "ipvsadm", "modprobe", "iptables", "conntrack", "tc"} <= set(tools)


def test_argvs_kept_for_later_are_tools_too() -> None:
    # Preflight's version asks stand in a list of (argv, prefix) pairs, handed to no call as they are.
    preflight = AGENT / "preflight.py"
    found = argv_lists(ast.parse(preflight.read_text(), str(preflight)))
    assert {"nft", "iptables", "ipset", "ipvsadm"} <= {argv[0] for argv in found if argv[1:] == ["--version"]}


def test_a_tool_asked_only_for_its_version_is_unknown_until_packaged(tmp_path: Path) -> None:
    package = tmp_path / "agent"
    package.mkdir()
    (package / "tools.py").write_text(
        "asks = [(['faketool', '--version'], 'faketool v')]\n"
        "def read(runner):\n"
        "    argvs = [(['ipset', 'save'], 60.0)]\n"
        "    argvs += [(['otherfake', '-Sn'], 60.0)]\n"
        "    return [runner(argv, timeout=t) for argv, t in argvs]\n")
    unknown = unknown_tools(agent_tools(package, tmp_path))
    assert unknown == {"faketool": ["agent/tools.py"], "otherfake": ["agent/tools.py"]}


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
    tree = ast.parse("run(['nft', '-f', '-'], input=x)\nself.run(cmd)\nf(r, ['ipset', 'save'])\n__all__ = ['x']\n"
                     "asks = [(['ipvsadm', '--version'], 'ipvsadm v')]\nargv = ('conntrack', '-L', family)\n"
                     "for d in ('ingress', 'egress'): pass\nreturn 'refused', 'connection refused'\n"
                     "__all__ += ['y']\nkinds = [k for k in x]")
    assert sorted(argv_lists(tree)) == [["conntrack", "-L", "?"], ["ipset", "save"], ["ipvsadm", "--version"],
                                        ["nft", "-f", "-"]]
