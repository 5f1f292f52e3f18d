"""Reading a person's files for the CLI (a manifest, a kubeconfig): every way one can be wrong is one line
and exit code 2.

`proxyshift plan -f` is the first thing a platform engineer runs on a policy they just wrote; a
traceback for a typo in the path or a tab in the YAML tells them nothing. UsageError carries the one
line, and `proxyshift.cli` prints it with the command's name and exits 2 (argparse's code for bad usage).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

MAX_MANIFEST_BYTES = 1024 * 1024  # a policy is a few KiB; a larger file is not one
MAX_DOCUMENTS = 64


class UsageError(Exception):
    """Bad input from the person at the terminal: one line, exit code 2."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def read_text(path: str, *, what: str = "a YAML manifest", flag: str = "-f FILE, or - for stdin",
              max_bytes: int = MAX_MANIFEST_BYTES) -> str:
    """The file's text, or a UsageError saying in one line why it is not `what` (`flag`: how to give it)."""
    if path == "-":
        data = sys.stdin.buffer.read(max_bytes + 1)
    else:
        file = Path(path)
        if file.is_dir():
            raise UsageError(f"{path}: is a directory; give {what} file ({flag})")
        try:
            with file.open("rb") as handle:
                data = handle.read(max_bytes + 1)
        except FileNotFoundError:
            raise UsageError(f"{path}: no such file") from None
        except OSError as exc:
            raise UsageError(f"{path}: cannot read it: {os.strerror(exc.errno or 0) or exc}") from None
    if len(data) > max_bytes:
        raise UsageError(f"{path}: larger than {max_bytes // 1024} KiB; not {what}")
    if b"\0" in data:
        raise UsageError(f"{path}: a binary file, not {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start}); not {what}") from None


def read_manifest(path: str, kind: str) -> dict[str, Any]:
    """The one document of `kind` in the file (a multi-document file may hold others)."""
    text = read_text(path)
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None][: MAX_DOCUMENTS + 1]
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML: {_one_line(exc)}") from None
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == kind]
    if not found:
        kinds = sorted({str(d.get("kind")) for d in documents if isinstance(d, dict)}) or ["nothing"]
        raise UsageError(f"{path}: no {kind} in it (found {', '.join(kinds)})")
    if len(found) > 1:
        raise UsageError(f"{path}: {len(found)} {kind} manifests; give one at a time")
    return found[0]
