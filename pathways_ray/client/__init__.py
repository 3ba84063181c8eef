"""The client side: what user code holds (``connect``, ``Client``, ``RemoteArray``,
``jit``), the dispatch queue, and the client half of sidecars."""
