"""Elastic data: :mod:`.sampler` (each epoch partitioned over the current replicas),
:mod:`.loader` (each replica's batches planned and iterated) and :mod:`.tensorboard`
(the loader's optional export)."""
