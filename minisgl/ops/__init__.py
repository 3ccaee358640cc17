"""The one place that picks an implementation per op: minisgl._C, Triton, or torch reference."""

from minisgl.ops.store import store_kv, store_kv_reference

__all__ = ["store_kv", "store_kv_reference"]
