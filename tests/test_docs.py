"""The documentation: every Python block in README.md and docs/ runs, every relative link
resolves, and the README stays a front page."""
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```$", re.M | re.S)


def python_blocks():
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        for number, match in enumerate(FENCE.finditer(text), 1):
            yield pytest.param(textwrap.dedent(match.group(2)),
                               id=f"{os.path.relpath(page, ROOT)}#{number}")


def test_the_pages_hold_python_blocks():
    assert len(list(python_blocks())) >= 3


@pytest.mark.parametrize("code", list(python_blocks()))
def test_python_block_runs(code, tmp_path):
    # Each in a fresh interpreter, as a user pastes it into a script.
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    with open(page) as f:
        text = f.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        assert os.path.exists(os.path.join(os.path.dirname(page), target)), (page, target)


def test_the_readme_is_a_front_page():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, len(lines)
    # The two set-up commands, the second the one CI runs.
    block = lines[lines.index("```bash") + 1:]
    assert block[:2] == ["scripts/demo.sh", "scripts/test.sh"]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "scripts/test.sh" in f.read()
