"""The kubeconfig a `proxyshift` command is given: every way it can be unusable is one line, exit code 2.

The kubernetes client's loader answers a YAML error, binary content or YAML of another shape with a
traceback (yaml's errors, UnicodeDecodeError, TypeError, KeyError), and a missing file with "No
configuration found". Every command that takes --kubeconfig (status, plan, diagnose, restore-baseline,
the operator, the agent) loads the client's configuration inside `loading`, which checks the file it
names first (check_kubeconfig) and turns whatever the loader still raises (an unknown context, a bad
file through $KUBECONFIG, which the client may merge from several) into the same kind of line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import yaml
from kubernetes.config.config_exception import ConfigException

from proxyshift.manifest import UsageError, _one_line, read_text

# A kubeconfig is a few KiB, more with embedded certificates for many clusters; this is far past any.
MAX_KUBECONFIG_BYTES = 8 * 1024 * 1024
# What kubernetes.config.load_kube_config / load_incluster_config raise for a file or context they cannot use.
LOAD_ERRORS: tuple[type[Exception], ...] = (ConfigException, OSError, ValueError, yaml.YAMLError, TypeError,
                                            KeyError, AttributeError)
PREFIX = "cannot load the cluster's kubeconfig"


def check_kubeconfig(path: str) -> None:
    """A UsageError (one line) unless `path` is a readable kubeconfig: YAML, one mapping, with lists of
    clusters and contexts. It checks the shape the client needs, not the content: a context that names
    no cluster is still the client's error, which the callers turn into one line with refused()."""
    try:
        _check_kubeconfig(path)
    except UsageError as exc:
        # The same words as the client's own refusals (controller/cliargs.py), so that one grep finds both.
        raise UsageError(f"{PREFIX}: {exc}") from None


def _check_kubeconfig(path: str) -> None:
    what = "a kubeconfig"
    text = read_text(path, what=what, flag="--kubeconfig FILE", max_bytes=MAX_KUBECONFIG_BYTES)
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None][:2]
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML: {_one_line(exc)}") from None
    if not documents:
        raise UsageError(f"{path}: empty; not {what}")
    if len(documents) > 1:
        raise UsageError(f"{path}: more than one YAML document; not {what}")
    config = documents[0]
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a YAML {type(config).__name__}, not {what} "
                         "(a mapping with clusters and contexts)")
    if config.get("kind", "Config") != "Config":
        raise UsageError(f"{path}: a {_one_line(config.get('kind'))[:64]}, not {what} (kind: Config)")
    for key in ("clusters", "contexts"):
        entries = config.get(key)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise UsageError(f"{path}: not {what}: '{key}' is not a list of entries")


def refused(exc: Exception, kubeconfig: str | None, context: str | None, *, where_default: str) -> UsageError:
    """The one line for an error of LOAD_ERRORS, naming the file (or where the client looked) and the context."""
    which = f", context {context!r}" if context else ""
    return UsageError(f"{PREFIX} ({kubeconfig or where_default}{which}): {_one_line(exc)[:300]}")


@contextmanager
def loading(kubeconfig: str | None, context: str | None, *, where_default: str) -> Iterator[None]:
    """Around loading the client's configuration: the file --kubeconfig names is checked first, and an error of
    LOAD_ERRORS raised in the block becomes one line (`where_default`: where the client looks without it)."""
    if kubeconfig:
        check_kubeconfig(kubeconfig)
    try:
        yield
    except LOAD_ERRORS as exc:
        raise refused(exc, kubeconfig, context, where_default=where_default) from None
