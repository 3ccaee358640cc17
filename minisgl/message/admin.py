"""Admin messages between the API server and the schedulers: `POST /flush_cache`.

The API server sends FlushCacheMsg to scheduler rank 0's address (with --dp the DP controller,
which forwards it to every replica, as it does aborts); each replica's rank 0 applies it in
lockstep with its TP ranks and answers with a FlushCacheReply of its own."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.message.codec import message


@message
@dataclass
class FlushCacheMsg:
    request_id: int  # which call the replies belong to


@message
@dataclass
class FlushCacheReply:
    request_id: int
    dp_rank: int
    refused: str | None = None  # why the cache was not flushed (None: flushed)
