"""Elastic training on Horovod: the State and its handlers, ``run``, epochs,
checkpoints and the SIGTERM drain (see each module)."""
