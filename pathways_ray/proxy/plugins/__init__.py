"""IFRT plugin programs through the proxy: what ``pathwaysutils`` compiles with
``PluginExecutable`` (persistence writes and reads of arrays, profile start and stop),
parsed in ``requests`` (pure) and run on the session's chips in ``run``."""
