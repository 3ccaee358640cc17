"""A KV-event subscriber's two sockets, as tests use them: the live SUB stream and the replay
socket (minisgl/message/kv_events.py says the wire format)."""

from __future__ import annotations

import msgpack
import zmq


def receive(sub: zmq.Socket, got: dict[int, list], topic: bytes, quiet_ms: int = 100) -> None:
    """Adds to `got` (sequence number -> batch) what arrives until none has for `quiet_ms`."""
    while sub.poll(quiet_ms):
        got_topic, seq, payload = sub.recv_multipart()
        assert got_topic == topic
        got[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)


def replay(endpoint: str, start: int = 0) -> dict[int, list]:
    """Every batch the publisher still holds from sequence number `start` on, by its number."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: dict[int, list] = {}
    try:
        while True:
            assert dealer.poll(10_000), f"no answer from the replay socket {endpoint}"
            _, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:  # the end of the replay
                assert payload == b""
                return got
            got[n] = msgpack.unpackb(payload)
    finally:
        dealer.close()
