"""The emulated fleet: TPU hosts as Ray nodes on one machine, and ways to break them.

Only the CLI, the demo and tests import this package; the runtime runs the same
on real TPUs."""
