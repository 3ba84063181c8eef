"""The single controller: the Ray actor that owns slices, programs and arrays,
dispatches every batch and decides what a lost slice means."""
