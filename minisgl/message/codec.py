"""One encode/decode path for every message: msgpack, with dataclasses as extension types.

A registered dataclass is packed as ExtType(1, msgpack([tag, field values...])), so messages
nest freely (a batch holding a list of items) and decode back to the same classes. Field
values must themselves be msgpack types (None, bool, int, float, str, bytes, list, dict) or
registered dataclasses; tuples come back as lists.

Decoding restores an object, it does not construct one: the fields are set without calling
`__init__` (so no `__post_init__` runs). Every sender is one of this server's processes, which
built the object through its constructor; a request's SamplingParams, for one, is validated
once in the API process and must not be re-validated (and re-normalized) at every hop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgpack

_EXT_MESSAGE = 1
_BY_TAG: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
T = TypeVar("T")


def register(cls: type[T]) -> type[T]:
    """Registers the dataclass `cls` under its class name: for shared types defined below
    message/ (minisgl.core), which cannot use the decorator."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    tag = cls.__name__
    if tag in _BY_TAG and _BY_TAG[tag] is not cls:
        raise TypeError(f"two message classes are named {tag!r}")
    _BY_TAG[tag] = cls
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls


def message(cls: type[T]) -> type[T]:
    """Class decorator: makes `cls` a dataclass and registers it."""
    if not dataclasses.is_dataclass(cls):
        cls = dataclasses.dataclass(cls)
    return register(cls)


def _default(obj: Any) -> msgpack.ExtType:
    fields = _FIELDS.get(type(obj))
    if fields is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message")
    values = [type(obj).__name__, *(getattr(obj, f) for f in fields)]
    return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb(values, default=_default, use_bin_type=True))


def _restore(cls: type, values: list[Any]) -> Any:
    fields = _FIELDS[cls]
    if len(values) != len(fields):
        raise ValueError(f"{cls.__name__}: {len(values)} values for {len(fields)} fields")
    obj = cls.__new__(cls)
    for name, value in zip(fields, values):
        object.__setattr__(obj, name, value)  # frozen dataclasses too
    return obj


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_MESSAGE:
        return msgpack.ExtType(code, data)
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise ValueError(f"unknown message type {tag!r}")
    return _restore(cls, values)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
