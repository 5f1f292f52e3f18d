"""A small parser of iptables-save output (there is no library for it).

It keeps every rule line exactly as iptables-save printed it, because the flush
deletes rules by their own text (`-D <chain> <spec>`) and the tests compare the
user's lines byte for byte before and after.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})

# A double-quoted argument as iptables-save prints it (backslash escapes inside).
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


class IptablesSaveError(ValueError):
    """The text is not iptables-save output."""


@dataclass(frozen=True)
class Rule:
    chain: str
    line: str            # the whole "-A CHAIN ..." line, verbatim
    target: str | None   # the -j/-g target, if any

    @property
    def spec(self) -> str:
        """The rule without its "-A CHAIN " prefix, as `-D CHAIN <spec>` wants it."""
        return self.line.split(" ", 2)[2] if self.line.count(" ") >= 2 else ""


@dataclass
class Table:
    name: str
    chains: dict[str, str] = field(default_factory=dict)   # chain -> its ":CHAIN POLICY [p:b]" line
    rules: list[Rule] = field(default_factory=list)

    def user_defined(self) -> list[str]:
        return [c for c in self.chains if c not in BUILTIN_CHAINS]


@dataclass
class Dump:
    tables: dict[str, Table] = field(default_factory=dict)

    def chain_count(self) -> int:
        return sum(len(t.user_defined()) for t in self.tables.values())


def rule_target(line: str) -> str | None:
    """The chain or target a rule jumps/goes to (text after -j/-g outside quotes)."""
    tokens = _QUOTED.sub('""', line).split()
    target = None
    for i, tok in enumerate(tokens[:-1]):
        if tok in ("-j", "--jump", "-g", "--goto"):
            target = tokens[i + 1]
    return target


def rule_sets(line: str) -> list[str]:
    """ipset names a rule matches (--match-set NAME)."""
    tokens = _QUOTED.sub('""', line).split()
    return [tokens[i + 1] for i, tok in enumerate(tokens[:-1]) if tok == "--match-set"]


def parse(text: str) -> Dump:
    dump = Dump()
    table: Table | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\n")
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            table = Table(line[1:].strip())
            dump.tables[table.name] = table
        elif line == "COMMIT":
            table = None
        elif table is None:
            raise IptablesSaveError(f"line {lineno}: {line[:80]!r} outside a *table ... COMMIT block")
        elif line.startswith(":"):
            name = line[1:].split(" ", 1)[0]
            table.chains[name] = line
        elif line.startswith("-A "):
            parts = line.split(" ", 2)
            if len(parts) < 2:
                raise IptablesSaveError(f"line {lineno}: rule without a chain")
            table.rules.append(Rule(parts[1], line, rule_target(line)))
        else:
            raise IptablesSaveError(f"line {lineno}: unexpected {line[:80]!r}")
    return dump
