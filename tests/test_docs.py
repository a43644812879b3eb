"""The documentation: every Python block in README.md and docs/ runs; every shell block's
commands name files, options and extras that exist (checked with the real argument parsers
of horovodrun, hvd-adapt-discover, hvd-adapt-worker, hvd-adapt-run and the examples: docker, kubectl and
multi-host launches cannot run here); every relative link resolves; the README stays a
front page."""
import configparser
import glob
import os
import re
import shlex
import subprocess
import sys
import textwrap
from unittest import mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```$", re.M | re.S)
SHELL_FENCE = re.compile(r"^( *)```(?:bash|sh)\n(.*?)^\1```$", re.M | re.S)


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


def shell_commands():
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        for number, match in enumerate(SHELL_FENCE.finditer(text), 1):
            block = textwrap.dedent(match.group(2)).replace("\\\n", " ")
            for line in block.splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    yield pytest.param(words, id=f"{os.path.relpath(page, ROOT)}#{number}:"
                                                 f"{' '.join(words[:2])}")


def test_the_pages_hold_shell_blocks():
    assert len(list(shell_commands())) >= 10


def repo_file(path, executable=False):
    full = os.path.join(ROOT, path)
    assert os.path.isfile(full), f"{path} does not exist"
    assert not executable or os.access(full, os.X_OK), f"{path} is not executable"


def check_python_script(args):
    """``python SCRIPT ARGS``: an example must exist and accept every option given."""
    script, options = args[0], [a.split("=")[0] for a in args[1:] if a.startswith("--")]
    if not script.startswith("examples/"):
        return  # the user's own train.py
    repo_file(script)
    usage = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"],
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0, usage.stderr[-2000:]
    for option in options:
        assert re.search(rf"{re.escape(option)}\b", usage.stdout), (script, option)


def check_horovodrun(args):
    from horovod.runner import launch
    with mock.patch.object(sys, "argv", ["horovodrun"] + args):
        parsed = launch.parse_args()
    if parsed.host_discovery_script:
        check_command(shlex.split(parsed.host_discovery_script))
    check_command(parsed.command)


def check_discover(args):
    from hvd_adapt.scheduling import discover
    parser = discover.parser()
    discover.check(parser.parse_args(args), parser)


def check_arbiter(args):
    from hvd_adapt.scheduling import arbiter
    arbiter.parser().parse_args([a for a in args if a != "&"])


def check_worker(args):
    from hvd_adapt.scheduling import standby
    check_command(standby.parse(standby.parser(), args)[1])


def check_supervisor(args):
    from hvd_adapt.scheduling import job_supervisor
    check_command(job_supervisor.parse(job_supervisor.parser(), args)[1])


def check_pip(args):
    assert args[0] == "install", args
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    for spec in args[1:]:
        for extra in re.findall(r"\[([^]]+)\]", spec):
            for name in extra.split(","):
                assert config.has_option("options.extras_require", name.strip()), spec


def check_docker(args):
    if args[0] == "build":
        repo_file(args[args.index("-f") + 1])
        return
    if args[0] in ("tag", "push"):
        return
    assert args[0] == "run", args
    rest, takes_value = args[1:], {"-v", "--name", "--network", "--gpus", "-e", "-p"}
    while rest[0].startswith("-"):
        rest = rest[2:] if rest[0] in takes_value else rest[1:]
    assert rest[0].startswith("hvd_adapt"), f"image {rest[0]} is not the one docker/ builds"
    if rest[1:]:
        check_command(rest[1:])


def check_kubectl(args):
    if args[0] == "apply":
        for index, word in enumerate(args):
            if word == "-f":
                repo_file(args[index + 1])
    elif args[0] == "create":
        assert args[1] == "secret", args
    else:
        assert args[0] == "logs", args


def check_command(words):
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words = words[1:]  # VAR=value before a command
    if not words:
        return
    program, args = words[0], words[1:]
    if program == "export":
        assert all(re.match(r"^[A-Z_]+=", a) for a in args), args
    elif program in ("python", "python3", ".venv/bin/python"):
        check_python_script(args)
    elif program.startswith(("scripts/", "examples/")):
        repo_file(program, executable=True)
    elif program in COMMANDS:
        COMMANDS[program](args)
    elif program in ("/usr/sbin/sshd", "ssh-keygen") or program.startswith("./"):
        pass  # the Docker image's, OpenSSH's; the user's own script
    else:
        pytest.fail(f"no rule checks {program!r}: add one to tests/test_docs.py")


COMMANDS = {"horovodrun": check_horovodrun, "hvd-adapt-discover": check_discover,
            "hvd-adapt-arbiter": check_arbiter, "hvd-adapt-worker": check_worker,
            "hvd-adapt-run": check_supervisor, "pip": check_pip, "docker": check_docker,
            "kubectl": check_kubectl}


@pytest.mark.parametrize("words", list(shell_commands()))
def test_shell_command_names_what_exists(words):
    check_command(words)


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
