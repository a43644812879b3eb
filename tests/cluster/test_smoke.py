"""The README's minimal loop over real ssh on three hosts, launched as a user would on h1:
with a plain horovodrun command, and with the README's elastic command as written."""
import os
import re
import shlex
import sys

from support.readme import readme_elastic_command, readme_minimal_loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def write_loop(job_dir):
    with open(os.path.join(job_dir, "train.py"), "w") as f:
        f.write(readme_minimal_loop())


def check_three_hosts_trained(result, job_dir):
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    # Every rank prints each epoch's loss over the whole world; the 3 hosts agree.
    epochs = re.findall(r"\[(\d)\]<stdout>:(\d) ([0-9.]+) ", output)
    assert sorted({rank for rank, _, _ in epochs}) == ["0", "1", "2"], output[-3000:]
    for epoch in "012":
        losses = {loss for _, e, loss in epochs if e == epoch}
        assert len(losses) == 1, (epoch, losses)
    assert os.path.exists(os.path.join(job_dir, "ckpt", "job.pt"))


def test_readme_elastic_command_as_written_on_three_hosts(bed, job_dir):
    """The README's elastic command, word for word (``--network-interface eth0``, which is
    the bed's interface), with a discovery script listing the three hosts: it grows to
    all three (``--max-np 8``) and trains to its end over real ssh."""
    write_loop(job_dir)
    discover = os.path.join(job_dir, "discover.sh")
    with open(discover, "w") as f:
        f.write("#!/bin/sh\necho h1:1\necho h2:1\necho h3:1\n")
    os.chmod(discover, 0o755)
    command = shlex.split(readme_elastic_command())
    assert "./discover.sh" in command and command[0] == "horovodrun", command
    # "horovodrun" and "python" as a user's shell finds them: the venv's.
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    result = bed.run("h1", command, timeout=300, check=False, cwd=job_dir, env=env)
    check_three_hosts_trained(result, job_dir)


def test_readme_loop_on_three_hosts(bed, job_dir):
    write_loop(job_dir)
    command = [os.path.join(BIN, "horovodrun"), "-np", "3", "-H", "h1:1,h2:1,h3:1", "--gloo",
               "--network-interface", "eth0", sys.executable, "train.py"]
    result = bed.run("h1", command, timeout=300, check=False, cwd=job_dir,
                     env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    check_three_hosts_trained(result, job_dir)
