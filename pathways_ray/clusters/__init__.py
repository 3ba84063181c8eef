"""Clusters: what the TPU fleet is, and the managers that bring one up.

Topology math (``topology``), views of the Ray cluster's TPU hosts (``cluster``,
``fleet``), the record of reserved slices (``registry``), what each TPU host is
(``host_plan``) and Slurm (``slurm``, ``slurm_node``). Imports no other subsystem."""
