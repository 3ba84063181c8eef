"""Programs compiled for devices: the StableHLO module and XLA compile options that JAX
itself sends (through the IFRT proxy), as opposed to ``export_program``'s portable
exports. Pure: what travels from the client to the chips and back.

An ``HloProgram`` runs on the chips of one slice: partition ``i`` on slice rank
``ranks[i]``, or, with ``ranks`` empty, a one-device program that every chip of the
slice runs on its own copy of the inputs (a result then is on every chip, which
keeps a one-device array usable by the slice's next program at no cost). Its blob
is what ``Load`` carries; ``Compile`` answers with an ``HloSignature``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass

from pathways_ray.programs.sharding import MeshShape, Spec

__all__ = ["MAGIC", "HloProgram", "HloSignature", "is_hlo_blob"]

MAGIC = b"pathways-ray/hlo-program\n"


def is_hlo_blob(blob: bytes) -> bool:
    return bytes(blob[:len(MAGIC)]) == MAGIC


@dataclass(frozen=True)
class HloProgram:
    name: str
    module: bytes  # StableHLO (a portable artifact, as JAX serialized it)
    compile_options: bytes  # xla CompileOptions, serialized; the chips set the devices
    ranks: tuple[int, ...]  # partition -> slice rank; () = one device, run on every chip
    out_shapes: tuple[tuple[tuple[int, ...], str], ...]  # global (shape, dtype) per result

    @property
    def blob(self) -> bytes:
        return MAGIC + pickle.dumps(self, protocol=5)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.blob).hexdigest()[:32]

    @staticmethod
    def from_blob(blob: bytes) -> HloProgram:
        if not is_hlo_blob(blob):
            raise ValueError("not an HloProgram blob")
        return pickle.loads(bytes(blob[len(MAGIC):]))


@dataclass(frozen=True)
class HloSignature:
    """What compiling an ``HloProgram`` decided: each result's layout on the slice and
    the shardings XLA chose (serialized ``OpSharding``, for JAX)."""

    out_layouts: tuple[tuple[MeshShape, Spec], ...]
    in_shardings: tuple[bytes, ...]
    out_shardings: tuple[bytes, ...]
    # XLA's CompiledMemoryStats of one chip's executable (argument_size_in_bytes, ...)
    memory_stats: dict[str, int] | None = None
    # The memory kind each result lands in ("device", "pinned_host" for host offload)
    out_memory: tuple[str, ...] = ()

    def to_bytes(self) -> bytes:
        return json.dumps({
            "out": [[list(m.axis_names), list(m.axis_sizes),
                     None if m.devices is None else list(m.devices), [list(a) for a in s]]
                    for m, s in self.out_layouts],
            "in_shardings": [b.hex() for b in self.in_shardings],
            "out_shardings": [b.hex() for b in self.out_shardings],
            "memory_stats": self.memory_stats, "out_memory": list(self.out_memory)}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> HloSignature:
        d = json.loads(bytes(data).decode())
        return HloSignature(
            tuple((MeshShape(tuple(n), tuple(z), None if dv is None else tuple(dv)),
                   tuple(tuple(a) for a in s)) for n, z, dv, s in d["out"]),
            tuple(bytes.fromhex(h) for h in d["in_shardings"]),
            tuple(bytes.fromhex(h) for h in d["out_shardings"]),
            d.get("memory_stats"), tuple(d.get("out_memory", ())))
