"""Memory at default settings, where users start (issue 43): an AdamW state of about 200 MB
(24 x Linear(1024, 1024)) swapped with no swap_buffer_mb lowers the process's peak RSS by at
least 0.7 of the state (it saved 72-99 MB of 200 with the buffers, the optimizer's
temporaries and the copies a step held before). Each job in a process of its own. Run
alone (``serial``): the peak depends on how far the swap's reads and writes overlap the step,
which a loaded machine changes."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.serial


JOB = """
import resource, sys, tempfile, torch, hvd_adapt
hvd_adapt.init()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
swap_dir = tempfile.mkdtemp(dir=sys.argv[1]) if sys.argv[1] != "memory" else None
opt = hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     swap_dir=swap_dir)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 1024)).pow(2).mean().backward()
    opt.step()
state = sum(2 * p.numel() * p.element_size() for p in model.parameters())
print(state, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak(where):
    done = subprocess.run([sys.executable, "-c", JOB, where], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    state, rss = map(int, done.stdout.split())
    return state, rss


def test_the_state_on_disk_at_default_settings_saves_most_of_its_bytes(tmp_path):
    state, in_memory = peak("memory")
    _, on_disk = peak(str(tmp_path))
    assert 190e6 < state < 210e6, state
    saved = (in_memory - on_disk) / state
    assert saved >= 0.7, f"peak RSS {in_memory / 1e6:.0f} MB in memory, {on_disk / 1e6:.0f} MB " \
        f"on disk: {saved:.2f} of the state saved"
