"""One encode/decode path for every message: msgpack, with dataclasses as extension types.

A registered dataclass is packed as ExtType(1, msgpack([tag, field values...])), so messages
nest freely (a batch holding a list of items) and decode back to the same classes. Field
values must themselves be msgpack types (None, bool, int, float, str, bytes, list, dict) or
registered dataclasses; tuples come back as lists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgpack

_EXT_MESSAGE = 1
_BY_TAG: dict[str, type] = {}
T = TypeVar("T")


def message(cls: type[T]) -> type[T]:
    """Class decorator: makes `cls` a dataclass and registers it under its class name."""
    if not dataclasses.is_dataclass(cls):
        cls = dataclasses.dataclass(cls)
    tag = cls.__name__
    if tag in _BY_TAG and _BY_TAG[tag] is not cls:
        raise TypeError(f"two message classes are named {tag!r}")
    _BY_TAG[tag] = cls
    cls._msg_fields = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[attr-defined]
    return cls


def _default(obj: Any) -> msgpack.ExtType:
    fields = getattr(type(obj), "_msg_fields", None)
    if fields is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message")
    values = [type(obj).__name__, *(getattr(obj, f) for f in fields)]
    return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb(values, default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_MESSAGE:
        return msgpack.ExtType(code, data)
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise ValueError(f"unknown message type {tag!r}")
    return cls(*values)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
