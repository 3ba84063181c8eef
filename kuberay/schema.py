"""Validate manifests against KubeRay's CRD schemas the way the API server does.

The schemas are the v1 ``openAPIV3Schema`` of KubeRay v1.7's RayCluster, RayJob
and RayService CRDs, bundled in ``crds/`` (``scripts/bundle_crds.py`` makes
them from the upstream YAML). ``jsonschema`` walks the schema and checks the
standard keywords; what Kubernetes does differently is ours (below). Checking
follows Kubernetes' structural-schema rules:

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

from jsonschema import Draft4Validator, ValidationError, validators

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
    _check(schema, out, kind, errors)
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


# ---- checking: jsonschema walks the schema; the Kubernetes parts are ours -------------
# OpenAPI v3 (what CRDs use) is JSON Schema draft 4 plus a few keywords. jsonschema
# does the walking and the standard keywords (enum, pattern, lengths, bounds, items,
# properties). Kubernetes' own rules replace four keywords: ``type`` (``nullable``,
# ``x-kubernetes-int-or-string``, no bool for numbers), ``required`` and unknown
# fields (structural schemas prune what they do not declare, unless
# ``x-kubernetes-preserve-unknown-fields``), ``format: int32``; CEL rules
# (``x-kubernetes-validations``) are refused rather than passed unchecked.

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


def _k8s_type(validator, _t, value, schema):
    if not _type_ok(schema, value):
        want = "int-or-string" if schema.get("x-kubernetes-int-or-string") else schema["type"]
        yield ValidationError(f"expected {want}, got {type(value).__name__} {value!r}")


def _int_or_string(validator, flag, value, schema):
    if "type" not in schema:  # otherwise _k8s_type checked it
        yield from _k8s_type(validator, None, value, schema)


def _required(validator, required, value, schema):
    if isinstance(value, dict):
        for key in required:
            if key not in value:
                yield ValidationError(f"missing required field {key!r}")


def _properties(validator, props, value, schema):
    if not isinstance(value, dict):
        return
    extra = schema.get("additionalProperties")
    keep = extra is True or schema.get("x-kubernetes-preserve-unknown-fields")
    for key, sub_value in value.items():
        if key in props:
            if sub_value is None and props[key].get("nullable"):
                continue  # null where the schema allows it: nothing more to check
            yield from validator.descend(sub_value, props[key], path=key, schema_path=key)
        elif not keep and not isinstance(extra, dict):
            yield ValidationError(f"unknown field (the API server would drop it); known "
                                  f"fields here: {', '.join(sorted(props))}", path=[key])


def _format(validator, fmt, value, schema):
    if fmt == "int32" and isinstance(value, int) and not -(2**31) <= value < 2**31:
        yield ValidationError(f"{value} does not fit int32")


def _cel(validator, rules, value, schema):
    text = "; ".join(r.get("rule", "") for r in rules)
    yield ValidationError(f"guarded by CEL rules this validator does not evaluate ({text}); "
                          f"leave the field unset or check it on a real API server")


def _object_meta(validator, flag, value, schema):
    errors: list[str] = []
    _check_object_meta(value, errors)
    for path, message in errors:
        yield ValidationError(message, path=path)


_K8sValidator = validators.extend(Draft4Validator, {
    "type": _k8s_type,
    "x-kubernetes-int-or-string": _int_or_string,
    "required": _required,
    "properties": _properties,
    "format": _format,
    "x-kubernetes-validations": _cel,
    "x-object-meta": _object_meta,
    "additionalProperties": None,  # unknown fields are _properties' business
})


@cache
def _validator(kind: str):
    schema = dict(_schema(kind))
    props = dict(schema.get("properties", {}))
    props["metadata"] = {"x-object-meta": True}  # checked as a create-time ObjectMeta
    schema["properties"] = props
    return _K8sValidator(schema)


def _check(schema: dict, value: Any, kind: str, errors: list[str], root: bool = True) -> None:
    for e in sorted(_validator(kind).iter_errors(value), key=lambda e: list(e.absolute_path)):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        errors.append(f"{kind}{path}: {e.message}")


def _check_object_meta(meta: Any, errors: list) -> None:
    """Errors of a root ``metadata`` as ``(path below it, message)``."""
    if not isinstance(meta, dict):
        errors.append(([], "expected object"))
        return
    for key in meta:
        if key not in _OBJECT_META:
            errors.append(([key], "not an ObjectMeta field settable on create"))
    name = meta.get("name")
    if name is None and "generateName" not in meta:
        errors.append(([], "missing name"))
    elif name is not None and (not isinstance(name, str) or len(name) > 253
                               or not _DNS_SUBDOMAIN.match(name)):
        errors.append((["name"], f"{name!r} is not a DNS subdomain"))
    for field in ("labels", "annotations"):
        m = meta.get(field, {})
        if not isinstance(m, dict) or not all(isinstance(v, str) for v in m.values()):
            errors.append(([field], "must map strings to strings"))
