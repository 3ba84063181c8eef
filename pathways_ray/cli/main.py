"""``pathways-ray``: start, inspect and stop TPU fleets.

    pathways-ray up --slices 2 --accelerator v6e --topology 2x4 --chips-per-host 4
    pathways-ray status
    pathways-ray down
    pathways-ray demo [--chaos]
    pathways-ray chaos kill-host v6e-2x4-1
    pathways-ray cache status|clear
    pathways-ray doctor [--cluster]

One module per command group (``fleet``, ``jobs``, ``service``, ``cache``, ``proxy``,
``doctor``), each with a ``register(sub)`` that adds its subcommands, as the optional
parts' commands register through the ``pathways_ray.commands`` entry points.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from rich.markup import escape

from pathways_ray.cli import cache, doctor, fleet, jobs, proxy, service
from pathways_ray.cli.common import err
from pathways_ray.errors import PathwaysError

# every command: its name -> handler, filled by build_parser
COMMANDS: dict = {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pathways-ray",
        description="A single-controller runtime for TPU fleets on Ray. Emulates a fleet of "
        "TPU hosts on this machine (one Ray node per host, one XLA CPU device per chip) or "
        "inspects a real one.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for group in (fleet, cache, jobs, service, proxy, doctor):
        COMMANDS.update(group.register(sub))
    _add_plugins(sub)
    return parser


def _add_plugins(sub) -> None:
    """Commands of the optional parts (e.g. ``k8s`` from pathways_ray.kuberay).

    They register through the ``pathways_ray.commands`` entry point group, so the
    core never imports them.
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group="pathways_ray.commands"):
        try:
            register = ep.load()
        except ImportError as e:  # an extra's dependency is missing
            logging.getLogger(__name__).debug("command %s unavailable: %s", ep.name, e)
            continue
        COMMANDS.update(register(sub))


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwinding as Ctrl-C does."""


def handle_sigterm_as_interrupt() -> None:
    """Kubernetes, Docker and systemd stop a process with SIGTERM: unwind as on Ctrl-C
    (``KeyboardInterrupt``), so every command stops what it started.

    A signal handler's exception is lost when the signal lands inside a gc callback or
    a ``__del__`` (JAX has a gc callback; seen here: SIGTERM mid-training was
    "ignored" and the demo ran on). Python reports such a lost exception to
    ``sys.unraisablehook``; ours has it raised again in the main thread a moment later
    (from another thread: raised from the hook itself, it would be lost the same way).

    A signal that lands while a module is being imported waits until the import is
    done: raised there, it can cross a native extension's init (jaxlib's nanobind
    turns it into a C++ exception nobody catches, and the process aborts; seen in CI
    with SIGTERM during ``import jax``). Ctrl-C gets the same treatment.
    """
    import threading

    main_thread = threading.main_thread().ident

    def later(signum):  # a real signal to the main thread wakes it from a blocking call
        threading.Timer(0.05, signal.pthread_kill, args=(main_thread, signum)).start()

    def importing(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                return True
            frame = frame.f_back
        return False

    def on_signal(signum, frame):
        if importing(frame):
            later(signum)
            return
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            later(signal.SIGTERM if isinstance(unraisable.exc_value, Terminated)
                  else signal.SIGINT)
            return
        previous(unraisable)

    sys.unraisablehook = hook
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handle_sigterm_as_interrupt()
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:
        parser.error(str(e))  # exits 2 with usage
    except PathwaysError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        return 1
    except KeyboardInterrupt:
        err.print("interrupted; stopped what was started")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
