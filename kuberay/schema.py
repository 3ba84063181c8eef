"""Validate manifests against KubeRay's CRD schemas the way the API server does.

The schemas are the v1 ``openAPIV3Schema`` of KubeRay v1.7's RayCluster, RayJob
and RayService CRDs, bundled in ``crds/`` (``scripts/bundle_crds.py`` makes
them from the upstream YAML). Checking follows Kubernetes' structural-schema
rules:

- defaults from the schema are applied first, as the API server does;
- an unknown field is an error — the API server would silently prune it, and a
  setting that vanishes on apply is a bug we want to see before deploying;
- types (with ``x-kubernetes-int-or-string`` and ``nullable``), ``required``,
  ``enum``, ``pattern``, lengths and bounds are checked;
- the root ``metadata`` is checked as an ObjectMeta;
- CEL rules (``x-kubernetes-validations``) are not evaluated: a manifest that
  sets a field guarded by one is refused rather than passed unchecked.
"""

from __future__ import annotations

import copy
import gzip
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["SchemaError", "crd_schema", "validate"]

_CRD_DIR = Path(__file__).parent / "crds"
KINDS = ("RayCluster", "RayJob", "RayService")
API_VERSION = "ray.io/v1"
_OBJECT_META = {"name", "namespace", "labels", "annotations", "generateName", "finalizers",
                "ownerReferences"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class SchemaError(ValueError):
    """A manifest does not satisfy its CRD schema; ``errors`` lists every problem."""

    def __init__(self, kind: str, errors: list[str]):
        self.kind = kind
        self.errors = errors
        super().__init__(f"{kind} manifest is invalid:\n  " + "\n  ".join(errors))


@cache
def _schema(kind: str) -> dict:
    """Parsed once; read-only (validation copies defaults out of it, never writes to it)."""
    return json.loads(gzip.decompress((_CRD_DIR / f"{kind}.v1.json.gz").read_bytes()))


def crd_schema(kind: str) -> dict:
    """The v1 openAPIV3Schema of a KubeRay kind (a copy you may change)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a KubeRay kind; use one of {list(KINDS)}")
    return copy.deepcopy(_schema(kind))


def validate(manifest: dict) -> dict:
    """Return ``manifest`` with schema defaults applied; raise ``SchemaError`` if invalid."""
    if not isinstance(manifest, dict):
        raise SchemaError("manifest", [f"expected a mapping, got {type(manifest).__name__}"])
    kind = manifest.get("kind")
    if kind not in KINDS:
        raise SchemaError(str(kind), [f"kind: {kind!r} is not one of {list(KINDS)}"])
    errors: list[str] = []
    if manifest.get("apiVersion") != API_VERSION:
        errors.append(f"apiVersion: {manifest.get('apiVersion')!r}, expected {API_VERSION!r}")
    out = copy.deepcopy(manifest)
    schema = _schema(kind)
    _default(schema, out)
    _check(schema, out, kind, errors, root=True)
    if errors:
        raise SchemaError(kind, errors)
    return out


def _default(schema: dict, value: Any) -> None:
    if isinstance(value, dict):
        props = schema.get("properties")
        if props:
            for key, sub in props.items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
            for key, sub in props.items():
                if key in value:
                    _default(sub, value[key])
        elif isinstance(schema.get("additionalProperties"), dict):
            for v in value.values():
                _default(schema["additionalProperties"], v)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(schema["items"], item)


_TYPES = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


def _type_ok(schema: dict, value: Any) -> bool:
    if value is None:
        return bool(schema.get("nullable"))
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    t = schema.get("type")
    if t is None:
        return True
    if t in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[t])


def _check(schema: dict, value: Any, path: str, errors: list[str], root: bool = False) -> None:
    if not _type_ok(schema, value):
        want = "int-or-string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
        errors.append(f"{path}: expected {want}, got {type(value).__name__} {value!r}")
        return
    if value is None:
        return
    if "x-kubernetes-validations" in schema:
        rules = "; ".join(r.get("rule", "") for r in schema["x-kubernetes-validations"])
        errors.append(f"{path}: guarded by CEL rules this validator does not evaluate ({rules}); "
                      f"leave the field unset or check it on a real API server")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
        if schema.get("format") == "int32" and not -(2**31) <= value < 2**31:
            errors.append(f"{path}: {value} does not fit int32")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path}: needs at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: allows at most {schema['maxItems']} items")
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                _check(items, item, f"{path}[{i}]", errors)
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing required field {key!r}")
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields")
        for key, sub_value in value.items():
            sub_path = f"{path}.{key}"
            if root and key == "metadata":
                _check_object_meta(sub_value, sub_path, errors)
            elif props and key in props:
                _check(props[key], sub_value, sub_path, errors)
            elif isinstance(extra, dict):
                _check(extra, sub_value, sub_path, errors)
            elif extra is True or preserve:
                continue
            else:
                known = ", ".join(sorted(props)) if props else "none"
                errors.append(f"{sub_path}: unknown field (the API server would drop it); "
                              f"known fields here: {known}")


def _check_object_meta(meta: Any, path: str, errors: list[str]) -> None:
    if not isinstance(meta, dict):
        errors.append(f"{path}: expected object")
        return
    for key in meta:
        if key not in _OBJECT_META:
            errors.append(f"{path}.{key}: not an ObjectMeta field settable on create")
    name = meta.get("name")
    if name is None and "generateName" not in meta:
        errors.append(f"{path}: missing name")
    elif name is not None and (not isinstance(name, str) or len(name) > 253
                               or not _DNS_SUBDOMAIN.match(name)):
        errors.append(f"{path}.name: {name!r} is not a DNS subdomain")
    for field in ("labels", "annotations"):
        m = meta.get(field, {})
        if not isinstance(m, dict) or not all(isinstance(v, str) for v in m.values()):
            errors.append(f"{path}.{field}: must map strings to strings")
