"""The package's plan: what each import loads, and rooms that talk through public methods."""
import ast
import os
import re
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hvd_adapt")


def loaded_after(statement):
    code = f"{statement}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout


@pytest.mark.parametrize("statement", ["import hvd_adapt", "import hvd_adapt.goodput",
                                       "from hvd_adapt.goodput import GoodputFunction, fit_perf_params"])
def test_importing_loads_neither_torch_nor_horovod(statement):
    loaded = loaded_after(statement)
    assert "'torch'" not in loaded and "'horovod'" not in loaded, loaded


def test_goodput_answers_a_scheduler_without_torch():
    code = ("import sys\nfrom hvd_adapt.goodput import GoodputFunction, GradParams, PerfParams\n"
            "fn = GoodputFunction(PerfParams(0.02, 0.001, 0.1, 0.01, 0.05, 0.005, 1.5), "
            "GradParams(1.0, 4.0), 128)\n"
            "print(fn.optimize(4, 16, 4096, (32, 512))[0] > 0, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_the_arbiter_loads_neither_torch_nor_numpy_nor_horovod(tmp_path):
    # hvd-adapt-arbiter's main, one cycle of it (its loop replaced by one cycle), as the
    # console script runs it: a scheduler's process, standard library only.
    (tmp_path / "pool").write_text("h1\n")
    code = ("import sys; from hvd_adapt.scheduling import arbiter; "
            "arbiter.Arbiter.serve = lambda self: self.cycle(); "
            "assert arbiter.main(sys.argv[1:]) == 0; "
            "print(sorted({m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code, "--folder", str(tmp_path / "a"),
                          "--hostfile", str(tmp_path / "pool"), "--ssh-port", "22"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for heavy in ("torch", "numpy", "horovod", "scipy"):
        assert f"'{heavy}'" not in out.stdout, out.stdout


def test_public_names_resolve_lazily():
    import hvd_adapt
    for name in hvd_adapt.__all__:
        assert getattr(hvd_adapt, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        hvd_adapt.nonexistent


# `obj._name` on anything but self/cls: reading another object's private attribute.
# Three of torch's are allowed: Module.state_dict() keeps `_metadata` on the dict
# it returns, which load_state_dict reads back, so a snapshot copies it; and
# the autograd engine's queue_callback, the end-of-backward callback that DDP
# and FSDP use too and that has no public equivalent. A tensor's `_version`,
# autograd's count of in-place changes (torch's own saved-tensor check), is
# how the optimizer's ledger (optim/ledger.py) sees a gradient changed in place.
_FOREIGN_PRIVATE = re.compile(r"(?<![\w.])(?!self\b|cls\b|hvd_adapt\b)(\w+)\.(_[a-z]\w*)")
_ALLOWED = {"_metadata", "_execution_engine", "_version"}
# torch's multi-tensor operations: what torch.optim itself uses; later
# releases name them torch.foreach and keep these names for compatibility.
_ALLOWED_PREFIXES = {"torch": "_foreach_"}
# The one module that reaches into Horovod's elastic State, checked when imported.
_HOROVOD_INTERNALS = os.path.join("_runtime", "horovod_internals.py")


def sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_no_module_reads_another_objects_private_attributes():
    found = []
    for path in sources():
        if os.path.relpath(path, PACKAGE) == _HOROVOD_INTERNALS:
            continue
        with open(path) as f:
            for number, line in enumerate(f, 1):
                code = line.split("#")[0]
                for match in _FOREIGN_PRIVATE.finditer(code):
                    prefix = _ALLOWED_PREFIXES.get(match.group(1))
                    if match.group(2) not in _ALLOWED and not (
                            prefix and match.group(2).startswith(prefix)):
                        found.append(f"{os.path.relpath(path, PACKAGE)}:{number}: {match.group(0)}")
    assert not found, "\n".join(found)


def test_the_library_prints_nothing_and_sets_up_no_logging_on_import():
    printing = []
    for path in sources():
        with open(path) as f:
            tree = ast.parse(f.read())
        printing += [f"{os.path.relpath(path, PACKAGE)}:{node.lineno}" for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"]
    assert not printing, printing
    code = ("import logging, hvd_adapt\n"
            "for name in hvd_adapt.__all__: getattr(hvd_adapt, name)\n"
            "print(logging.getLogger('hvd_adapt').handlers, logging.getLogger().handlers)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []"


def test_horovods_private_names_are_used_in_one_module_only():
    # The elastic State's attributes and the launcher's names (its middleman's mark, the
    # rendezvous scope of rank_and_size).
    private = re.compile(r"\b(_host_messages|_last_updated_timestamp|_saved_state|_handlers|"
                         r"_bcast_object|_reset_callbacks|HostUpdateResult)\b|"
                         r"multiprocessing-fork|\"rank_and_size\"")
    found = []
    for path in sources():
        if os.path.relpath(path, PACKAGE) == _HOROVOD_INTERNALS:
            continue
        with open(path) as f:
            found += [f"{os.path.relpath(path, PACKAGE)}:{number}" for number, line
                      in enumerate(f, 1) if private.search(line.split("#")[0])]
    assert not found, found


# -- layers point down ---------------------------------------------------------------------
# What each room may import from hvd_adapt (anywhere in a module, at its top or inside a
# function): the plumbing floor (_runtime) knows nothing above it, elastic knows the objects
# it carries through the Participant protocol only, scheduling reaches only the standard-library
# helpers of the floor. A room always may import from itself.
_MAY_IMPORT = {
    "_checks": set(),
    "_runtime": {"_checks"},
    "goodput": {"_runtime"},
    "scheduling": {"_runtime"},
    "elastic": {"_checks", "_runtime"},
    "accumulator": {"_runtime", "elastic"},
    "autoscale": {"_checks", "_runtime", "goodput", "scheduling"},
    "data": {"_checks", "_runtime", "autoscale", "elastic"},
    "swap": {"_runtime"},
    "optim": {"_checks", "_runtime", "autoscale", "elastic", "goodput", "swap"},
}
# The standby preloads every public name while it waits for its slot (so that they do not
# count in the survivors' pause): the one import of the package's root below it.
_IMPORTS_THE_ROOT = {os.path.join("_runtime", "handover.py")}


def _room(relative):
    first = relative.split(os.sep)[0]
    return first[:-3] if first.endswith(".py") else first


def imported_modules(path, top_level_only=False):
    """Every hvd_adapt module ``path`` imports (absolute names), with the line of each; with
    ``top_level_only``, those its import runs (not those inside functions)."""
    relative = os.path.relpath(path, PACKAGE)
    parts = ["hvd_adapt"] + relative[:-3].split(os.sep)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module.split(".")[0] == "hvd_adapt":
                module = node.module
            else:
                continue
            # `from package import module` imports that module too.
            submodules = [f"{module}.{alias.name}" for alias in node.names
                          if os.path.exists(module_path(f"{module}.{alias.name}"))]
            if node.module or not submodules:
                yield module, node.lineno
            for submodule in submodules:
                yield submodule, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hvd_adapt":
                    yield alias.name, node.lineno


def module_path(module):
    parts = module.split(".")[1:]
    path = os.path.join(PACKAGE, *parts)
    return os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"


def standard_library_only(module):
    """Whether importing hvd_adapt ``module`` loads the standard library alone: its top-level
    imports (not those inside functions) are of the standard library, or of such modules."""
    with open(module_path(module)) as f:
        tree = ast.parse(f.read())
    local = {name for name, _ in imported_modules(module_path(module), top_level_only=True)}
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] not in sys.stdlib_module_names | {"hvd_adapt"} for name in names):
            return False
    return all(standard_library_only(name) for name in local if name != "hvd_adapt")


def test_layers_point_down():
    found = []
    for path in sources():
        relative = os.path.relpath(path, PACKAGE)
        room = _room(relative)
        if room == "__init__":
            continue
        allowed = _MAY_IMPORT.get(room, set()) | {room}
        for module, line in imported_modules(path):
            if module == "hvd_adapt":
                if relative not in _IMPORTS_THE_ROOT:
                    found.append(f"{relative}:{line}: imports the package's root")
                continue
            target = module.split(".")[1]
            if target not in allowed:
                found.append(f"{relative}:{line}: {room} imports {module}")
            elif room == "scheduling" and not standard_library_only(module):
                found.append(f"{relative}:{line}: scheduling imports {module}, which imports "
                             "more than the standard library")
    assert not found, "\n".join(found)


def test_every_room_has_a_layer():
    rooms = {_room(os.path.relpath(path, PACKAGE)) for path in sources()} - {"__init__"}
    assert rooms == set(_MAY_IMPORT), rooms ^ set(_MAY_IMPORT)


def test_scheduling_loads_only_the_standard_library():
    names = sorted(f"hvd_adapt.scheduling.{name[:-3]}"
                   for name in os.listdir(os.path.join(PACKAGE, "scheduling"))
                   if name.endswith(".py") and name != "__init__.py")
    loaded = loaded_after("\n".join(f"import {name}" for name in names))
    heavy = [name for name in ("torch", "horovod", "numpy", "scipy", "psutil")
             if f"'{name}'" in loaded]
    assert not heavy, (names, heavy)


def test_the_layout_document_lists_every_module_and_no_other():
    """docs/layout.md has one row per module (package ``__init__`` files aside)."""
    with open(os.path.join(os.path.dirname(PACKAGE), "docs", "layout.md")) as f:
        listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", f.read(), re.MULTILINE))
    modules = {os.path.relpath(path, PACKAGE) for path in sources()
               if os.path.basename(path) != "__init__.py" or os.path.dirname(path) == PACKAGE}
    assert listed == modules, {"not listed": sorted(modules - listed),
                               "listed, not in the tree": sorted(listed - modules)}


# Issue 43: the disk swap in units a reader takes in (it was 2,045 lines in four modules, one
# class of 755 and a function of 143).
SWAP = os.path.join(PACKAGE, "swap")
SWAP_LINES, CLASS_LINES, FUNCTION_LINES = 1200, 300, 60


def test_the_disk_swap_stays_small_in_readable_units():
    total, long = 0, []
    for name in sorted(os.listdir(SWAP)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(SWAP, name)) as f:
            text = f.read()
        total += len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES \
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if limit and lines > limit:
                long.append(f"swap/{name}: {node.name} has {lines} lines (at most {limit})")
    assert total <= SWAP_LINES, f"hvd_adapt/swap/ has {total} lines (at most {SWAP_LINES})"
    assert not long, long


def test_every_package_docstring_names_its_modules():
    """A reader opening a package's ``__init__`` finds each of its modules named there."""
    missing = []
    for package in sorted(os.listdir(PACKAGE)):
        init = os.path.join(PACKAGE, package, "__init__.py")
        if not os.path.exists(init):
            continue
        with open(init) as f:
            docstring = ast.get_docstring(ast.parse(f.read())) or ""
        for name in sorted(os.listdir(os.path.dirname(init))):
            module = name[:-3]
            if name.endswith(".py") and module != "__init__" and f".{module}`" not in docstring:
                missing.append(f"{package}/{name}")
    assert not missing, missing


# Issue 46: tests/ mirrors the packages, and what the tests share is one package of its own.
TESTS = os.path.join(os.path.dirname(PACKAGE), "tests")
BESIDE_THE_PACKAGES = {"support", "distributed", "cluster"}


def test_the_tests_mirror_the_packages():
    packages = {name.lstrip("_") for name in os.listdir(PACKAGE)
                if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))}
    folders = {name for name in os.listdir(TESTS) if os.path.isdir(os.path.join(TESTS, name))
               and not name.startswith(("_", "."))}
    assert folders == packages | BESIDE_THE_PACKAGES, {
        "packages without tests/<package>/": sorted(packages - folders),
        "folders that are no package": sorted(folders - packages - BESIDE_THE_PACKAGES)}
    at_the_top = [name for name in os.listdir(TESTS)
                  if any(name.startswith(f"test_{package}_") for package in packages)]
    assert not at_the_top, f"these belong in tests/<package>/: {at_the_top}"


def test_no_test_module_imports_another():
    imports = []
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            # An unused import kept on purpose is a fixture imported: it belongs in a conftest.py.
            if "noqa: " + "F401" in text:
                imports.append(f"{os.path.relpath(path, TESTS)}: an import kept unused")
            for node in ast.walk(ast.parse(text)):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                imports += [f"{os.path.relpath(path, TESTS)}: {module}" for module in modules
                            if module.split(".")[-1].startswith(("test_", "conftest"))]
    assert not imports, f"shared code goes into tests/support/, fixtures into conftest.py: {imports}"
