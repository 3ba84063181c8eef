"""The shared service: a long-running pool of slices that many clients lease."""
