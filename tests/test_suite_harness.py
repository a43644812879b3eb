"""The suite's processes import tests/support/site/sitecustomize.py (see tests/conftest.py): torch's
eager optimizers there must train bit for bit as in a process without it, and without importing
``torch._dynamo``; a compiled model must still get torch's own wrappers."""
import json
import os
import subprocess
import sys

import pytest

from support.launch import SITE, launch_env, pythonpath, torch_as_is, with_site

# Every optimizer method torch marks (add_param_group, zero_grad, state_dict, load_state_dict,
# step) and a scheduler, clipping and a GradScaler, as the workers use them.
TRAIN = """
import hashlib, json, sys
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "lr": 0.1})
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
scaler = torch.amp.GradScaler("cpu", enabled=False)
if sys.argv[1] == "compiled":
    model = torch.compile(model, backend="eager")
for step in range(4):
    opt.zero_grad(set_to_none=True)
    loss = model(torch.randn(5, 8)).square().mean() + opt.param_groups[1]["params"][0].sum()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    sched.step()
    if step == 1:
        opt.load_state_dict(opt.state_dict())
digest = hashlib.sha256()
for tensor in list(model.state_dict().values()) + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]:
    digest.update(tensor.detach().numpy().tobytes())
print(json.dumps({"digest": digest.hexdigest(), "dynamo": "torch._dynamo" in sys.modules}))
"""


def run(mode, site):
    env = (with_site if site else torch_as_is)(launch_env("/nonexistent"))
    done = subprocess.run([sys.executable, "-c", TRAIN, mode], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_suites_processes_start_with_the_site_unless_told_to_run_torch_as_is():
    as_is = os.environ.get("HVD_ADAPT_TEST_TORCH_AS_IS") == "1"
    assert (SITE in pythonpath(launch_env("/nonexistent"))) != as_is


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_optimizers_train_bit_for_bit_as_without_the_site(mode):
    with_site, as_is = run(mode, site=True), run(mode, site=False)
    assert with_site["digest"] == as_is["digest"]
    # Compiling imports torch._dynamo; from then on the wrappers are torch's own.
    assert as_is["dynamo"] and with_site["dynamo"] == (mode == "compiled"), (
        "the site no longer keeps torch._dynamo out of an eager process: has torch renamed "
        "_disable_dynamo or _use_grad_for_differentiable?")


def test_a_process_without_torch_loads_nothing_more_than_the_site():
    # Every process the suite starts imports it: Horovod's discovery polls start one each.
    def modules(env):
        done = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps("
                               "sorted(sys.modules)))"], env=env, capture_output=True, text=True)
        return set(json.loads(done.stdout))
    env = launch_env("/nonexistent")
    assert modules(with_site(env)) - modules(torch_as_is(env)) == {"sitecustomize"}


def test_a_torch_whose_wrappers_take_more_arguments_imports_as_it_would_without_the_site(tmp_path):
    # A later torch may give _disable_dynamo another keyword (torch._dynamo.disable has reason=).
    files = {
        "torch/__init__.py": "from torch._compile import _disable_dynamo\nimport torch.optim\n",
        "torch/_compile.py": (
            "import functools\n"
            "def _disable_dynamo(fn=None, recursive=True, reason=None):\n"
            "    if fn is None:\n"
            "        return functools.partial(_disable_dynamo, recursive=recursive, reason=reason)\n"
            "    fn.reason = reason\n"
            "    return fn\n"),
        "torch/optim/__init__.py": "from torch.optim import optimizer\n",
        "torch/optim/optimizer.py": (
            "import torch\n"
            "def _use_grad_for_differentiable(func):\n"
            "    return func\n"
            "@torch._disable_dynamo(reason='why')\n"
            "def f():\n"
            "    return f.__wrapped__.reason if hasattr(f, '__wrapped__') else f.reason\n"),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = with_site(dict(os.environ, PYTHONPATH=str(tmp_path)))
    done = subprocess.run([sys.executable, "-c", "import torch.optim.optimizer as o; print(o.f())"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "why", done.stderr


def test_running_torch_as_is_with_the_site_already_on_pythonpath_is_refused():
    env = dict(os.environ, HVD_ADAPT_TEST_TORCH_AS_IS="1", PYTHONPATH=SITE)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--co", os.path.abspath(__file__)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and f"PYTHONPATH names {SITE}" in done.stdout + done.stderr
