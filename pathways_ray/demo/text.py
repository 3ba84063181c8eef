"""A text file on storage, read and tokenized where it is used (a sidecar's job).

``write_corpus`` writes the demo's Markov text as characters (a text file any
host can read: a shared path here, a bucket on GKE). ``TextBatches`` is the
host-side reader for ``pathways_ray.elastic.feed.HostFeed``: every row of every
micro-batch comes from a fixed offset in the file (a function of step,
micro-batch and row), read and mapped to token ids on the host that holds it.
The client can build the same batches itself (``TextBatches.on_client``),
which is how the tests and ``benchmarks/input_pipeline.py`` compare the two.
"""

from __future__ import annotations

import hashlib
import mmap
import time
from pathlib import Path

import numpy as np

from pathways_ray.demo.lm import MarkovText

__all__ = ["ALPHABET", "TextBatches", "write_corpus"]

# 64 printable symbols: one per token of the demo model's vocabulary.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?\n"[:64]


def write_corpus(path: str | Path, chars: int = 200_000, seed: int = 0) -> Path:
    """Write ``chars`` characters of the demo's Markov text to ``path``."""
    text = MarkovText(len(ALPHABET), seed=seed)
    rng = np.random.default_rng(seed)
    ids = text.batch(rng, chars // 1000, 1000).reshape(-1)
    path = Path(path)
    path.write_text("".join(ALPHABET[i] for i in ids))
    return path


class TextBatches:
    """Rows of ``seq + 1`` token ids read from a text file; ``rows`` per micro-batch.

    ``read_latency_s`` adds that long to every read, as an object store would
    (a GCS read is tens of milliseconds): benchmarks set it to make input cost
    what a step costs; it is 0 otherwise.
    """

    def __init__(self, host, path: str, seq: int, rows: int, read_latency_s: float = 0.0):
        self.path, self.seq, self.rows = str(path), seq, rows
        self.read_latency_s = read_latency_s
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._map) <= seq + 1:
            raise ValueError(f"path={self.path!r} holds {len(self._map)} bytes; rows of "
                             f"seq + 1 = {seq + 1} need more")
        self._table = np.full(256, -1, np.int32)  # byte -> token id (the tokenizer)
        for i, ch in enumerate(ALPHABET):
            self._table[ord(ch)] = i
        self.rows_read = 0

    def _offset(self, step: int, micro: int, row: int) -> int:
        key = hashlib.blake2b(f"{step}/{micro}/{row}".encode(), digest_size=8).digest()
        return int.from_bytes(key, "little") % (len(self._map) - self.seq - 1)

    def batch(self, host, step: int, micro: int) -> np.ndarray:
        """This host's block (``host.box``) of micro-batch ``micro`` of ``step``."""
        rows, cols = host.box
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        out = np.empty((rows.stop - rows.start, self.seq + 1), np.int32)
        for i, row in enumerate(range(rows.start, rows.stop)):
            at = self._offset(step, micro, row)
            raw = np.frombuffer(self._map[at:at + self.seq + 1], np.uint8)
            out[i] = self._table[raw]
        if (out < 0).any():
            raise ValueError(f"{self.path} holds characters outside the alphabet")
        self.rows_read += len(out)
        return out[:, cols]

    @classmethod
    def on_client(cls, path: str, seq: int, rows: int, read_latency_s: float = 0.0):
        """The same reader in this process, for whole micro-batches: ``batch(step, micro)``."""
        from pathways_ray.chips.sidecar_host import Host

        host = Host("client", 0, 1, (), ((slice(0, rows), slice(0, seq + 1)),))
        reader = cls(host, path, seq, rows, read_latency_s)
        return lambda step, micro: reader.batch(host, step, micro)

    def close(self) -> int:
        self._map.close()
        self._file.close()
        return self.rows_read
