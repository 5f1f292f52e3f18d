"""Helpers of the security tests: the documented permission table, the RBAC manifests, `can-i --list`
output, the no-shell AST scan and the audit log. Pure functions, unit-tested in test_security.py."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SECURITY_DOC = ROOT / "docs" / "security.md"
RBAC_DIR = ROOT / "config" / "rbac"
PACKAGE = ROOT / "operator" / "proxyshift"

NAMESPACE = "proxyshift-system"
IDENTITIES = {"operator": f"system:serviceaccount:{NAMESPACE}:proxyshift-operator",
              "agent": f"system:serviceaccount:{NAMESPACE}:proxyshift-agent"}


@dataclass(frozen=True, order=True)
class Grant:
    """One verb on one resource, for one identity, cluster-wide ("cluster") or in one namespace."""

    who: str
    where: str
    group: str  # "core" for the core API group
    resource: str  # with "/subresource"
    verb: str

    @property
    def kubectl_resource(self) -> str:
        """How `kubectl auth can-i --list` names it: resource[.group], subresource kept."""
        base, _, sub = self.resource.partition("/")
        name = base if self.group == "core" else f"{base}.{self.group}"
        return f"{name}/{sub}" if sub else name


def documented_grants(text: str | None = None) -> set[Grant]:
    """The table between the permissions markers of docs/security.md."""
    text = SECURITY_DOC.read_text(encoding="utf-8") if text is None else text
    match = re.search(r"<!-- permissions:begin -->(.*?)<!-- permissions:end -->", text, re.S)
    if match is None:
        raise ValueError("docs/security.md has no permissions table between its markers")
    rows = [line for line in match.group(1).strip().splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    if header[:5] != ["who", "where", "apiGroup", "resource", "verbs"]:
        raise ValueError(f"unexpected permissions table header: {header}")
    grants = set()
    for row in rows[2:]:
        who, where, group, resource, verbs = (c.strip() for c in row.strip("|").split("|")[:5])
        for verb in (v.strip() for v in verbs.split(",")):
            grants.add(Grant(who, where, group, resource, verb))
    return grants


def _who(subject: dict[str, Any]) -> str | None:
    if subject.get("kind") != "ServiceAccount" or subject.get("namespace") != NAMESPACE:
        return f"{subject.get('kind')}:{subject.get('namespace')}:{subject.get('name')}"
    return next((who for who, user in IDENTITIES.items() if user.endswith(":" + subject["name"])),
                f"ServiceAccount:{subject['name']}")


def manifest_grants(docs: Iterable[dict[str, Any]]) -> set[Grant]:
    """Every (identity, scope, group, resource, verb) the RBAC manifests grant. Wildcards are kept as
    "*" so that a comparison with the documented set fails on them."""
    docs = [d for d in docs if d]
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}
    grants: set[Grant] = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace")
        role = roles.get((ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"]))
        if role is None:
            raise ValueError(f"{binding['kind']} {binding['metadata']['name']} refers to a role not in config/rbac")
        where = "cluster" if binding["kind"] == "ClusterRoleBinding" else namespace
        for subject in binding.get("subjects") or []:
            who = _who(subject) or "?"
            for rule in role.get("rules") or []:
                if rule.get("nonResourceURLs") or rule.get("resourceNames"):
                    grants.add(Grant(who, where, "?", f"nonResource/resourceNames: {rule}", "?"))
                    continue
                for group in rule.get("apiGroups") or []:
                    for resource in rule.get("resources") or []:
                        for verb in rule.get("verbs") or []:
                            grants.add(Grant(who, where, group or "core", resource, verb))
    return grants


def rbac_manifests() -> list[dict[str, Any]]:
    """The documents of config/rbac as kustomize lists them."""
    kustomization = yaml.safe_load((RBAC_DIR / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((RBAC_DIR / name).read_text()) if d]
    return docs


# ---- kubectl auth can-i --list ----

@dataclass(frozen=True)
class CanIRow:
    resource: str  # kubectl's name: resource[.group][/subresource], "" for non-resource URLs
    non_resource_urls: tuple[str, ...]
    resource_names: tuple[str, ...]
    verbs: tuple[str, ...]


def _brackets(text: str) -> tuple[str, ...]:
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError(f"not a bracketed list: {text!r}")
    return tuple(text[1:-1].split())


def parse_can_i_list(text: str) -> list[CanIRow]:
    """`kubectl auth can-i --list` (the human table): columns found from the header's offsets, because
    the Resources cell is blank on non-resource rows."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Resources"):
        raise ValueError(f"unexpected can-i --list output: {text[:200]!r}")
    header = lines[0]
    starts = [header.index(col) for col in ("Resources", "Non-Resource URLs", "Resource Names", "Verbs")]
    rows = []
    for line in lines[1:]:
        cells = [line[a:b] for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows.append(CanIRow(cells[0].strip(), _brackets(cells[1]), _brackets(cells[2]), _brackets(cells[3])))
    return rows


def can_i_pairs(rows: Iterable[CanIRow]) -> set[tuple[str, str]]:
    """(resource or non-resource URL, verb) pairs, names-restricted rows marked so they never match."""
    pairs = set()
    for row in rows:
        targets = list(row.non_resource_urls) if not row.resource else [row.resource]
        if row.resource_names:
            targets = [f"{t}[names={','.join(row.resource_names)}]" for t in targets]
        pairs |= {(t, v) for t in targets for v in row.verbs}
    return pairs


# ---- no shell ----

SHELLS = ("sh", "bash", "dash", "zsh", "ash", "busybox")
# A path to a shell, or "sh -c ..." in a string. A bare "sh" is not flagged: it is also the name of an IPVS
# scheduler (source hashing); an argument list starting with "sh" is caught separately.
SHELL_LITERAL = re.compile(r"/(ba|da|z)?sh\b|/busybox\b|(^|\s)(ba|da|z)?sh\s+-c(\s|$)")
# Calls that hand a command line to /bin/sh.
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
               ("asyncio", "create_subprocess_shell")}
