"""What test workers use to hand results back to tests/support/launch.py."""
import json
import os
import sys
import traceback


def report(obj, rank):
    path = os.path.join(os.environ["HVD_ADAPT_TEST_OUT"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def out_path(name):
    return os.path.join(os.environ["HVD_ADAPT_TEST_OUT"], name)


def run_cases(cases, rank):
    """Run each of ``cases`` (name -> function of no arguments) in turn in this process, and
    report after each: its result, or the traceback where it raised, by name. A test reads
    its own case (``JobResult.case``), so a case that fails is named and the others still
    pass; a job that ends early keeps the cases it finished."""
    results = {}
    for name, run in cases.items():
        try:
            results[name] = {"result": run()}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            print(f"case {name!r} failed on rank {rank}:\n{results[name]['error']}",
                  file=sys.stderr, flush=True)
        report({"cases": results, "done": False}, rank)
    report({"cases": results, "done": True}, rank)
