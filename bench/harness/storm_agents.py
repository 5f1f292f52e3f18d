"""One process of bench_reconnect_storm.py's agent fleet: the REAL agent's watch loop, many times over.

    python -m bench.harness.storm_agents --kubeconfig K --first 0 --count 625 --backoff jitter

Each simulated agent is a proxyshift.agent.loop.Agent whose `_watch_loop` (GET, watch from the
resourceVersion, GET again after an error, the jittered back-off) runs in a thread of its own,
against the real kubernetes client (KubeProxyNodeAPI). Only the thread that runs the agent's
watch: the main loop (kube-proxy probes, status writes) would measure nothing about reconnects.
Nothing about the watch or the back-off is reimplemented here; what is added is a recorder
around the client's two calls (the GET and the watch request) and around the watch stream.

One thread per agent because that is what the agent does (one watch thread). Several hundred
per process: the threads sit in socket reads, and the coordinator starts several processes so
no single interpreter's lock serialises thousands of TLS handshakes.

Protocol: on stdout, one JSON line a second {"t", "started", "live"}; on stdin, "verify K"
(a status write to K of this process's ProxyNodes, then wait until each agent's own watch
delivered it; answers {"verified": n, "of": K}), and "dump PATH" (write every request record
and exit at once: the watches are still open and would hold threads for minutes).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import kubernetes
from kubernetes.client.exceptions import ApiException

from bench.harness import cpu_group
from proxyshift.agent.effects import NodeEffects
from proxyshift.agent.loop import Agent, AgentConfig, KubeProxyNodeAPI, client_configuration

# (agent index, request sent, answered, verb, outcome): verb "get" / "watch" for the two requests
# the agent makes, "end" for a watch stream that ended; outcome the HTTP status, "conn" for no answer
# (refused, reset, timed out), and for "end" "clean" or "error".
Record = tuple[int, float, float, str, str]


def node_name(i: int) -> str:
    return f"storm-node-{i:05d}"


class Recorder:
    def __init__(self) -> None:
        self.records: list[Record] = []  # list.append is atomic: no lock needed across the agents' threads

    def add(self, idx: int, t0: float, verb: str, outcome: str) -> None:
        self.records.append((idx, t0, time.monotonic(), verb, outcome))


class _CountedCustomObjects:
    """The client's CustomObjectsApi, with the agent's GET and watch request recorded.

    functools.wraps keeps each method's signature and docstring: kubernetes.watch.Watch reads
    them to find the return type and the watch argument, as it does for the real method.
    """

    def __init__(self, real: Any, rec: Recorder, idx: int, owner: StormAPI) -> None:
        self._real, self._rec, self._idx, self._owner = real, rec, idx, owner
        self.get_cluster_custom_object = self._wrap("get", real.get_cluster_custom_object)
        self.list_cluster_custom_object = self._wrap("watch", real.list_cluster_custom_object)

    def _wrap(self, verb: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                out = fn(*args, **kwargs)
            except ApiException as exc:
                self._rec.add(self._idx, t0, verb, str(exc.status or "conn"))  # status 0: the client's own failure
                raise
            except Exception:
                self._rec.add(self._idx, t0, verb, "conn")
                raise
            status = getattr(out, "status", 200) if verb == "watch" else 200
            self._rec.add(self._idx, t0, verb, str(status))
            if verb == "watch" and isinstance(status, int) and 200 <= status < 300:
                self._owner.live_since = time.monotonic()  # headers in: the API server holds the watch open
            return out
        return call

    def __getattr__(self, name: str) -> Any:  # the status write the verification makes
        return getattr(self._real, name)


class StormAPI(KubeProxyNodeAPI):
    """The agent's real ProxyNode client, recorded."""

    def __init__(self, api_client: Any, rec: Recorder, idx: int) -> None:
        super().__init__(api_client)
        self._rec, self._idx = rec, idx
        self.live_since: float | None = None
        # Duck-typed: the two calls the agent makes, recorded; everything else passed through.
        self._api = cast(Any, _CountedCustomObjects(self._api, rec, idx, self))

    def watch(self, name: str, resource_version: str | None, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
        t0, outcome = time.monotonic(), "clean"
        try:
            yield from super().watch(name, resource_version, timeout)
        except Exception:
            outcome = "error"
            raise
        finally:
            if self.live_since is not None:
                self._rec.add(self._idx, t0, "end", outcome)
            self.live_since = None


class SeenEvents(queue.Queue[dict[str, Any]]):
    """The agent's event queue, keeping only the newest resourceVersion its watch delivered."""

    rv: int = 0

    def put(self, item: dict[str, Any], block: bool = True, timeout: float | None = None) -> None:
        rv = (item.get("metadata") or {}).get("resourceVersion")
        if rv and rv.isdigit():
            self.rv = max(self.rv, int(rv))


def verify(agents: list[tuple[Agent, StormAPI, SeenEvents]], k: int, timeout: float = 30.0) -> int:
    """Write the status of `k` of the ProxyNodes and count the agents whose own watch brings the write back."""
    pick = agents[:: max(1, len(agents) // max(1, k))][:k]
    wanted: list[tuple[SeenEvents, int]] = []
    token = f"storm-{time.time_ns()}"
    for agent, api, seen in pick:
        out = api.patch_status(agent.cfg.node, {"kernelRelease": token})
        wanted.append((seen, int(out["metadata"]["resourceVersion"])))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(seen.rv < rv for seen, rv in wanted):
        time.sleep(0.2)
    return sum(1 for seen, rv in wanted if seen.rv >= rv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--backoff", choices=("jitter", "none"), default="jitter")
    p.add_argument("--ramp", type=float, default=100.0, help="agents started per second (the first connects)")
    p.add_argument("--watch-timeout", type=int, default=AgentConfig.watch_timeout)
    p.add_argument("--cpu-group", default="",
                   help="an idle CPU group to join (bench/harness/cpu_group.py): the fleet stands in for N machines "
                        "and must not take the API server's CPU")
    p.add_argument("--nice", type=int, default=19, help="the fleet's niceness, without --cpu-group")
    args = p.parse_args(argv)
    if args.cpu_group:
        cpu_group.join(Path(args.cpu_group))
    else:
        os.nice(max(0, args.nice - os.nice(0)))
    # The threads block in socket reads; the default 8 MiB stacks would only cost address space, but
    # a small one keeps a few thousand of them cheap to create.
    threading.stack_size(512 * 1024)
    conf = client_configuration(args.kubeconfig)  # the agent's own: its retries too
    # Connections kept for each agent, as on a real fleet (each agent its own client): every agent's watch
    # holds one, and its GET takes another that the next watch reuses. Set before the ApiClient exists: its
    # pool reads the size once. (Until 2026-12-05 it was set after, the pool kept 10, and every other GET's
    # connection was dropped, so that agent's watch paid a TLS handshake of its own.)
    conf.connection_pool_maxsize = 2 * args.count + 8
    api_client = kubernetes.client.ApiClient(conf)
    rec = Recorder()
    # Constant 1.0: the back-off without jitter (Agent.backoff_draw), the comparison's other side.
    draw: Callable[[], float] = random.random if args.backoff == "jitter" else (lambda: 1.0)
    stop = threading.Event()
    agents: list[tuple[Agent, StormAPI, SeenEvents]] = []
    for i in range(args.first, args.first + args.count):
        api = StormAPI(api_client, rec, i)
        # The watch thread never touches the node: no effects.
        agent = Agent(AgentConfig(node=node_name(i), listen="", watch_timeout=args.watch_timeout), api,
                      cast(NodeEffects, None), backoff_draw=draw)
        agents.append((agent, api, SeenEvents()))

    threads: list[threading.Thread] = []

    def report() -> None:
        while True:
            live = sum(1 for _, api, _ in agents if api.live_since is not None)
            print(json.dumps({"t": time.monotonic(), "started": len(threads), "live": live}), flush=True)
            time.sleep(1.0)

    threading.Thread(target=report, daemon=True, name="report").start()
    for agent, _api, seen in agents:
        thread = threading.Thread(target=agent._watch_loop, args=(seen, stop), daemon=True, name=agent.cfg.node)
        thread.start()
        threads.append(thread)
        time.sleep(1.0 / args.ramp)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "verify":
            k = int(cmd[1])
            try:
                ok = verify(agents, k)
            except Exception as exc:  # the coordinator prints it; the fleet keeps running
                print(json.dumps({"verify_error": repr(exc)}), flush=True)
            else:
                print(json.dumps({"verified": ok, "of": k}), flush=True)
        elif cmd and cmd[0] == "dump":
            with open(cmd[1], "w") as f:
                json.dump(rec.records, f)
            sys.stdout.flush()
            os._exit(0)  # the watches are open; their threads would hold the exit for minutes
    return 0


if __name__ == "__main__":
    sys.exit(main())
