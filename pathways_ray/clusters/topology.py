"""TPU topology math: generations, slice shapes, hosts and the names each system uses.

Pure: imports no Ray. One ``Topology`` value answers every question the rest of
the project asks about a slice — how many chips and hosts, what GKE calls it
(``tpu-v6e-slice``, ``ct6e-standard-4t``), what Ray calls it (``TPU-V6E``, pod
type ``v6e-16``, head resource ``TPU-v6e-16-head``), and which env vars a GKE
TPU host carries.

The tables follow what GKE publishes for TPU node pools ("Plan TPUs in GKE"):

=========  =======================  ==================  =========================
generation GKE accelerator label    machine types       topologies
=========  =======================  ==================  =========================
v4         tpu-v4-podslice          ct4p-hightpu-4t     2x2x1 … 12x12x16 (3D)
v5e        tpu-v5-lite-podslice     ct5lp-hightpu-Nt    1x1 2x2 2x4 4x4 … 16x16
v5p        tpu-v5p-slice            ct5p-hightpu-4t     2x2x1 … 16x16x24 (3D)
v6e        tpu-v6e-slice            ct6e-standard-Nt    1x1 2x2 2x4 4x4 … 16x16
tpu7x      tpu7x                    tpu7x-standard-4t   2x2x1 … 8x16x16 (3D)
=========  =======================  ==================  =========================

v5e/v6e ``1x1``, ``2x2`` and ``2x4`` are single hosts of 1, 4 and 8 chips; every
larger v5e/v6e slice and every v4/v5p/tpu7x slice has 4 chips per host. A v5e/v6e
``2x4`` can also be built from two 4-chip hosts (``chips_per_host=4``), which is
what Ray's ``SlicePlacementGroup(chips_per_vm=4)`` expects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

__all__ = [
    "GENERATIONS",
    "Generation",
    "Topology",
    "generation",
    "parse_shape",
]


def _cubes(max_x: int, max_y: int, max_z: int) -> tuple[str, ...]:
    """3D shapes AxBxC with A <= B <= C, each a multiple of 4, within the bounds."""
    out = []
    for x in range(4, max_x + 1, 4):
        for y in range(x, max_y + 1, 4):
            for z in range(y, max_z + 1, 4):
                out.append(f"{x}x{y}x{z}")
    return tuple(out)


_SMALL_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


@dataclass(frozen=True)
class Generation:
    """One TPU generation and the names GKE, Ray and the TPU API give it."""

    name: str  # our canonical name: "v4", "v5e", "v5p", "v6e", "tpu7x"
    ray_version: str  # Ray's accelerator version: "v5litepod", "v7x", ...
    api_prefix: str  # TPU API / TPU_ACCELERATOR_TYPE prefix: "v5litepod-16", "tpu7x-8"
    gke_accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
    machine_type_prefix: str  # + "-<chips per host>t"
    cores_per_chip: int  # TensorCores per chip; pod type counts cores
    dims: int  # 2 (2D torus) or 3 (3D torus)
    topologies: tuple[str, ...]
    aliases: tuple[str, ...] = ()

    @property
    def accelerator_type(self) -> str:
        """Ray's accelerator type resource suffix, e.g. ``TPU-V6E``."""
        return "TPU-" + self.ray_version.upper()

    @property
    def single_host_topologies(self) -> tuple[str, ...]:
        """Shapes that fit on one host by default."""
        if self.dims == 2:
            return ("1x1", "2x2", "2x4")
        return ("2x2x1",)

    def default_chips_per_host(self, chips: int) -> int:
        if self.dims == 2 and chips <= 8:
            return chips
        return 4

    def machine_type(self, chips_per_host: int) -> str:
        return f"{self.machine_type_prefix}-{chips_per_host}t"


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation(
            name="v4",
            ray_version="v4",
            api_prefix="v4",
            gke_accelerator="tpu-v4-podslice",
            machine_type_prefix="ct4p-hightpu",
            cores_per_chip=2,
            dims=3,
            topologies=_SMALL_3D + _cubes(12, 12, 16),
            aliases=("tpu-v4", "tpuv4"),
        ),
        Generation(
            name="v5e",
            ray_version="v5litepod",
            api_prefix="v5litepod",
            gke_accelerator="tpu-v5-lite-podslice",
            machine_type_prefix="ct5lp-hightpu",
            cores_per_chip=1,
            dims=2,
            topologies=_2D,
            aliases=("v5litepod", "v5lite", "tpu-v5e", "tpu-v5litepod", "tpu-v5-lite"),
        ),
        Generation(
            name="v5p",
            ray_version="v5p",
            api_prefix="v5p",
            gke_accelerator="tpu-v5p-slice",
            machine_type_prefix="ct5p-hightpu",
            cores_per_chip=2,
            dims=3,
            topologies=_SMALL_3D + _cubes(16, 16, 24),
            aliases=("tpu-v5p",),
        ),
        Generation(
            name="v6e",
            ray_version="v6e",
            api_prefix="v6e",
            gke_accelerator="tpu-v6e-slice",
            machine_type_prefix="ct6e-standard",
            cores_per_chip=1,
            dims=2,
            topologies=_2D,
            aliases=("tpu-v6e", "trillium"),
        ),
        Generation(
            name="tpu7x",
            ray_version="v7x",
            api_prefix="tpu7x",
            gke_accelerator="tpu7x",
            machine_type_prefix="tpu7x-standard",
            cores_per_chip=2,
            dims=3,
            topologies=_SMALL_3D
            + ("4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"),
            aliases=("v7x", "tpu-v7x", "ironwood"),
        ),
    )
}

