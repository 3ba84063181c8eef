"""A session's host buffers: the bytes of ``device_put`` on their way in, and of
``np.asarray`` on their way out (the protocol's ``HostBufferStore``/``Lookup``/
``Delete`` calls, beside the session's stream). Pure: threads and numpy.

A request that names a buffer may arrive before the buffer does (they travel on
different calls), so a lookup waits for it, up to a timeout that its error names.

``host_array`` reads an array out of a buffer within the buffer's bytes only: the
shape, dtype and byte strides a request gives must describe exactly the bytes
stored, as IFRT's own ``ArrayMemRegion::FromMinimalMemRegion`` requires (positive
strides, multiples of the element size, the region minimal); anything else is an
``InvalidArgument`` naming the values, and nothing outside the buffer is read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from pathways_ray.proxy.errors import InvalidArgument, Unimplemented

__all__ = ["HostBuffers", "host_array"]

MAX_ELEMENTS = 1 << 40  # no array of more elements than this exists on a host


def host_array(data: bytes, dtype: np.dtype, shape: Sequence[int],
               byte_strides: Sequence[int] | None = None) -> np.ndarray:
    """The array of ``shape`` and ``dtype`` that ``data`` holds (laid out with
    ``byte_strides``, else dense row-major), a copy; ``InvalidArgument`` unless
    ``data`` is exactly the array's minimal memory region."""
    dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
    what = f"shape {list(shape)} {dtype.name}"
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{what}: a dimension is negative")
    n = 1
    for d in shape:
        n *= d
        if n > MAX_ELEMENTS:
            raise InvalidArgument(f"{what}: more than {MAX_ELEMENTS} elements")
    size = dtype.itemsize
    if byte_strides is None or (not byte_strides and not shape):
        need = n * size
        if len(data) != need:
            raise InvalidArgument(f"{what} needs {need} bytes; the host buffer has "
                                  f"{len(data)}")
        return np.frombuffer(data, dtype, count=n).reshape(shape).copy()
    strides = tuple(int(s) for s in byte_strides)
    if len(strides) != len(shape):
        raise InvalidArgument(f"{what} has {len(shape)} dimensions, byte_strides "
                              f"{list(strides)} has {len(strides)}")
    if n == 0:
        return np.zeros(shape, dtype)
    last = 0  # the byte offset of the last element
    for i, (d, s) in enumerate(zip(shape, strides, strict=True)):
        if d == 1:
            continue  # its stride is never used
        if s <= 0:
            raise Unimplemented(f"{what}: byte_strides {list(strides)} has a negative or "
                                f"zero stride (dimension {i}); only positive strides are "
                                f"served, as by IFRT's own proxy server")
        if s % size:
            raise InvalidArgument(f"{what}: byte_strides[{i}]={s} is not a multiple of the "
                                  f"element size {size}")
        last += s * (d - 1)
    if last + size != len(data):
        raise InvalidArgument(f"{what} with byte_strides {list(strides)} spans {last + size} "
                              f"bytes; the host buffer has {len(data)}")
    view = np.lib.stride_tricks.as_strided(
        np.frombuffer(data, dtype), shape,
        tuple(s if d != 1 else size for d, s in zip(shape, strides, strict=True)),
        writeable=False)
    return np.ascontiguousarray(view)


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
