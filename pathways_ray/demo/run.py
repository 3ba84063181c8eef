"""The main job: train a small transformer LM on a local emulated fleet, single controller.

Starts a fleet of emulated v6e slices, connects a client (the controller
reserves every slice), and trains ``pathways_ray.demo.lm`` on synthetic text: data
parallel across slices, data x model parallel within each slice. Shows a
progress bar (step, loss, tokens/s), writes a loss-curve PNG, prints the fleet
status and a summary, and stops every process it started.

``chaos=True`` rehearses a failure: a third of the way in, one host of the last
slice is killed for real (``LocalFleet.remove_host``); training goes on on the
slices left, the host comes back two steps later, and the trainer grows back
onto it once its chips have compiled. The events are marked on the loss plot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pathways_ray._ui import fleet_progress, make_console
from pathways_ray.clusters.topology import Topology
from pathways_ray.emulation.local_fleet import LocalFleet
from pathways_ray.observability.status import collect_status, render_status


@dataclass(frozen=True)
class DemoResult:
    fleet_up_s: float
    losses: list[float]
    loss_floor: float
    tokens_per_s: float
    train_s: float
    plot: Path
    events: tuple = ()  # the elastic events (a chaos run)


def run_demo(
    *,
    num_slices: int = 2,
    accelerator: str = "v6e",
    topology: str = "2x2",
    chips_per_host: int | None = None,
    steps: int = 80,
    batch: int = 64,
    out_dir: str | Path = "pathways-ray-demo",
    console: Console | None = None,
    chaos: bool = False,
    microbatches: int = 1,
    bf16: bool = False,
) -> DemoResult:
    from pathways_ray.client.connect import connect
    from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn, param_specs
    from pathways_ray.elastic.data_parallel import DataParallelTrainer
    from pathways_ray.elastic.optim import adamw_warmup_cosine

    console = console or make_console()
    topo = Topology.parse(accelerator, topology, chips_per_host=chips_per_host)
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    if chaos and (num_slices < 2 or steps < 6):
        raise ValueError(f"chaos=True needs 2 or more slices and 6 or more steps (got "
                         f"{num_slices} slices, {steps} steps): training goes on on the rest")
    model_par = 2 if topo.chips % 2 == 0 else 1
    mesh_shape = (topo.chips // model_par, model_par)
    per_slice = batch // num_slices
    if batch % num_slices or per_slice % (microbatches * mesh_shape[0]):
        raise ValueError(f"batch={batch} must split evenly over {num_slices} slices x "
                         f"{microbatches} micro-batches x {mesh_shape[0]} data-parallel chips")
    cfg = LMConfig()
    text = MarkovText(cfg.vocab)
    console.print(f"[bold]pathways-ray[/bold]: {num_slices} x {topo.describe()}; training a "
                  f"{cfg.layers}-layer transformer LM, mesh data={mesh_shape[0]} x "
                  f"model={mesh_shape[1]} per slice, data parallel across slices; AdamW, "
                  f"warm-up + cosine, clipping"
                  + (f", {microbatches} micro-batches per slice" if microbatches > 1 else "")
                  + (", bf16 compute" if bf16 else ""))
    t0 = time.monotonic()
    # The chip workers' own output (gloo's connection lines, XLA's warnings) stays in
    # the fleet's log files: errors reach this process as exceptions.
    fleet = LocalFleet(num_slices=num_slices, accelerator=topo.generation.name,
                       topology=topo.name, chips_per_host=topo.chips_per_host, name="demo",
                       log_to_driver=False)
    try:
        with fleet_progress(console) as update:
            fleet.start(progress=update)
        fleet_up = time.monotonic() - t0
        console.print(f"fleet up in {fleet_up:.1f}s at {fleet.address}")
        client = connect()
        try:
            console.print("controller holds " + ", ".join(
                f"{s.name} ({s.chips} chips)" for s in client.slices))
            events: list = []
            import jax.numpy as jnp

            trainer = DataParallelTrainer(client, lambda p, b: loss_fn(p, b, cfg),
                                          init_params(cfg), param_specs(cfg),
                                          mesh_shape=mesh_shape,
                                          optimizer=adamw_warmup_cosine(1e-2, steps),
                                          microbatches=microbatches,
                                          compute_dtype=jnp.bfloat16 if bf16 else None,
                                          grow=chaos, on_elastic_event=events.append)
            injector = _Chaos(fleet, client.slices[-1].name, steps, console) if chaos else None
            losses, train_s, tps = _train(trainer, text, cfg, steps, batch, console, injector)
            console.print(render_status(*collect_status()))
        finally:
            client.close()
    finally:
        fleet.shutdown()
    plot = _plot(losses, text.entropy_rate, Path(out_dir) / "loss.png",
                 f"{num_slices} x {topo.generation.name} {topo.name} (emulated)", events)
    summary = Table(title="summary", title_justify="left", show_header=False)
    for k, v in [("slices", f"{num_slices} x {topo.describe()}"),
                 ("steps", str(steps)),
                 ("loss", f"{losses[0]:.3f} -> {losses[-1]:.3f} (floor {text.entropy_rate:.3f})"),
                 ("throughput", f"{tps:,.0f} tokens/s after the first step"),
                 ("train time", f"{train_s:.1f}s (fleet up {fleet_up:.1f}s)"),
                 ("loss curve", str(plot))]:
        summary.add_row(k, v)
    for e in events:
        summary.add_row(f"step {e.step + 1}", f"{e.kind.replace('_', ' ')}: {e.slice} "
                        f"({e.reason}); {len(e.live)} slices live")
    console.print(summary)
    console.print(f"done in {time.monotonic() - t0:.1f}s; every process stopped")
    return DemoResult(fleet_up, losses, text.entropy_rate, tps, train_s, plot, tuple(events))


class _Chaos:
    """Kills a host of ``victim`` a third of the way in; restores it two steps later."""

    def __init__(self, fleet: LocalFleet, victim: str, steps: int, console: Console):
        self.fleet, self.victim, self.console = fleet, victim, console
        self.kill_at = max(2, steps // 3)
        self.restore_at = self.kill_at + 2

    def before_step(self, i: int) -> None:
        if i == self.kill_at:
            self.fleet.remove_host(self.victim, 0)
            self.console.print(f"[red]chaos[/red]: killed host {self.victim}/0 before step "
                               f"{i + 1}")
        elif i == self.restore_at:
            self.fleet.restore_host(self.victim, 0)
            self.console.print(f"[green]chaos[/green]: host {self.victim}/0 is back (a new VM)"
                               f" before step {i + 1}")


def _train(trainer, text, cfg, steps: int, batch: int, console: Console,
           chaos: _Chaos | None = None):
    rng = np.random.default_rng(0)
    bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]}"),
                   TimeElapsedColumn(), console=console)
    losses: list[float] = []
    tokens = batch * cfg.seq
    t_start = time.monotonic()
    t_first = None
    pending = None
    with bar:
        task = bar.add_task("train", total=steps, loss="-", tps="")
        for i in range(steps):
            if chaos is not None:
                chaos.before_step(i)
            result = trainer.step(text.batch(rng, batch, cfg.seq + 1))
            if pending is not None:  # read the previous step's loss while this one runs
                losses.append(pending.mean_loss())
                if t_first is None:
                    t_first = time.monotonic()
                done = len(losses) - 1
                tps = tokens * done / (time.monotonic() - t_first) if done else 0.0
                bar.update(task, completed=len(losses), loss=f"{losses[-1]:.3f}",
                           tps=f"{tps:,.0f} tok/s" if done else "compiling…")
            pending = result
        losses.append(pending.mean_loss())
        bar.update(task, completed=len(losses), loss=f"{losses[-1]:.3f}")
    t_end = time.monotonic()
    steady = max(1, len(losses) - 1)
    tps = tokens * steady / max(1e-9, t_end - (t_first or t_start))
    return losses, t_end - t_start, tps


_EVENT_STYLE = {"slice_lost": ("#d62728", "slice lost"), "slice_added": ("#2ca02c", "slice added")}


def _plot(losses: list[float], floor: float, path: Path, title: str,
          events: list = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(range(1, len(losses) + 1), losses, label="training loss", color="#1f77b4")
    ax.axhline(floor, ls="--", color="gray", label=f"entropy floor ({floor:.2f} nats)")
    labelled = set()
    for e in events:
        if e.kind in _EVENT_STYLE:
            color, label = _EVENT_STYLE[e.kind]
            ax.axvline(e.step + 1, color=color, ls=":", lw=1.5,
                       label=None if e.kind in labelled else f"{label} ({e.slice})")
            labelled.add(e.kind)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats)")
    ax.set_title(f"pathways-ray single controller: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.resolve()
