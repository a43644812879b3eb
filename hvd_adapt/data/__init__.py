"""Elastic data: the sampler that partitions each epoch over the current replicas,
and the loader that plans and iterates each replica's batches."""
