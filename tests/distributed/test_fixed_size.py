"""Training at a fixed world size under horovodrun and mpirun: every epoch sees each sample once."""
import pytest

from support.launch import run_ranks
from support.training_logs import SAMPLES, check_exactly_once, check_identical_replicas, read_logs

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("launcher,np", [("gloo", 2), ("gloo", 3), ("mpi", 2)])
def test_epochs_cover_the_dataset_once(launcher, np):
    job = run_ranks("elastic_train.py", np=np, launcher=launcher,
                    args=["--samples", SAMPLES, "--epochs", "2", "--batch-size", "7"]).check()
    commits, epochs = read_logs(job.out_dir)
    assert {entry["size"] for entry in commits} == {np}
    assert {entry["rank"] for entry in commits} == set(range(np))
    check_exactly_once(commits, epochs, 2)
    check_identical_replicas(commits)
