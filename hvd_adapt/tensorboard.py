"""Optional TensorBoard export of what the loader and optimizer decided and measured."""
from . import env


def write_loader_metrics(loader, writer, step, tag_prefix="hvd_adapt"):
    """Write batch sizes, accumulation, gain, noise scale and throughput at ``step``.

    ``writer`` is a ``torch.utils.tensorboard.SummaryWriter`` (or anything
    with ``add_scalar``); only rank 0 writes.
    """
    if env.rank() != 0:
        return
    local, accum = loader.current_local_bsz, loader.accumulation_steps
    scalars = {"batch_size": loader.current_batch_size, "local_bsz": local,
               "accumulation_steps": accum, "replicas": env.size()}
    rate = loader.profile.throughput(env.num_nodes(), env.size(), local, accum)
    if rate:
        scalars["samples_per_second"] = rate
    opt = loader._optimizer
    if opt is not None and opt.gns.has_estimate():
        scalars["gain"] = opt.gns.gain(loader.current_batch_size, loader.batch_size)
        scalars["noise_scale"] = opt.gns.noise_scale()
        scalars["progress"] = opt.gns.progress
    for name, value in scalars.items():
        writer.add_scalar(f"{tag_prefix}/{name}", value, step)
