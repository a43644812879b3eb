"""A hung worker in a 3-host elastic job on the namespace cluster: h3's training process is
SIGSTOPped for good while discovery still lists h3. Its watchdog
(hvd_adapt/_runtime/watchdog.py) ends it once its peers reset (a stopped process: evidence,
whatever for how long it was stopped), the driver records the failure, and the survivors
train on in a world of two; after the blacklist's cooldown h3 rejoins with a fresh worker.
Before the watchdog the survivors waited for the stopped worker for good.

The job gets ``after_fault`` seconds after the fault: about 15 s of training and a cold
rejoin, far less than a hang."""
from support import faults
from support.training_logs import check_exactly_once, check_identical_replicas

EPOCHS = 4    # one more than the crash tests: time for h3's cold rejoin


def stop_h3(bed, job):
    """SIGSTOP h3's training process for good."""
    job.stopped = faults.worker_pid(bed, "h3")
    bed.stop(job.stopped)


def check_trained_on(job):
    """The job ended within its bound, every sample once per epoch, replicas identical, and
    the survivors trained in a world of two after the fault."""
    assert job.returncode == 0, job.describe()
    check_exactly_once(job.commits, job.epochs, EPOCHS, samples=faults.SAMPLES)
    check_identical_replicas(job.commits)
    after = {entry["size"] for entry in job.commits if entry["time"] > job.fault_time}
    assert 2 in after, (after, job.describe())


def check_h3_rejoined(job):
    """A worker on h3 other than the stopped one committed in a world of three after the
    fault (the stopped one never committed again)."""
    fresh = {entry["pid"] for entry in job.commits
             if entry["host"] == "h3" and entry["time"] > job.fault_time}
    assert fresh and f"commits.{job.stopped}.jsonl" not in fresh, (fresh, job.describe())
    assert "ending the worker (SIGKILL): it is stopped (/proc state T) while its peers reset" \
        in job.output, job.describe()


def test_a_worker_stopped_for_good_is_replaced(bed, job_dir):
    # The survivors hold still at step 16 (ten steps after the fault) until h3's rejoin
    # reaches them: without it, two survivors that wait sleeping could finish the epochs
    # before h3's cooldown and cold start were over (seen once), and nothing would rejoin.
    job = faults.run_fault(bed, job_dir, stop_h3, after_fault=90, epochs=EPOCHS,
                           worker_args=["--wait-steps", "[16]"])
    check_trained_on(job)
    check_h3_rejoined(job)
