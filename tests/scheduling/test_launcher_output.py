"""Reading how a run ended from horovodrun's output: the driver's own sentences (taken from
the installed Horovod's source, so a Horovod that words them otherwise fails here), the
worker that ended a fixed-size run, and the workers' script-end records."""
import io
import os
import re
import threading

import horovod.runner
import pytest

from hvd_adapt._runtime.script_end import format_record
from hvd_adapt.scheduling.launcher_output import LINE_LIMIT, LineSplitter, RunOutput

RUNNER = os.path.dirname(horovod.runner.__file__)


def horovod_source(relative):
    with open(os.path.join(RUNNER, relative)) as f:
        return f.read()


def read(text, token="tok"):
    out = RunOutput(token)
    splitter = LineSplitter(out.read_line)
    splitter.feed(text.encode())
    splitter.close()
    return out


def driver_sentences():
    """What Horovod 0.28's elastic driver logs or raises when it stops a job, formatted as it
    formats them, with the meaning hvd-adapt-run gives each."""
    registration = horovod_source("elastic/registration.py")
    driver = horovod_source("elastic/driver.py")
    templates = re.findall(r"'((?:failure|blacklisted slots) count == \{\} -> stop running)'",
                           registration)
    assert len(templates) == 2, "Horovod's driver words its stops otherwise now"
    reset = re.search(r"'(reset count \{\} has exceeded limit \{\} -> stop running)'",
                      registration).group(1)
    no_hosts = re.search(r"'(No hosts from previous set remaining[^']*)'", driver).group(1)
    activity = re.search(r"check_time_out_for\('([^']*)'\)", driver).group(1)
    timeout = re.search(r"message='(Timed out waiting for \{\{activity\}\}\.)", driver).group(1)
    return [
        (f"ERROR:root:{templates[0].format(2)}", "every worker of the world failed"),
        (f"ERROR:root:{templates[1].format(2)}", "every host of the world is blacklisted"),
        (f"ERROR:root:{reset.format(3, 3)}", "the reset limit"),
        (f"RuntimeError: {no_hosts}", "no host of the last world is left"),
        ("horovod.runner.common.util.timeout.TimeoutException: "
         + timeout.replace("{{activity}}", activity), "fewer slots than --min-np"),
    ]


@pytest.mark.parametrize("sentence,meaning", driver_sentences())
def test_each_way_the_driver_gives_up_is_read(sentence, meaning):
    reason = read(f"[0]<stdout>:step 3\n{sentence}\nTraceback (most recent call last):\n"
                  "Process name: localhost[1]\nExit code: 143\n").driver_gave_up()
    assert reason.startswith(meaning), reason
    # The workers' exits that follow a stop are its consequence, not named as a cause.
    assert "localhost[1]" not in reason


def test_the_cause_wins_over_the_generic_line_said_before_it():
    reason = read("ERROR:root:failed to activate new hosts -> stop running\n"
                  "Traceback (most recent call last):\n"
                  "RuntimeError: No hosts from previous set remaining, unable to broadcast "
                  "state.\n").driver_gave_up()
    assert reason.startswith("no host of the last world is left") and "#3197" in reason


def test_a_fixed_size_run_names_the_worker_whose_exit_ended_it():
    gloo = ("RuntimeError: Horovod detected that one or more processes exited with non-zero "
            "status, thus causing the job to be terminated. The first process to do so was:\n"
            "Process name: 1\nExit code: 137\n")
    assert read(gloo).driver_gave_up() == \
        "a worker's exit ended the run (1 exited first, with 137)"
    mpi = ("mpirun detected that one or more processes exited with non-zero status, thus "
           "causing\nthe job to be terminated. The first process to do so was:\n\n"
           "  Process name: [[4242,1],0]\n  Exit code:    1\n")
    assert read(mpi).driver_gave_up() == \
        "a worker's exit ended the run ([[4242,1],0] exited first, with 1)"
    signalled = ("mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 "
                 "(Killed).\n")
    assert read(signalled).driver_gave_up() == \
        "a worker's exit ended the run (rank 1 on vm exited first, with signal 9)"


