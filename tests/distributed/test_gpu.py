"""The collective, fixed-size, sync and elastic jobs on CUDA (Horovod built with NCCL).

Skipped where torch sees no CUDA device. NCCL refuses two ranks on one GPU,
so multi-process tests run one rank per GPU and need two GPUs; on one GPU
the single-process ones still run. ``scripts/gpu_check.sh`` runs these.
"""
import pytest
import torch

from support.launch import run_ranks
from support.elastic_jobs import run_elastic, sizes_in_order
from support.training_logs import SAMPLES, check_exactly_once, read_logs

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA = {"HVD_ADAPT_TEST_DEVICE": "cuda"}

pytestmark = [pytest.mark.distributed, pytest.mark.gpu,
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]
several = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices (one rank per GPU)")


def nccl_built():
    import horovod.torch as hvd
    return hvd.nccl_built()


def test_horovod_was_built_with_nccl():
    assert nccl_built(), "rebuild with scripts/setup.sh on this machine (GPU mode)"


@pytest.mark.parametrize("launcher,np", [("python", 1), pytest.param("gloo", 2, marks=several)])
def test_fixed_size_epochs_on_cuda(launcher, np):
    job = run_ranks("elastic_train.py", np=np, launcher=launcher, env=CUDA,
                    args=["--samples", SAMPLES, "--epochs", "2", "--batch-size", "7"]).check()
    commits, epochs = read_logs(job.out_dir)
    check_exactly_once(commits, epochs, 2)


@several
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_on_cuda_copies_rank0(optimizer):
    job = run_ranks("sync_recipes.py", np=2, env=CUDA,
                    args=["--optimizer", optimizer, "--root-trained", 3, "--wrapped"]).check()
    root = job.reports[0]
    assert all(rep["params"] == root["before"]["params"] and rep["opt"] == root["before"]["opt"]
               for rep in job.reports.values())


@several
def test_collectives_on_cuda_build():
    job = run_ranks("collectives.py", np=2, env=CUDA).check()
    assert sorted(job.reports) == [0, 1]


@several
def test_elastic_resize_on_cuda():
    schedule = [(0, ["localhost:2"]), (4, ["localhost:1"]), (8, ["localhost:2"])]
    args = ["--epochs", "2", "--batch-size", "8", "--wait-steps", "[4, 8]"]
    job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=2, worker_args=args,
                                       env=CUDA)
    job.check()
    assert sizes_in_order(commits) == [2, 1, 2]
    check_exactly_once(commits, epochs, 2)
