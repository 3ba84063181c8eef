"""Storage: checkpoints of arrays to files and buckets, and of a host's shards to its
sidecar's memory."""
