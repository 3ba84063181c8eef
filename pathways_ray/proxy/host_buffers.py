"""A session's host buffers: the bytes of ``device_put`` on their way in, and of
``np.asarray`` on their way out (the protocol's ``HostBufferStore``/``Lookup``/
``Delete`` calls, beside the session's stream). Pure: threads only.

A request that names a buffer may arrive before the buffer does (they travel on
different calls), so a lookup waits for it, up to a timeout that its error names.
"""

from __future__ import annotations

import threading
import time

__all__ = ["HostBuffers"]


class HostBuffers:
    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self._data: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self._closed = ""

    def store(self, handle: int, data: bytes) -> None:
        with self._cond:
            if handle in self._data:
                raise ValueError(f"host buffer {handle} is stored already")
            self._data[handle] = data
            self._cond.notify_all()

    def lookup(self, handle: int, timeout_s: float | None = None) -> bytes:
        """The buffer's bytes, once they have arrived; ``TimeoutError`` naming the
        handle and the timeout, or ``RuntimeError`` once the session closed."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while handle not in self._data:
                if self._closed:
                    raise RuntimeError(f"host buffer {handle}: {self._closed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"host buffer {handle} did not arrive within "
                                       f"{timeout_s:.0f} s")
                self._cond.wait(left)
            return self._data[handle]

    def take(self, handle: int, timeout_s: float | None = None) -> bytes:
        """Look a buffer up and forget it (a buffer a request consumed)."""
        data = self.lookup(handle, timeout_s)
        self.delete(handle)
        return data

    def delete(self, handle: int) -> bool:
        with self._cond:
            return self._data.pop(handle, None) is not None

    def close(self, reason: str = "the session closed") -> None:
        with self._cond:
            self._closed = reason
            self._data.clear()
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._data)
