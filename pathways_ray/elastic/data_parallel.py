"""Data parallel across slices, data x model parallel within each, through the controller;
elastic: a lost slice costs at most the step it broke, and the run goes on.

The global batch is cut into one group per starting slice, each of ``microbatches``
equal micro-batches. Each step, the slice that owns a group computes its loss and
gradients (one program, SPMD over the slice's chips; the micro-batches one after
another, summed in float32: gradient accumulation), raveled into one vector with the
loss as its last element. Every vector goes to every slice chip to chip
(``reshard``: JAX's transfer server, DCN in Pathways terms), and every slice sums
them in group order with one small program and applies the optimizer's update to
the parameters and its state (a second program), so the replicas stay
bit-identical. The state (``{"params": ..., "opt": ...}``) is what a loss, a
snapshot, a checkpoint and a grow-back carry; the optimizer's step count (which its
schedules read) is in it.

Each slice here is a JAX world of its own (plain ``connect()``), so losing one
slice leaves the others whole: every survivor already holds the state.
When a step raises ``SliceLost``, the trainer drops the slice, hands its
group of micro-batches to the survivors (round robin: uneven, same shapes, so nothing
is recompiled) and runs the step again from the state it started from.
The global batch, the data order and so the losses stay those of the
uninterrupted run. ``connect(multislice=True)`` is the other model: one world
over every slice's chips, one failure domain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pathways_ray.client.client import Client, RemoteArray
from pathways_ray.elastic.elastic_policy import (
    DEFAULT_SNAPSHOT_EVERY,
    ElasticEvent,
    assign_microbatches,
    check_failure,
    snapshot_due,
)
from pathways_ray.elastic.feed import HostFeed
from pathways_ray.elastic.optim import (
    init_state,
    opt_shardings,
    optimizer_of,
    step_count,
    step_fns,
)
from pathways_ray.errors import SliceLost

__all__ = ["DataParallelTrainer", "StepResult"]

from pathways_ray.elastic.recovery import Recovery

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One step's mean loss over the global batch, held on every slice that applied it;
    ``mean_loss()`` reads it from the first one still there."""

    losses: dict[str, RemoteArray]

    def mean_loss(self) -> float:
        last: SliceLost | None = None
        for handle in self.losses.values():
            try:
                return float(handle.fetch())
            except SliceLost as e:
                last = e
        raise last or RuntimeError("no slice holds this step's loss")


