"""The README's minimal loop over real ssh on three hosts, launched as a user would on h1."""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def readme_minimal_loop():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## A minimal loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_loop_on_three_hosts(bed, job_dir):
    with open(os.path.join(job_dir, "train.py"), "w") as f:
        f.write(readme_minimal_loop())
    command = [os.path.join(BIN, "horovodrun"), "-np", "3", "-H", "h1:1,h2:1,h3:1", "--gloo",
               "--network-interface", "eth0", sys.executable, "train.py"]
    result = bed.run("h1", command, timeout=300, check=False, cwd=job_dir,
                     env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    # Every rank prints each epoch's loss over the whole world; the 3 hosts agree.
    epochs = re.findall(r"\[(\d)\]<stdout>:(\d) ([0-9.]+) ", output)
    assert sorted({rank for rank, _, _ in epochs}) == ["0", "1", "2"], output[-3000:]
    for epoch in "012":
        losses = {loss for _, e, loss in epochs if e == epoch}
        assert len(losses) == 1, (epoch, losses)
    assert os.path.exists(os.path.join(job_dir, "ckpt", "job.pt"))
