"""Transport: the commands a slice runs and how they reach its chips.

``commands`` (what is sent), ``channel`` (the command stream to a chip worker),
``fanout`` (the relay tree over a slice's hosts), ``pull`` (chip-to-chip copies)."""
