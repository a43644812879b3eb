"""The Dockerfiles, read as text (images cannot be built on the test machine): dependencies
in a layer before the sources, sshd installed, the GPU image in setup.sh's GPU mode."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def instructions(name):
    with open(os.path.join(ROOT, "docker", name)) as f:
        text = re.sub(r"\\\n", " ", f.read())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dependencies_are_a_layer_before_the_sources(name):
    lines = instructions(name)
    deps = next(i for i, l in enumerate(lines) if "HVD_ADAPT_DEPS_ONLY=1 scripts/setup.sh" in l)
    copy_all = lines.index("COPY . .")
    assert deps < copy_all < next(i for i, l in enumerate(lines)
                                  if l.startswith("RUN scripts/setup.sh"))
    for line in lines[:deps]:
        if line.startswith("COPY "):
            for path in line.split()[1:-1]:
                assert os.path.exists(os.path.join(ROOT, path)), path
    assert any("openssh-server" in l for l in lines) and any("/run/sshd" in l for l in lines)
    assert any("HVD_ADAPT_VENV=/opt/venv" in l for l in lines)


def test_gpu_image_builds_horovod_with_nccl_from_a_cuda_devel_base():
    lines = instructions("Dockerfile.gpu")
    assert re.match(r"FROM nvidia/cuda:[0-9.]+-devel-", lines[0])
    assert any("HVD_ADAPT_GPU=1" in l for l in lines)