# Calls that start a program without a shell but also without commands.run's timeout and error handling:
# allowed in the local cluster's container shim (which must exec), not on the agent's code paths.
RAW_EXEC_CALLS = {("os", name) for name in ("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp",
                                            "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv",
                                            "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
                                            "fork", "forkpty")} | {("pty", "spawn"),
                                                                  ("asyncio", "create_subprocess_exec")}
SUBPROCESS_STARTERS = {"run", "Popen", "call", "check_call", "check_output"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _imported_from(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin of every `from x import y [as z]`, so a call `y()` is seen as `x.y()`."""
    return {alias.asname or alias.name: f"{node.module}.{alias.name}"
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names}


def shell_findings(source: str, path: str) -> list[Finding]:
    """Ways to run something through a shell: shell=True, os.system and friends, shell path literals."""
    tree = ast.parse(source, path)
    found = []
    imported_from = _imported_from(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            full = imported_from.get(name, name)
            if tuple(full.rsplit(".", 1)) in SHELL_CALLS:
                found.append(Finding(path, node.lineno, f"call to {full}"))
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    found.append(Finding(path, node.lineno, f"{name}(shell=...) not literally False"))
            if node.args and isinstance(node.args[0], ast.List) and node.args[0].elts:
                first = node.args[0].elts[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str) \
                        and Path(first.value).name in SHELLS:
                    found.append(Finding(path, node.lineno, f"argument list starting with a shell: {first.value!r}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SHELL_LITERAL.search(node.value):
            found.append(Finding(path, node.lineno, f"shell-like string literal {node.value!r}"))
    return found


def direct_process_starts(source: str, path: str) -> list[Finding]:
    """subprocess.run/Popen/..., os.exec*/spawn*/fork called directly, not through proxyshift.commands.run."""
    tree = ast.parse(source, path)
    found = []
    imported_from = _imported_from(tree)
    aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "subprocess" for alias in node.names if alias.name in SUBPROCESS_STARTERS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            full = imported_from.get(name, name)
            if ((name.startswith("subprocess.") and name.split(".", 1)[1] in SUBPROCESS_STARTERS) or name in aliases
                    or tuple(full.rsplit(".", 1)) in RAW_EXEC_CALLS):
                found.append(Finding(path, node.lineno, f"{full}() instead of proxyshift.commands.run"))
    return found


def module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    mods = set()
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            mods.add(base)
            mods |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in mods if m == "proxyshift" or m.startswith("proxyshift.")}


def import_closure(roots: Iterable[str]) -> dict[str, Path]:
    """Every proxyshift module the given modules import, transitively (static: what the agent can run)."""
    files = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    seen: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in files:
            continue
        seen[mod] = files[mod]
        todo += sorted(_imports(files[mod]) - set(seen))
    return seen


# ---- audit log ----

def audit_events(path: Path, offset: int = 0) -> Iterator[dict[str, Any]]:
    """The audit log's JSON events from byte `offset` on (a torn last line is skipped)."""
    with path.open("rb") as fh:
        fh.seek(offset)
        for line in fh:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