_ALIASES: dict[str, str] = {}
for _g in GENERATIONS.values():
    for _a in (_g.name, _g.ray_version, _g.gke_accelerator, *_g.aliases):
        _ALIASES[_a.lower()] = _g.name
        _ALIASES["tpu-" + _a.lower()] = _g.name


def _valid_generations() -> str:
    return ", ".join(GENERATIONS)


def generation(name: str) -> Generation:
    """Look up a generation by any of its names.

    Accepts our names (``v6e``), Ray's (``v5litepod``, ``TPU-V6E``), GKE's node
    label (``tpu-v6e-slice``) and common aliases (``v7x``, ``ironwood``).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"accelerator={name!r} is not a TPU generation; use one of: {_valid_generations()}"
        )
    key = name.strip().lower()
    if key in _ALIASES:
        return GENERATIONS[_ALIASES[key]]
    raise ValueError(
        f"accelerator={name!r} is not a known TPU generation; use one of: "
        f"{_valid_generations()} (Ray's names like 'TPU-V6E' and GKE labels like "
        f"'tpu-v6e-slice' work too)"
    )


_SHAPE_RE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def parse_shape(topology: str) -> tuple[int, ...]:
    """``"4x4"`` -> ``(4, 4)``; ``"2x2x2"`` -> ``(2, 2, 2)``. Checks syntax only."""
    if not isinstance(topology, str):
        raise ValueError(
            f"topology={topology!r} must be a string like '4x4' or '2x2x2'"
        )
    text = topology.strip().lower()
    if not _SHAPE_RE.match(text):
        raise ValueError(
            f"topology={topology!r} is not a TPU shape; write it as AxB (v5e, v6e) "
            f"or AxBxC (v4, v5p, tpu7x), e.g. '4x4' or '2x2x2'"
        )
    return tuple(int(d) for d in text.split("x"))


def _format_choices(items: tuple[str, ...], limit: int = 14) -> str:
    if len(items) <= limit:
        return ", ".join(items)
    head = ", ".join(items[: limit - 2])
    return f"{head}, …, {items[-1]} ({len(items)} shapes)"


@dataclass(frozen=True)
class Topology:
    """One TPU slice shape on one generation.

    Build it with :meth:`parse`; the constructor takes already-checked values.
    """

    generation: Generation
    shape: tuple[int, ...]
    chips_per_host: int

    # ---- construction -------------------------------------------------
    @classmethod
    def parse(
        cls,
        accelerator: str,
        topology: str | None = None,
        *,
        chips_per_host: int | None = None,
    ) -> Topology:
        """Parse a slice description.

        ``accelerator`` is a generation (``"v6e"``, ``"TPU-V6E"``,
        ``"tpu-v6e-slice"``) or a pod type (``"v6e-16"``, ``"v5litepod-16"``,
        ``"v4-8"``), in which case ``topology`` may be omitted. ``topology`` is
        the chip shape (``"4x4"``, ``"2x2x2"``). ``chips_per_host`` overrides the
        default host size where GKE offers a choice (v5e/v6e ``2x4``: 8 or 4).
        """
        gen, pod_chips = _split_pod_type(accelerator)
        if topology is None:
            if pod_chips is None:
                raise ValueError(
                    f"topology is required with accelerator={accelerator!r}; pass a shape "
                    f"such as {gen.topologies[min(3, len(gen.topologies) - 1)]!r} "
                    f"or a pod type such as '{gen.api_prefix}-16'"
                )
            topology = _default_topology(gen, pod_chips)
        shape = parse_shape(topology)
        text = "x".join(map(str, shape))
        if len(shape) != gen.dims:
            kind = "AxB (2D)" if gen.dims == 2 else "AxBxC (3D)"
            raise ValueError(
                f"topology={topology!r} does not fit {gen.name}: {gen.name} slices are "
                f"{kind}; valid shapes: {_format_choices(gen.topologies)}"
            )
        if text not in gen.topologies:
            raise ValueError(
                f"topology={topology!r} is not a {gen.name} slice shape; valid shapes: "
                f"{_format_choices(gen.topologies)}"
            )
        chips = prod(shape)
        if pod_chips is not None and pod_chips != chips:
            raise ValueError(
                f"accelerator={accelerator!r} has {pod_chips} chips but topology="
                f"{topology!r} has {chips}; drop one of them or make them agree"
            )
        default = gen.default_chips_per_host(chips)
        if chips_per_host is None:
            chips_per_host = default
        else:
            allowed = _allowed_chips_per_host(gen, chips)
            if chips_per_host not in allowed:
                raise ValueError(
                    f"chips_per_host={chips_per_host!r} is not possible for {gen.name} "
                    f"{text}; use one of {list(allowed)}"
                )
        return cls(generation=gen, shape=shape, chips_per_host=chips_per_host)

    @classmethod
    def of(cls, spec: Topology | str, *, chips_per_host: int | None = None) -> Topology:
        """A ``Topology`` from itself, ``"v6e-4x4"`` (``str(topology)``) or a pod type
        ``"v6e-16"``. ``chips_per_host`` must agree with a Topology passed in."""
        if isinstance(spec, Topology):
            if chips_per_host not in (None, spec.chips_per_host):
                raise ValueError(
                    f"chips_per_host={chips_per_host} contradicts topology {spec.describe()}"
                )
            return spec
        if not isinstance(spec, str):
            raise TypeError(
                f"topology={spec!r} must be a Topology or a string like 'v6e-4x4' or 'v6e-16'"
            )
        gen, _, shape = spec.strip().rpartition("-")
        if "x" in shape:
            return cls.parse(gen, shape, chips_per_host=chips_per_host)
        return cls.parse(spec, chips_per_host=chips_per_host)

    # ---- sizes ----------------------------------------------------------
    @property
    def name(self) -> str:
        """``"4x4"``."""
        return "x".join(map(str, self.shape))

    @property
    def chips(self) -> int:
        return prod(self.shape)

    @property
    def num_hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)

    @property
    def is_single_host(self) -> bool:
        return self.num_hosts == 1

    @property
    def cores(self) -> int:
        return self.chips * self.generation.cores_per_chip

    # ---- names ----------------------------------------------------------
    @property
    def pod_type(self) -> str:
        """Ray's pod type (label ``ray.io/tpu-pod-type``), e.g. ``v6e-16``, ``v7x-8``."""
        return f"{self.generation.ray_version}-{self.cores}"

    @property
    def api_accelerator_type(self) -> str:
        """The TPU API accelerator type GKE puts in ``TPU_ACCELERATOR_TYPE``."""
        return f"{self.generation.api_prefix}-{self.cores}"

    @property
    def accelerator_type(self) -> str:
        """Ray's accelerator type, e.g. ``TPU-V6E`` (resource ``accelerator_type:TPU-V6E``)."""
        return self.generation.accelerator_type

    @property
    def head_resource(self) -> str:
        """The resource Ray puts on TPU worker 0 of every slice: ``TPU-v6e-16-head``."""
        return f"TPU-{self.pod_type}-head"

    @property
    def gke_accelerator(self) -> str:
        return self.generation.gke_accelerator

    @property
    def machine_type(self) -> str:
        return self.generation.machine_type(self.chips_per_host)

    def describe(self) -> str:
        hosts = "1 host" if self.num_hosts == 1 else f"{self.num_hosts} hosts"
        chips = "1 chip" if self.chips == 1 else f"{self.chips} chips"
        return (
            f"{self.generation.name} {self.name} ({self.pod_type}: {chips}, "
            f"{hosts} x {self.chips_per_host})"
        )

    def __str__(self) -> str:
        return f"{self.generation.name}-{self.name}"

    def host_env(self, slice_name: str, worker_id: int) -> dict[str, str]:
        """The TPU env vars GKE's TPU webhook gives the pod of TPU worker ``worker_id``.

        Ray's TPU accelerator manager reads exactly these to derive a node's
        ``TPU-<pod>-head`` and slice-name resources and its ``ray.io/tpu-*`` labels.
        """
        if not 0 <= worker_id < self.num_hosts:
            raise ValueError(
                f"worker_id={worker_id} is out of range for {self.describe()}; "
                f"use 0..{self.num_hosts - 1}"
            )
        return {
            "TPU_NAME": slice_name,
            "TPU_WORKER_ID": str(worker_id),
            "TPU_ACCELERATOR_TYPE": self.api_accelerator_type,
            "TPU_TOPOLOGY": self.name,
            "TPU_WORKER_HOSTNAMES": ",".join(
                f"{slice_name}-w{i}" for i in range(self.num_hosts)
            ),
        }


