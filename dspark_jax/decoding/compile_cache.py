"""A bounded, least-recently-used cache of compiled programs (or anything costly to build).

Process-wide caches of compiled XLA executables let repeated calls with the same shapes skip
compilation, but a long-lived process (a notebook sweeping prompt lengths, a server) must not
keep every executable it ever built: :class:`LRUCache` holds at most ``maxsize`` entries and
drops the least recently used one beyond that.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LRUCache"]


class LRUCache:
    """At most ``maxsize`` values by hashable key; the least recently used is evicted first.

    Thread-safe for :meth:`get_or_build` bookkeeping (two threads missing the same key may
    both build; the second result replaces the first, which is harmless for pure builds).

    Raises:
      ValueError: ``maxsize < 1``.
    """

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value of ``key``, built with ``build()`` (and stored) on a miss."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        value = build()
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
