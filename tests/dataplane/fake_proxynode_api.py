"""A one-ProxyNode API server for running the real agent process in a test namespace.

The spec comes from <state>/spec.json (re-read on every request, so a test can
change the operation); every status merge patch is applied (RFC 7386) and the
whole object written to <state>/object.json for the test to read. Watches are
idle and end after their timeoutSeconds, after which the agent GETs again.

    python -m tests.dataplane.fake_proxynode_api --port 16444 --state DIR --node ps-node-1
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.parse
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.fake_http import JsonHandler, merge_patch

PREFIX = "/apis/proxyshift.io/v1alpha1/proxynodes"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=16444)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--node", default="ps-node-1")
    args = p.parse_args(argv)
    lock = threading.Lock()
    status: dict[str, Any] = {}
    version = [1]

    def obj() -> dict[str, Any]:
        spec_file = args.state / "spec.json"
        spec = json.loads(spec_file.read_text()) if spec_file.exists() else {}
        if "status" in spec:  # a test may plant a status (e.g. an operation left Running)
            status.update(spec.pop("status"))
            spec_file.write_text(json.dumps(spec))
        return {"apiVersion": "proxyshift.io/v1alpha1", "kind": "ProxyNode",
                "metadata": {"name": args.node, "resourceVersion": str(version[0])},
                "spec": spec, "status": status}

    class Handler(JsonHandler):
        log_prefix = "fake-proxynode-api"

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            with lock:
                current = obj()
            if url.path == f"{PREFIX}/{args.node}":
                self.send_json(200, current)
            elif url.path == PREFIX and query.get("watch") == ["true"]:
                # Like the API server: a MODIFIED event whenever the object changes (a
                # test editing spec.json, or a status patch), until the timeout.
                self.start_stream()
                deadline = time.monotonic() + min(float(query.get("timeoutSeconds", ["5"])[0]), 30.0)
                sent = json.dumps({k: current[k] for k in ("spec", "status")}, sort_keys=True)
                while time.monotonic() < deadline:
                    time.sleep(0.2)
                    with lock:
                        now = obj()
                    seen = json.dumps({k: now[k] for k in ("spec", "status")}, sort_keys=True)
                    if seen != sent:
                        sent = seen
                        version[0] += 1
                        now["metadata"]["resourceVersion"] = str(version[0])
                        self.send_event({"type": "MODIFIED", "object": now})
                self.end_stream()
            else:
                self.not_found(url.path)

        def do_PATCH(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if url.path != f"{PREFIX}/{args.node}/status" or \
                    self.headers.get("Content-Type") != "application/merge-patch+json":
                self.send_json(415, {"kind": "Status", "code": 415, "message": "merge patch of status only"})
                return
            with lock:
                current = obj()
                # current["status"] is `status` itself: merge first, then replace its contents.
                merged = merge_patch(current["status"], body.get("status", {}))
                status.clear()
                status.update(merged)
                version[0] += 1
                current = obj()
                tmp = args.state / "object.json.tmp"
                tmp.write_text(json.dumps(current))
                tmp.replace(args.state / "object.json")
            self.send_json(200, current)

    srv = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.daemon_threads = True
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