def _allowed_chips_per_host(gen: Generation, chips: int) -> tuple[int, ...]:
    if gen.dims == 2 and chips <= 8:
        return (chips, 4) if chips == 8 else (chips,)
    return (4,)


_POD_RE = re.compile(r"^(.*?)-([0-9]+)$")


def _split_pod_type(accelerator: str) -> tuple[Generation, int | None]:
    """``"v6e-16"`` -> (v6e, 16 chips); ``"v6e"`` -> (v6e, None)."""
    if not isinstance(accelerator, str):
        raise ValueError(
            f"accelerator={accelerator!r} must be a string such as 'v6e' or 'v6e-16'"
        )
    text = accelerator.strip().lower()
    m = _POD_RE.match(text)
    if m and m.group(1) in _ALIASES:
        gen = generation(m.group(1))
        cores = int(m.group(2))
        if cores == 0 or cores % gen.cores_per_chip:
            raise ValueError(
                f"accelerator={accelerator!r} is not a {gen.name} pod type: the number "
                f"after the dash counts TensorCores ({gen.cores_per_chip} per chip)"
            )
        return gen, cores // gen.cores_per_chip
    return generation(text), None


def _default_topology(gen: Generation, chips: int) -> str:
    """The shape the TPU API picks for a pod type: the most compact valid one."""
    candidates = [t for t in gen.topologies if prod(parse_shape(t)) == chips]
    if not candidates:
        sizes = sorted({prod(parse_shape(t)) * gen.cores_per_chip for t in gen.topologies})
        raise ValueError(
            f"accelerator='{gen.api_prefix}-{chips * gen.cores_per_chip}' is not a {gen.name} "
            f"pod type; valid sizes: "
            + ", ".join(f"{gen.api_prefix}-{s}" for s in sizes[:12])
            + (", …" if len(sizes) > 12 else "")
        )
    return min(candidates, key=lambda t: (max(parse_shape(t)), t))
