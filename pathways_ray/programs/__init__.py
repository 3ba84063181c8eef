"""Programs: shardings, exported SPMD programs and the persistent compilation cache.

Pure: no Ray, and JAX only where a program is exported or read."""
