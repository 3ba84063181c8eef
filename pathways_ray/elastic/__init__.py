"""Elastic training: data parallelism across slices that survives losing one.

``data_parallel`` (the trainer), ``elastic_policy`` (what to do on a loss; pure),
``snapshot`` (host-memory snapshots), ``feed`` (input read on the hosts)."""
