"""Optional TensorBoard export of what the autoscaling controller decided and measured."""
from .._runtime import env


def write_metrics(metrics, writer, step, tag_prefix="hvd_adapt"):
    """Write each scalar of ``metrics`` (a dict) as ``{tag_prefix}/{name}`` at ``step``.

    ``writer`` is a ``torch.utils.tensorboard.SummaryWriter`` (or anything
    with ``add_scalar``); only rank 0 writes. ``loader.to_tensorboard(writer,
    step)`` passes the loader's batch sizes, gain, noise scale and throughput.

    >>> class Printer:
    ...     def add_scalar(self, tag, value, step):
    ...         print(tag, value, step)
    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> write_metrics({"batch_size": 256}, Printer(), step=10)
    hvd_adapt/batch_size 256 10
    """
    if env.rank() != 0:
        return
    for name, value in metrics.items():
        writer.add_scalar(f"{tag_prefix}/{name}", value, step)