def test_a_worker_printing_the_drivers_words_is_not_the_driver():
    assert read("[1]<stderr>:failure count == 2 -> stop running\n"
                "Mon Jan  1 00:00:00 2024[0]<stdout>:Process name: 0\n").driver_gave_up() is None
    # horovodrun's MPI mode: Open MPI's --tag-output, MPICH's -l.
    assert read("[1,0]<stdout>:ERROR:root:failure count == 2 -> stop running\n"
                "[1,1]<stderr>:The first process to do so was:\n"
                "[0] No hosts from previous set remaining, unable to broadcast state.\n"
                ).driver_gave_up() is None
    assert read("horovodrun: error: unrecognized arguments: --bogus\n").driver_gave_up() is None


def test_the_script_ended_only_where_every_rank_of_one_world_says_so():
    def record(rank, size, generation, token="tok"):
        line = format_record(token, rank, size, generation, ValueError(f"bad {rank}"))
        return f"[{rank}]<stderr>:{line}"

    assert read(record(0, 2, 7) + record(1, 2, 7)).script_ended() == \
        (1, "every rank of the world of 2 ended its script at commit 7; rank 0: ValueError: bad 0")
    # One rank of a world (a worker's failure, as Horovod treats it), ranks of two different
    # worlds, another launch's token: the job could go on.
    assert read(record(1, 2, 7)).script_ended() is None
    assert read(record(0, 2, 7) + record(1, 2, 8)).script_ended() is None
    assert read(record(0, 2, 7) + record(1, 2, 7, token="old")).script_ended() is None
    assert read(record(1, 2, 7)).records_said() == "rank 1 of 2: ValueError: bad 1"


def through_horovodrun(rank, worker_bytes):
    """What horovodrun writes for a worker that wrote ``worker_bytes`` to its standard error
    and ended: Horovod's own prefixer (safe_shell_exec.prefix_connection) run on a pipe."""
    from horovod.runner.common.util.safe_shell_exec import prefix_connection
    import multiprocessing
    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    out = io.StringIO()
    thread = threading.Thread(target=prefix_connection,
                              args=(reader, out, "stderr", rank, False))
    thread.start()
    with os.fdopen(os.dup(writer.fileno()), "wb") as f:
        f.write(worker_bytes)
    writer.close()
    thread.join()
    return out.getvalue()


def progress_bar(updates):
    """A tqdm bar on standard error (its default): each update starts with a carriage
    return, and none ends its line."""
    return "".join(f"\r{i % 100:3d}%|{'#' * (i % 10):10s}| {i}/{updates} [00:01<00:09]"
                   for i in range(updates)).encode()


def test_a_progress_bar_hides_neither_the_drivers_words_nor_the_script_end():
    # A bar that ran for a while (far more than LINE_LIMIT without a newline) on every rank,
    # then each rank's script raised its own error: records after the bar.
    bar = progress_bar(4 * LINE_LIMIT // 40)
    ended = "".join(through_horovodrun(rank, bar + format_record(
        "tok", rank, 2, 7, ValueError("bad")).encode() + b"Traceback ...\n")
        for rank in (0, 1))
    assert read(ended).script_ended() == (
        1, "every rank of the world of 2 ended its script at commit 7; rank 0: ValueError: bad")
    # The workers still show their bars (their last update ended by the next's carriage
    # return) when the driver, on the same stream, gives up.
    running = through_horovodrun(0, bar + b"\r") + through_horovodrun(1, bar + b"\r")
    reason = read(running + "ERROR:root:failure count == 2 -> stop running\n").driver_gave_up()
    assert reason is not None and reason.startswith("every worker of the world failed")


def test_lines_are_read_across_chunks_and_long_ones_are_cut():
    lines = []
    splitter = LineSplitter(lines.append)
    for piece in (b"fail", b"ure count\r\n", b"x" * (LINE_LIMIT + 10), b"y" * LINE_LIMIT,
                  b"z\nlast"):
        splitter.feed(piece)
    splitter.close()
    assert lines == ["failure count", "x" * LINE_LIMIT, "last"]
    splitter.feed(b"\xff\xfe broken utf-8\n")
    assert lines[-1] == "\ufffd\ufffd broken utf-8"


def test_the_workers_that_failed_are_counted_for_the_no_worker_rule():
    out = read("Process 1 exit with status code 255.\n[0]<stdout>:Process 0 exit with status "
               "code 9.\nProcess 0 exit with status code 143.\n")
    assert out.workers_failed() == "worker 1: 255, worker 0: 143"
    assert read("hvd-adapt-discover: 2 worker(s) on h2:1\n").workers_failed() is None
