"""How ``DataParallelTrainer`` carries on after a lost slice and grows back: host-memory
snapshots every few steps, refilling a survivor's lost share, re-running steps from
a snapshot, and warming a replacement slice up before it joins at a step boundary."""

from __future__ import annotations

import logging
import time

import numpy as np

from pathways_ray.elastic.elastic_policy import (
    NotEnoughSlices,
    recovery_source,
    snapshot_due,
    want_more,
)
from pathways_ray.errors import SliceLost

__all__ = ["Recovery"]

logger = logging.getLogger("pathways_ray.elastic.data_parallel")


class Recovery:
    """Mixin of ``DataParallelTrainer``: snapshots, refills and growing back."""

    def _maybe_snapshot(self, batch: np.ndarray) -> None:
        """After a step: note a snapshot that completed, start the next one when due
        (one at a time, from each live slice in turn) and keep the batches since the
        latest complete one (what a restore from it runs again)."""
        if not self.snapshot_every:
            return
        from pathways_ray.elastic import snapshot

        self._history.append((self.steps_done - 1, batch))
        if self._snapshot is not None and self._snapshot.done():
            if self._snapshot.wait(timeout_s=5.0):
                kept = self._snapshot.step
                self._history = [(i, b) for i, b in self._history if i >= kept]
            self._snapshot = None
        if self._snapshot is None and snapshot_due(self.steps_done, self.snapshot_every):
            src = self.live[self.steps_done // self.snapshot_every % len(self.live)]
            try:
                self._snapshot = snapshot.take(self.state[src], self.steps_done)
            except SliceLost as e:  # the next step finds it lost and drops it
                logger.info("elastic: no snapshot at step %d: %s", self.steps_done, e)

    def _refill(self, lost: str) -> None:
        """Below min_slices: wait up to ``wait_for_slices_s`` for replacements and give
        each the state, from a survivor or else from the latest snapshot (then the
        steps since it run again)."""
        from pathways_ray.elastic import snapshot

        if self._snapshot is not None and not self.live:  # it may complete yet
            try:
                self._snapshot.wait(timeout_s=10.0)
            except Exception:  # noqa: BLE001 - a snapshot cut short by the loss
                pass
            self._snapshot = None
        recovery_source(self.live, snapshot.latest_step(self.client), self.steps_done,
                        self.snapshot_every)  # raises if neither a replica nor a snapshot
        self._event("waiting_for_slices", lost,
                    f"{len(self.live)} left, below min_slices={self.min_slices}; waiting up "
                    f"to {self.wait_for_slices_s:g} s (wait_for_slices_s) for replacements")
        deadline = time.monotonic() + self.wait_for_slices_s
        candidates = list(self._joining)
        self._joining.clear()
        rewound_to = None
        while len(self.live) < self.min_slices:
            if candidates:
                name = candidates.pop(0)
                if self.live:
                    why = self._copy_state(to=name)
                else:
                    try:
                        rewound_to, self.state[name] = snapshot.restore(
                            self.client, self.state_shardings, slice=name)
                    except SliceLost:
                        continue
                    why = f"the state of step {rewound_to} from the host-memory snapshot"
                self.live.append(name)
                self._event("slice_added", name, why)
                continue
            if time.monotonic() > deadline:
                raise NotEnoughSlices(
                    f"lost slice {lost}: {len(self.live)} left ({self.live}), below "
                    f"min_slices={self.min_slices}, and no replacement came within "
                    f"wait_for_slices_s={self.wait_for_slices_s:g} s; add capacity or lower "
                    f"min_slices")
            self.client.request_slices(self.target - len(self.live))
            self._asked = True
            candidates = self.client.refresh_slices()
            if not candidates:
                time.sleep(0.5)
        if rewound_to is not None:
            self._rerun_from(rewound_to, lost)

    def _copy_state(self, to: str) -> str:
        """Give slice ``to`` a copy of the first live slice's state: parameters and
        optimizer state, worker to worker; returns what happened, for the event."""
        import jax

        src = self.live[0]
        self.state[to] = jax.tree.map(lambda v, sh: self.client.reshard(v, sh, slice=to),
                                      self.state[src], self.state_shardings)
        what = "parameters and optimizer state" if "opt" in self.state[to] else "parameters"
        return f"{what} copied from {src}"

    def _rerun_from(self, step: int, lost: str) -> None:
        """Every live slice holds the snapshot's state of ``step`` (the first took
        them from the snapshot, the others from it): bring them back to ``steps_done``
        by running the kept batches again."""
        target, self.steps_done = self.steps_done, step
        self._event("snapshot_restored", lost, f"from step {step}; running the "
                    f"{target - step} step(s) since then again")
        for batch in [b for i, b in self._history if step <= i < target]:
            self._run_step(batch)
        if self.steps_done != target:
            raise RuntimeError(f"ran again to step {self.steps_done}, expected {target}: the "
                               f"batches since the snapshot of step {step} were not all kept")

    def _grow_at_boundary(self) -> None:
        """Between steps: ask for replacements, warm up new slices in the background,
        and add the ones whose warm-up finished (a copy of the current parameters)."""
        now = time.monotonic()
        if now >= self._next_grow_check:
            self._next_grow_check = now + self.grow_check_s
            for name in self.client.refresh_slices():
                self._warm_up(name)
            missing = want_more(len(self.live), self.target, len(self._joining))
            if missing or self._asked:
                self.client.request_slices(missing)
                self._asked = bool(missing)
        for name, warm in list(self._joining.items()):
            try:
                if not warm.is_ready():
                    continue
            except SliceLost:
                self._joining.pop(name)
                continue
            del self._joining[name]
            why = self._copy_state(to=name)
            self.live.append(name)
            self._event("slice_added", name, why)

    def _warm_up(self, name: str) -> None:
        """Ship and compile this trainer's programs on a new slice, off the step path
        (nothing runs, no bytes are put; the persistent cache makes it a load). The
        state follows from a survivor once it is done."""
        ready = self._compile_on(name)
        if self.feed is not None:
            self._open_feed(name)
        self._joining[name] = ready.status
        self._event("slice_joining", name, "compiling")

    def _compile_on(self, name: str):
        """Compile the step's three programs on slice ``name`` ahead of their first run;
        returns the last (one stream: when it is done, all are)."""
        import jax

        def like(v, sharding):
            return jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=sharding)

        state = jax.tree.map(like, self._host_state, self.state_shardings)
        batch = jax.ShapeDtypeStruct(self._batch_shape, self._batch_dtype,
                                     sharding=self.batch_sharding)
        grads = self._grads.lower(state["params"], batch)
        out = grads.program.out_sigs[0]
        vec = jax.ShapeDtypeStruct(out.shape, np.dtype(out.dtype), sharding=self.replicated)
        grads.compile(slice=name)
        self._add.lower(vec, vec).compile(slice=name)
        return self._apply.lower(state, vec).compile(slice=name)

