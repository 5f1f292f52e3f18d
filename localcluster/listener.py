"""Test endpoints: listeners that answer with their own name (TCP: every connection; UDP: every datagram).

    python -m localcluster.listener --endpoint ps-ep-1:8080,8081 --endpoint ps-ep-2:8080 \
        --udp-endpoint ps-ep-1:5353

One process serves every endpoint namespace it is given: each listening socket
is made by a thread that has joined that namespace (sockets keep the namespace
they were made in), then one asyncio loop in the root namespace serves them all.
A thousand endpoints cost a thousand sockets, not a thousand interpreters.

The answer is the endpoint's name and a newline (`ps-ep-3\\n`), so a client can
tell which endpoint kube-proxy sent it to. UDP is request/response like DNS: each
datagram gets one datagram back, the name and a newline followed by the request's
first UDP_ECHO_LIMIT bytes, so a client can tell which of its requests was answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from pathlib import Path
from typing import Any, cast

from localcluster.container import run_in_netns


def parse_endpoint(spec: str) -> tuple[str, list[int]]:
    """'ps-ep-1:8080,8081' -> ('ps-ep-1', [8080, 8081])."""
    name, sep, ports = spec.partition(":")
    if not sep or not name or not ports:
        raise ValueError(f"bad --endpoint {spec!r}: want NETNS:PORT[,PORT...]")
    return name, [int(p) for p in ports.split(",")]


UDP_ECHO_LIMIT = 512  # a classic DNS message's size


def udp_answer(name: str, request: bytes) -> bytes:
    """What a UDP endpoint sends back for one datagram."""
    return f"{name}\n".encode() + request[:UDP_ECHO_LIMIT]


class UDPAnswerer(asyncio.DatagramProtocol):
    """Answers every datagram with the endpoint's name (and the start of the request)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport in 3.11.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(udp_answer(self.name, data), addr)


def udp_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.setblocking(False)
    return sock


def listening_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(endpoints: list[tuple[str, list[int]]], ready_file: Path | None,
                udp_endpoints: list[tuple[str, list[int]]] | None = None) -> None:
    servers = []
    transports: list[asyncio.BaseTransport] = []
    loop = asyncio.get_running_loop()
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
    for name, ports in udp_endpoints or []:
        for port in ports:
            sock = run_in_netns(name, udp_socket, port)
            # mypy cannot type a lambda whose default binds the loop variable (python/mypy#15459).
            udp_transport, _ = await loop.create_datagram_endpoint(
                lambda name=name: UDPAnswerer(name), sock=sock)  # type: ignore[misc]
            transports.append(udp_transport)
    if ready_file is not None:
        ready_file.write_text(f"{sum(len(p) for _, p in endpoints) + len(transports)} sockets\n")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()
    for transport in transports:
        transport.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="localcluster.listener", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", action="append", default=[], metavar="NETNS:PORT[,PORT...]",
                        help="TCP ports of an endpoint namespace")
    parser.add_argument("--udp-endpoint", action="append", default=[], metavar="NETNS:PORT[,PORT...]",
                        help="UDP ports of an endpoint namespace")
    parser.add_argument("--ready-file", type=Path, help="written once every socket listens")
    args = parser.parse_args(argv)
    if not args.endpoint and not args.udp_endpoint:
        parser.error("give at least one --endpoint or --udp-endpoint")
    asyncio.run(serve([parse_endpoint(spec) for spec in args.endpoint], args.ready_file,
                      [parse_endpoint(spec) for spec in args.udp_endpoint]))


if __name__ == "__main__":
    main()
