"""Typed messages between the server's processes (DESIGN §1), msgpack-encoded."""

from minisgl.message.admin import FlushCacheMsg, FlushCacheReply
from minisgl.message.codec import decode, encode, message
from minisgl.message.replies import (
    DetokenizeMsg,
    PromptEcho,
    Ready,
    ReadyMsg,
    ReplyBatch,
    StartMsg,
    StatsMsg,
    TokenOut,
    UserReply,
)
from minisgl.message.requests import AbortMsg, DecodeMsg, DetokInit, TokenizeMsg, UserMsg

__all__ = [
    "AbortMsg",
    "DecodeMsg",
    "DetokInit",
    "DetokenizeMsg",
    "FlushCacheMsg",
    "FlushCacheReply",
    "PromptEcho",
    "Ready",
    "ReadyMsg",
    "ReplyBatch",
    "StartMsg",
    "StatsMsg",
    "TokenOut",
    "TokenizeMsg",
    "UserMsg",
    "UserReply",
    "decode",
    "encode",
    "message",
]
