"""ContinuousProber's child process (the cgroup-joining prober): its line protocol and its stop, without root.

The child is started without --cgroup/--netns here (it then probes from this namespace), so what is
tested is everything but the join, which is localcluster.cilium.join_node's (the e2e tests use it).
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localcluster import workloads

pytestmark = pytest.mark.unit


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 answering every connection with `ps-ep-1\\n`; yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"ps-ep-1\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


class HereProber(workloads.ContinuousProber):
    """The child without the join: probes from this test's own namespace."""

    def child_argv(self) -> list[str]:
        argv = super().child_argv()
        at = argv.index("--cgroup")
        del argv[at:at + 4]  # --cgroup DIR --netns NODE
        return argv


def test_child_argv_joins_the_nodes_cgroup_and_netns() -> None:
    prober = workloads.ContinuousProber("ps-node-1", "198.19.0.10", 80, cgroup=Path("/sys/fs/cgroup/x"),
                                        interval=0.1, timeout=0.5)
    argv = prober.child_argv()
    assert argv[1:4] == ["-m", "localcluster.workloads", "probe"]
    assert argv[argv.index("--cgroup") + 1] == "/sys/fs/cgroup/x" and argv[argv.index("--netns") + 1] == "ps-node-1"
    assert argv[-2:] == ["198.19.0.10", "80"]


def test_probe_stream_writes_one_line_per_attempt_and_stops_on_end_of_file(listener: int) -> None:
    read_end, write_end = os.pipe()
    out = io.StringIO()
    closer = threading.Timer(0.3, os.close, (write_end,))
    closer.start()
    try:
        attempts = workloads.probe_stream("127.0.0.1", listener, interval=0.02, timeout=1.0, stop_fd=read_end,
                                          out=out)
    finally:
        closer.join()
        os.close(read_end)
    lines = out.getvalue().splitlines()
    assert attempts == len(lines) >= 3
    assert all('"ok": true' in line and '"detail": "ps-ep-1"' in line for line in lines)


def test_child_prober_counts_answers_and_failures(listener: int) -> None:
    prober = HereProber("here", "127.0.0.1", listener, interval=0.02, timeout=0.5, cgroup=Path("/nowhere")).start()
    time.sleep(0.5)
    result = prober.stop()
    assert result.ok >= 3 and result.failed == 0 and set(result.served_by) == {"ps-ep-1"}

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    refused = HereProber("here", "127.0.0.1", closed_port, interval=0.02, timeout=0.5,
                         cgroup=Path("/nowhere")).start()
    time.sleep(0.3)
    result = refused.stop()
    assert result.ok == 0 and result.failed >= 2
    assert set(result.errors) == {"ConnectionRefusedError: Connection refused"}
    assert len(refused.failures) == result.failed and all(at <= time.time() for at, _ in refused.failures)


def test_a_child_that_cannot_join_is_an_error() -> None:
    prober = workloads.ContinuousProber("ps-no-such-node", "127.0.0.1", 9, cgroup=Path("/nonexistent/cgroup"))
    prober.start()
    with pytest.raises(RuntimeError, match="exited"):
        prober.stop()
