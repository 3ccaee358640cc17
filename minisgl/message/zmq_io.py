"""Typed messages over ZMQ PUSH/PULL sockets. The receiving side binds, senders connect, so a
process needs only its own address to start and peers may come up in any order."""

from __future__ import annotations

from typing import Any

import zmq

from minisgl.message.codec import decode, encode


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    return sock


def push_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    # Drop unsent messages at close: a peer that is gone must not block our exit.
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(encode(msg), copy=False)


def recv(sock: zmq.Socket) -> Any:
    return decode(sock.recv())


def recv_nowait(sock: zmq.Socket) -> Any | None:
    try:
        return decode(sock.recv(zmq.NOBLOCK))
    except zmq.Again:
        return None

