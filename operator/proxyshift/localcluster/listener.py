"""Test endpoints: TCP listeners that answer every connection with their own name, then close.

    python -m proxyshift.localcluster.listener --endpoint ps-ep-1:8080,8081 --endpoint ps-ep-2:8080

One process serves every endpoint namespace it is given: each listening socket
is made by a thread that has joined that namespace (sockets keep the namespace
they were made in), then one asyncio loop in the root namespace serves them all.
A thousand endpoints cost a thousand sockets, not a thousand interpreters.

The answer is the endpoint's name and a newline (`ps-ep-3\\n`), so a client can
tell which endpoint kube-proxy sent it to.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from pathlib import Path

from proxyshift.localcluster.container import run_in_netns


def parse_endpoint(spec: str) -> tuple[str, list[int]]:
    """'ps-ep-1:8080,8081' -> ('ps-ep-1', [8080, 8081])."""
    name, sep, ports = spec.partition(":")
    if not sep or not name or not ports:
        raise ValueError(f"bad --endpoint {spec!r}: want NETNS:PORT[,PORT...]")
    return name, [int(p) for p in ports.split(",")]


def listening_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(endpoints: list[tuple[str, list[int]]], ready_file: Path | None) -> None:
    servers = []
    for name, ports in endpoints:
        answer = f"{name}\n".encode()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes = answer) -> None:
            with contextlib.suppress(OSError):
                writer.write(answer)
                await writer.drain()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

        for port in ports:
            sock = run_in_netns(name, listening_socket, port)
            servers.append(await asyncio.start_server(handle, sock=sock))
    if ready_file is not None:
        ready_file.write_text(f"{sum(len(p) for _, p in endpoints)} sockets\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="proxyshift.localcluster.listener", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", action="append", required=True, metavar="NETNS:PORT[,PORT...]")
    parser.add_argument("--ready-file", type=Path, help="written once every socket listens")
    args = parser.parse_args(argv)
    asyncio.run(serve([parse_endpoint(spec) for spec in args.endpoint], args.ready_file))


if __name__ == "__main__":
    main()
