"""Generate the IFRT proxy protocol's Python stubs from the newest jaxlib pathways-ray
supports (``GENERATED_FROM``; the protocol of older ones is a subset).

    python scripts/gen_ifrt_proxy_protos.py [--check]

The exact protocol of a jaxlib is the one compiled into it: ``jaxlib/libjax_common.so``
holds the serialized ``FileDescriptorProto`` of every ``.proto`` it was built with
(``xla/python/ifrt_proxy/common/grpc_ifrt_service.proto`` and everything it imports).
This script finds them there (each starts with field 1, its file name; the top-level
fields are walked to its end), adds protobuf's own ``google/protobuf/*`` files, and
runs grpcio-tools' ``protoc`` on them (``--descriptor_set_in``) to write
``pathways_ray/proxy/protos/``: ``*_pb2.py`` messages and the ``GrpcIfrtService``
stubs, in one flat package (``xla/python/ifrt/dtype.proto`` becomes
``xla_python_ifrt_dtype_pb2``) with their imports rewritten to match. Nothing of the wire format is
written by hand. Run it again after upgrading jaxlib (and set ``GENERATED_FROM``);
``--check`` fails if the checked-in stubs are not what this jaxlib gives, and exits 0
saying why it did not check under any other jaxlib (tests run it).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED_FROM = "0.12.1"  # the jaxlib whose descriptors the checked-in stubs are
OUT = ROOT / "pathways_ray" / "proxy" / "protos"
PACKAGE = "pathways_ray.proxy.protos"
# What the server speaks, and the IFRT types whose serialized forms it reads.
WANTED = (
    "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto",
    "xla/python/ifrt_proxy/common/types.proto",
    "xla/python/ifrt_proxy/common/array_util.proto",
    "xla/python/ifrt/sharding_serdes.proto",
    "xla/python/pjrt_ifrt/xla_sharding.proto",
    "xla/python/pjrt_ifrt/xla_compiler.proto",
    "xla/python/ifrt/custom_call_program.proto",
)
# FileDescriptorProto's top-level fields: number -> wire type (2: bytes, 0: varint).
_FIELDS = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 14: 0}


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        c = b[i]
        i += 1
        value |= (c & 0x7F) << shift
        if not c & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _walk(b: bytes, start: int) -> bytes:
    """The bytes of one serialized FileDescriptorProto starting at ``start``: top-level
    fields for as long as they are FileDescriptorProto's (and one name)."""
    i, named = start, False
    while i < len(b):
        try:
            key, j = _varint(b, i)
            field, wire = key >> 3, key & 7
            if _FIELDS.get(field) != wire or (field == 1 and named):
                break
            n, j = _varint(b, j)
            j += n if wire == 2 else 0
        except (ValueError, IndexError):
            break
        if j > len(b):
            break
        named |= field == 1
        i = j
    return b[start:i]


def embedded_files(library: Path) -> dict:
    """Every FileDescriptorProto found in ``library``, by file name (the longest parse
    where a name occurs more than once)."""
    from google.protobuf import descriptor_pb2

    blob = library.read_bytes()
    found: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    for m in re.finditer(rb"\x0a([\x05-\x7f])((?:xla|tsl)/[\w/.-]*?\.proto)", blob):
        if len(m.group(2)) != m.group(1)[0]:
            continue
        fd = descriptor_pb2.FileDescriptorProto()
        try:
            fd.ParseFromString(_walk(blob, m.start()))
        except Exception:  # noqa: BLE001 - not a descriptor after all
            continue
        if fd.name and (fd.message_type or fd.enum_type or fd.service):
            old = found.get(fd.name)
            if old is None or fd.ByteSize() > old.ByteSize():
                found[fd.name] = fd
    return found


def _protobuf_file(name: str):
    """protobuf's own ``google/protobuf/X.proto``, from its Python package."""
    import importlib

    from google.protobuf import descriptor_pb2

    module = importlib.import_module(name.replace("/", ".").removesuffix(".proto") + "_pb2")
    fd = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fd)
    return fd


def closure(found: dict, wanted=WANTED) -> list:
    """The wanted files and everything they import, dependencies first."""
    out, seen = [], set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        fd = _protobuf_file(name) if name.startswith("google/protobuf/") else found.get(name)
        if fd is None:
            raise SystemExit(f"{name} is not in this jaxlib; is it the version pyproject pins?")
        for dep in fd.dependency:
            visit(dep)
        out.append(fd)

    for name in wanted:
        visit(name)
    return out


def generate(out: Path) -> list[str]:
    import jaxlib
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    library = Path(jaxlib.__file__).parent / "libjax_common.so"
    files = [fd for fd in closure(embedded_files(library))
             if not fd.name.startswith("google/protobuf/")]
    every = closure(embedded_files(library))
    with tempfile.TemporaryDirectory() as tmp:
        dset = Path(tmp) / "ifrt_proxy.pb"
        dset.write_bytes(descriptor_pb2.FileDescriptorSet(file=every).SerializeToString())
        gen = Path(tmp) / "gen"
        gen.mkdir()
        service = "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto"
        for args in (["protoc", f"--descriptor_set_in={dset}", f"--python_out={gen}",
                      *[fd.name for fd in files]],
                     ["protoc", f"--descriptor_set_in={dset}", f"--grpc_python_out={gen}",
                      service]):
            if protoc.main(args) != 0:
                raise SystemExit(f"protoc failed: {' '.join(args)}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        written = []
        for path in sorted(gen.rglob("*.py")):
            # one flat package: xla/python/ifrt/dtype_pb2.py -> xla_python_ifrt_dtype_pb2.py
            flat = "_".join(path.relative_to(gen).parts)
            text = re.sub(r"^from ((?:xla|tsl)(?:\.\w+)*) import (\w+)",
                          lambda m: f"from {PACKAGE} import {m[1].replace('.', '_')}_{m[2]}",
                          path.read_text(), flags=re.M)
            (out / flat).write_text(text)
            written.append(flat)
        (out / "__init__.py").write_text(
            f'"""The IFRT proxy protocol of jaxlib {jaxlib.__version__}: generated by '
            f'scripts/gen_ifrt_proxy_protos.py; do not edit."""\n')
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="fail if the checked-in stubs differ from what this jaxlib gives")
    args = ap.parse_args()
    import jaxlib

    if args.check and jaxlib.__version__ != GENERATED_FROM:
        print(f"not checked: the stubs come from jaxlib {GENERATED_FROM}, this is "
              f"{jaxlib.__version__}")
        return 0
    if not args.check:
        written = generate(OUT)
        print(f"wrote {len(written)} files under {OUT.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "protos"
        generate(fresh)
        cmp = filecmp.dircmp(fresh, OUT)
        diff = _differences(cmp)
        if diff:
            print("the stubs differ from this jaxlib's protocol: " + ", ".join(diff)
                  + "; run python scripts/gen_ifrt_proxy_protos.py", file=sys.stderr)
            return 1
    print("the checked-in stubs match this jaxlib")
    return 0


def _differences(cmp, prefix: str = "") -> list[str]:
    out = [prefix + n for n in cmp.left_only + cmp.right_only + cmp.diff_files
           if n != "__pycache__"]
    for name, sub in cmp.subdirs.items():
        if name != "__pycache__":
            out += _differences(sub, prefix + name + "/")
    return out


if __name__ == "__main__":
    sys.exit(main())
