"""Reading a client's program (its name and its results' shapes) in a helper process.

The bytes of a ``CompileRequest`` are the client's, unchecked; MLIR's readers are C++
and a malformed module can end the process that reads it (measured: a mutated
StableHLO artifact made jaxlib's deserializer throw past nanobind, ``terminate``).
The proxy serves every session from one process, so it never parses a program
itself: ``ProgramParser`` hands the bytes to a child process (``python -m
pathways_ray.proxy.program_parser``, started on first use, reused after) and a
child that dies on them is an ``InvalidArgument`` for that request only. A program
that parsed is what the chips compile.

The protocol on the child's stdin/stdout: an 8-byte length and the module's bytes
in; one JSON line out, ``{"name", "outs": [[shape, dtype], ...]}`` or ``{"error"}``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

from pathways_ray.proxy.errors import InvalidArgument, Unimplemented

__all__ = ["ProgramParser", "module_signature"]

logger = logging.getLogger(__name__)

Signature = tuple[str, list[tuple[tuple[int, ...], str]]]


def module_signature(module: bytes) -> Signature:
    """The module's name and its ``main``'s results ``(shape, dtype)``: a StableHLO
    portable artifact (what JAX's proxy client sends) or MLIR bytecode. Parses in
    this process: call it on trusted bytes only (``ProgramParser`` for a client's)."""
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        try:
            parsed = xc._xla.mlir.deserialize_portable_artifact(module)
        except Exception:  # noqa: BLE001 - not an artifact: plain bytecode or text
            try:
                parsed = ir.Module.parse(module)
            except Exception as e:  # noqa: BLE001 - MLIR's own error type
                raise InvalidArgument(f"the program ({len(module)} bytes) is not a StableHLO "
                                      f"module: {str(e).splitlines()[0][:200]}") from None
        name = "program"
        if "sym_name" in parsed.operation.attributes:
            name = ir.StringAttr(parsed.operation.attributes["sym_name"]).value
        for op in parsed.body.operations:
            if ("sym_name" in op.attributes
                    and ir.StringAttr(op.attributes["sym_name"]).value == "main"):
                ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                outs = []
                for t in ftype.results:
                    rt = ir.RankedTensorType(t)
                    outs.append((tuple(rt.shape), _dtype_name(str(rt.element_type))))
                return name, outs
    raise InvalidArgument("the program has no main function")


def _dtype_name(mlir_type: str) -> str:
    table = {"f32": "float32", "f64": "float64", "f16": "float16", "bf16": "bfloat16",
             "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
             "ui8": "uint8", "ui16": "uint16", "ui32": "uint32", "ui64": "uint64",
             "complex<f32>": "complex64", "complex<f64>": "complex128"}
    if mlir_type not in table:
        raise Unimplemented(f"a result of element type {mlir_type} is not served")
    return table[mlir_type]


class ProgramParser:
    """``module_signature`` of a client's bytes, read in a child process of its own."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def signature(self, module: bytes) -> Signature:
        with self._lock:
            proc = self._start()
            try:
                proc.stdin.write(len(module).to_bytes(8, "little") + module)
                proc.stdin.flush()
                line = self._read_line(proc)
            except (OSError, EOFError, TimeoutError) as e:
                self._stop()
                logger.warning("the program parser died reading a %d-byte program (%s); "
                               "it starts again for the next", len(module), e)
                raise InvalidArgument(f"the program ({len(module)} bytes) is not a StableHLO "
                                      f"module: reading it ended the parser") from None
        out = json.loads(line)
        if "error" in out:
            cls = Unimplemented if out.get("unimplemented") else InvalidArgument
            raise cls(out["error"])
        return out["name"], [(tuple(shape), dtype) for shape, dtype in out["outs"]]

    def _read_line(self, proc: subprocess.Popen) -> bytes:
        box: list = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(self.timeout_s)
        if reader.is_alive():
            raise TimeoutError(f"no answer in {self.timeout_s:.0f} s")
        if not box or not box[0]:
            raise EOFError("the parser exited")
        return box[0]

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # never a TPU of the host
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pathways_ray.proxy.program_parser"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=env)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _serve() -> None:
    """The child: one module in, one JSON line out, until stdin closes."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        module = inp.read(int.from_bytes(head, "little"))
        try:
            name, outs = module_signature(module)
            answer = {"name": name, "outs": [[list(s), d] for s, d in outs]}
        except (InvalidArgument, Unimplemented) as e:
            answer = {"error": str(e), "unimplemented": isinstance(e, Unimplemented)}
        except Exception as e:  # noqa: BLE001 - any reader error is the program's
            answer = {"error": f"the program does not parse: {type(e).__name__}: "
                               f"{str(e)[:300]}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
