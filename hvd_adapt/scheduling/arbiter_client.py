"""A job's side of the arbiter: the grant its discovery reads, the report it writes.

``hvd-adapt-discover --arbiter DIR`` (:mod:`.discover`) calls these at every
run: it offers only hosts of the grant it read (the last one it could read,
where the arbiter's state cannot be read now), and reports what the arbiter
needs to split the pool and to know when a host taken from the job is free
(:mod:`.arbiter_files` has the format). Standard library only.

>>> job_key("digits", None), job_key("digits", "812.5523")
('digits', 'digits.812.5523')
"""
from .arbiter_files import (ArbiterFileError, FORMAT_VERSION, arbiter_folder,
                            process_namespace, read_grant, report_path, write_json)


def job_key(name, driver):
    """The job's key among the arbiter's jobs (its report's file name): its name, and under
    Horovod's driver that driver's :func:`~.sessions.driver_key` (a later run of the same
    job, or two at once, are different jobs)."""
    return name if driver is None else f"{name}.{driver}"


def grant(folder, key, remembered):
    """``(generation, [(host, slots)], problem)``: the job's grant in the arbiter's state,
    or where that cannot be read, ``remembered`` (``(generation, grant)`` the last run read;
    a problem saying why). ``(None, None, problem)`` where nothing was ever read."""
    try:
        generation, hosts = read_grant(arbiter_folder(folder), key)
        return generation, hosts, None
    except FileNotFoundError:
        problem = f"no arbiter has written {folder} yet"
    except (OSError, ArbiterFileError) as e:        # UnsafePathError among OSError
        problem = f"cannot read the arbiter's grants ({e})"
    generation, hosts = remembered
    if hosts is not None:
        problem += f"; keeping the grant of generation {generation}"
    return generation, hosts, problem


def driver_identity(key):
    """What lets an arbiter on the same machine see whether the job's driver still runs:
    its key, this boot's id and this PID namespace (None without a driver)."""
    here = process_namespace()
    return None if key is None or here is None else dict(here, key=key)


def report(args, name, run, generation, curve, timed, settled, offered, commands):
    """The report of this run (``commands``: :func:`~.sessions.commands` of the job's
    driver, None without one)."""
    from .sessions import driver_key
    holding, launching = None, False
    if commands is not None:
        by_host, launching = commands
        holding = sorted({h for h, _ in offered} | set(by_host))
    return {"version": FORMAT_VERSION, "job": name, "run": run, "generation": generation,
            "min_np": args.min_np, "max_np": args.max_np,
            "initial_np": args.initial_np or args.min_np,
            "curve": curve, "timed": timed, "settled": settled,
            "offered": [list(e) for e in offered], "holding": holding,
            "launching": launching, "driver": driver_identity(driver_key())}


def write_report(folder, key, data):
    """Write the report where the arbiter reads it (an OSError is the caller's to say)."""
    write_json(report_path(arbiter_folder(folder), key), data)
