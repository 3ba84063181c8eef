"""``pathways-ray``: the command line, one module per command group."""