class DataParallelTrainer(Recovery):
    """``step(batch)`` runs one step on the global batch over the live slices.

    ``optimizer`` is an ``optax.GradientTransformation`` (e.g.
    ``pathways_ray.elastic.optim.adamw_warmup_cosine``); ``lr=`` is shorthand for
    plain SGD. Its state lives beside the parameters on every slice, sharded like
    them where it mirrors them. ``microbatches`` (default 1): micro-batches per group
    (one group per starting slice), accumulated in one program. ``compute_dtype``
    (e.g. ``jnp.bfloat16``): the loss computes in it, the parameters stay float32.

    ``min_slices`` (default 1): losing slices below it raises ``NotEnoughSlices``;
    ``max_failures`` bounds how many losses a run takes (None: any).
    ``on_elastic_event(event)`` sees every loss, retry and added slice.
    ``grow=True`` reserves replacements in the background (the controller looks for
    free capacity) and adds each at a step boundary once it has compiled.

    ``snapshot_every`` (default 10 steps; None: off) copies the parameters into host
    memory off the slices (``pathways_ray.elastic.snapshot``) in the background, from each
    slice in turn. ``wait_for_slices_s`` (default 0: raise at once): below
    ``min_slices``, wait this long for replacements instead of raising. A new slice
    takes the parameters from a survivor; when none is left, from the latest
    snapshot, and the steps since it run again from the batches the trainer kept.

    ``feed`` (a ``pathways_ray.elastic.feed.HostFeed``): the input is read on the slices'
    hosts by sidecars, ahead of the steps, and never passes through this process;
    call ``step()`` without a batch. Each micro-batch is read on the slice that
    computes it (after a loss, a survivor reads the lost slice's share).
    """

    def __init__(self, client: Client, loss_fn: Callable, params: dict, param_specs: dict,
                 *, mesh_shape: tuple[int, int], lr: float | None = None, optimizer=None,
                 microbatches: int = 1, compute_dtype=None, slices: list[str] | None = None,
                 min_slices: int = 1, max_failures: int | None = None,
                 on_elastic_event: Callable[[ElasticEvent], None] | None = None,
                 grow: bool = False, grow_check_s: float = 1.0,
                 snapshot_every: int | None = DEFAULT_SNAPSHOT_EVERY,
                 wait_for_slices_s: float = 0.0, feed: HostFeed | None = None):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.client = client
        self.feed = feed
        self._feeds: dict[str, Callable] = {}  # slice -> its sidecar's batch reader
        self.live = list(slices or [s.name for s in client.slices])
        self.optimizer = optimizer_of(optimizer, lr)
        fns = step_fns(loss_fn, params, self.optimizer, microbatches=microbatches,
                       total=len(self.live) * microbatches, compute_dtype=compute_dtype)
        self.groups, self.microbatches = len(self.live), microbatches
        self.num_microbatches = self.groups * microbatches
        self.target = len(self.live)
        self.min_slices, self.max_failures = min_slices, max_failures
        self.on_elastic_event = on_elastic_event
        self.events: list[ElasticEvent] = []
        self.failures = 0
        self.steps_done = 0
        self.grow, self.grow_check_s = grow, grow_check_s
        self._joining: dict[str, RemoteArray] = {}  # slice -> its compile-ahead status
        self._next_grow_check = 0.0
        self._asked = False  # replacements requested and not all arrived
        snapshot_due(0, snapshot_every)  # checks the setting
        self.snapshot_every, self.wait_for_slices_s = snapshot_every, wait_for_slices_s
        self._snapshot = None  # the snapshot on its way to host memory
        self._history: list[tuple[int, np.ndarray]] = []  # batches since the latest one
        self.mesh = client.mesh(mesh_shape, ("data", "model"))
        self.param_shardings = jax.tree.map(lambda p: NamedSharding(self.mesh, p), param_specs,
                                            is_leaf=lambda x: isinstance(x, P))
        self.replicated = NamedSharding(self.mesh, P())
        # A group's input: one micro-batch, or several stacked on a leading axis.
        self.batch_sharding = NamedSharding(self.mesh, P("data") if microbatches == 1
                                            else P(None, "data"))
        self._host_state = init_state(self.optimizer, params)
        self.state_shardings = {"params": self.param_shardings}
        if "opt" in self._host_state:
            self.state_shardings["opt"] = opt_shardings(self._host_state["opt"], params,
                                                        self.param_shardings, self.replicated)
        self._grads = client.jit(fns.grads, out_shardings=self.replicated)
        self._add = client.jit(fns.add, out_shardings=self.replicated)
        self._apply = client.jit(fns.apply, out_shardings=(self.state_shardings,
                                                           self.replicated))
        self.state = {s: client.device_put(self._host_state, self.state_shardings, slice=s)
                      for s in self.live}
        if feed is not None:  # shapes known now: compile ahead while the job sets up
            group = (microbatches,) if microbatches > 1 else ()
            self._batch_shape = (*group, *feed.shape)
            self._batch_dtype = np.dtype(feed.dtype)
            for s in self.live:
                self._compile_on(s)
                self._open_feed(s)

    @property
    def slices(self) -> list[str]:
        return list(self.live)

    @property
    def params(self) -> dict:
        """Each live slice's parameters (``RemoteArray`` pytrees), by slice name."""
        return {s: st["params"] for s, st in self.state.items()}

    # ---- one step ----------------------------------------------------------------
    def step(self, batch: np.ndarray | None = None) -> StepResult:
        """One step on the global ``batch`` (or on the ``feed``'s next one, read on the
        hosts); survives losing slices down to min_slices."""
        m = self.num_microbatches
        if (batch is None) == (self.feed is None):
            raise ValueError("step(batch) takes a batch, or none when the trainer has a "
                             "feed= (read on the hosts); not both, not neither")
        if batch is not None and len(batch) % m:
            raise ValueError(f"batch of {len(batch)} rows does not split into {m} "
                             f"micro-batches ({self.microbatches} (microbatches=) for each "
                             f"of the {self.groups} starting slices)")
        if self.grow:
            self._grow_at_boundary()
        result = self._run_step(batch)
        self._maybe_snapshot(batch)
        return result

    def _run_step(self, batch: np.ndarray | None) -> StepResult:
        parts = None
        if batch is not None:
            parts = np.split(batch, self.groups)
            if self.microbatches > 1:
                k = self.microbatches
                parts = [p.reshape(k, len(p) // k, *p.shape[1:]) for p in parts]
            self._batch_shape, self._batch_dtype = parts[0].shape, parts[0].dtype
        while True:
            try:
                new, losses = self._try_step(parts)
            except SliceLost as e:
                self._drop(e)
                continue
            self.state.update(new)
            self.steps_done += 1
            return StepResult(losses)

    def _try_step(self, parts: list[np.ndarray] | None):
        """The step from ``self.state``, touching nothing of it: a failure midway
        leaves the state the step started from."""
        owner = assign_microbatches(self.groups, self.live)
        vec = [self._grads(self.state[s]["params"], self._input(s, g, parts))
               for g, s in enumerate(owner)]
        here, copies = {}, []
        for s in self.live:
            here[s] = []
            for o, v in zip(owner, vec, strict=True):
                if o != s:
                    v = self.client.reshard(v, self.replicated, slice=s)
                    copies.append(v)
                here[s].append(v)
        # Every copy has landed before anything uses it: once this step returns, no later
        # loss can reach back into it (a source that died while a copy was still being
        # pulled raises SliceLost here, and the step runs again without it).
        self.client.block_until_ready(copies)
        new, losses = {}, {}
        for s in self.live:
            # Every slice sums the groups in the same order, so the replicas stay
            # bit-identical (float addition is not associative).
            total = here[s][0]
            for v in here[s][1:]:
                total = self._add(total, v)
            new[s], losses[s] = self._apply(self.state[s], total)
        if not copies:  # one slice: nothing above waited for the step, so a loss would
            self.client.block_until_ready(list(losses.values()))  # surface after it
        return new, losses

    def _input(self, s: str, g: int, parts: list[np.ndarray] | None) -> RemoteArray:
        """Group ``g`` of this step on slice ``s``: from the client's batch, or read by
        the slice's hosts (micro-batches ``g * microbatches`` on)."""
        if parts is not None:
            return self.client.device_put(parts[g], self.batch_sharding, slice=s)
        if s not in self._feeds:
            self._open_feed(s)
        if self.microbatches == 1:
            return self._feeds[s](self.steps_done, g)
        return self._feeds[s](self.steps_done, g, self.microbatches)

    def _open_feed(self, s: str) -> None:
        """Start the feed's reader on every host of slice ``s``."""
        import jax

        from pathways_ray.elastic.feed import Prefetcher

        f = self.feed
        reader = self.client.sidecar(Prefetcher, slice=s)(f.cls, f.args, f.kwargs, f.prefetch)
        out = jax.ShapeDtypeStruct(self._batch_shape, self._batch_dtype,
                                   sharding=self.batch_sharding)
        read = reader.get if self.microbatches == 1 else reader.group
        self._feeds[s] = read.returning(out)

    def _drop(self, e: SliceLost, retried: str = "step") -> None:
        lost = e.slice
        if lost not in self.live:
            raise e  # not one of ours: nothing to recover by dropping it
        self.live.remove(lost)
        self.state.pop(lost, None)
        self._feeds.pop(lost, None)
        self.failures += 1
        self._event("slice_lost", lost, e.reason)
        waiting = self.wait_for_slices_s > 0 and len(self.live) < self.min_slices
        check_failure(self.live, [lost], 0 if waiting else self.min_slices, self.failures,
                      self.max_failures)
        if waiting:
            self._refill(lost)
        what = f"step {self.steps_done}" if retried == "step" else "the save"
        self._event(f"{retried}_retried", lost, f"{what} again on {self.live}")

    # ---- host-memory snapshots ---------------------------------------------------------

    def _event(self, kind: str, slice_name: str, reason: str = "") -> None:
        ev = ElasticEvent(kind, self.steps_done, slice_name, tuple(self.live), reason)
        self.events.append(ev)
        logger.warning("elastic: %s %s at step %d (%s); live %s", kind, slice_name,
                       ev.step, reason, list(ev.live))
        if self.on_elastic_event is not None:
            self.on_elastic_event(ev)

    # ---- growing back --------------------------------------------------------------

    # ---- checkpoints to storage ------------------------------------------------------
    def save(self, path, *, timeout_s: float | None = None) -> int:
        """Write the state (parameters, optimizer state) and the step count as an Orbax
        checkpoint at ``path`` (``pathways_ray.storage.checkpoint``: the chips write
        their shards). Any live slice holds them; one that is lost meanwhile is
        dropped as in a step and the next one writes. Returns the bytes saved."""
        from pathways_ray.storage import checkpoint

        while True:
            src = self.live[0]
            step = self.client.device_put(np.int32(self.steps_done), self.replicated, slice=src)
            try:
                return checkpoint.save(path, {**self.state[src], "step": step},
                                       timeout_s=timeout_s)
            except SliceLost as e:
                self._drop(e, retried="save")

    def restore(self, path, *, timeout_s: float | None = None) -> int:
        """Load the state and step count from a checkpoint written by ``save`` (by this
        or another client, on any fleet) onto every live slice; returns the step count.
        The run goes on from there: feed it the batches that come after that step."""
        from pathways_ray.storage import checkpoint

        like = {**self.state_shardings, "step": self.replicated}
        state, step = {}, 0
        for s in self.live:
            tree = checkpoint.restore(self.client, path, like, slice=s, timeout_s=timeout_s)
            step = int(tree.pop("step").fetch())
            state[s] = tree
        self.state, self.steps_done = state, step
        return step

    def fetch_params(self, slice_name: str | None = None) -> dict:
        """One slice's parameters, as numpy arrays."""
        return self.fetch_state(slice_name)["params"]

    def fetch_state(self, slice_name: str | None = None) -> dict:
        """One slice's whole state (``params``, and ``opt`` where the optimizer keeps
        any), as numpy arrays."""
        import jax

        return jax.tree.map(lambda a: a.fetch(), self.state[slice_name or self.live[0]])

    def optimizer_step(self, slice_name: str | None = None) -> int | None:
        """The optimizer's own step count on a slice (what its schedules read; None for
        one that keeps none): fetches just the counts."""
        opt = self.state[slice_name or self.live[0]].get("opt")
        return step_count(opt, read=lambda a: a.fetch())
