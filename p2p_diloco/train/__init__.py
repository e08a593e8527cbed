"""Training on one peer: local work on one device or local files, nothing of the swarm.

The model, its data and their prefetch, the inner optimizer, a peer of several GPUs (ranks,
follower, fsdp), the data-parallel baseline, checkpoints, metrics and their sinks.
"""
