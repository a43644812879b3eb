#!/usr/bin/env bash
# The whole test suite: sets the environment up first (seconds when it is in
# place), then runs pytest with real multi-process Horovod jobs.
#   scripts/test.sh                 # everything (three phases, below)
#   scripts/test.sh tests/swap      # one area: tests/<package>/ mirrors hvd_adapt/<package>/
#   scripts/test.sh -m "not elastic" tests/goodput/test_goodput.py   # pytest arguments pass through
#
# Without arguments the suite runs in three phases:
# 1. every test marked neither `serial` nor `smoke`, HVD_ADAPT_TEST_WORKERS
#    (default 3) files at a time (pytest-xdist, a file's tests together, so a
#    file's shared job or namespace cluster is made once): many wait on
#    processes, rendezvous and signals, and none of them times anything; on 2
#    cores, 3 at a time kept both cores busy (1.99 on average over the phase;
#    measured at 579c495: 1,242 s against 1,408 s 2 at a time);
# 2. the tests marked `serial`, one at a time on an otherwise quiet machine:
#    those whose outcome rests on measured speed or memory (the jobs that grow
#    or stay small by their own throughput, the digits example's batch that
#    grows by its timed steps, a standby's pause, the pool's arbiter, the
#    swap's peak memory);
# 3. the benchmarks' smoke runs (`smoke`), two at a time: they check what the
#    scripts print and time nothing, but they are the heaviest CPU users, so
#    not beside phase 1; alone, one at a time, they kept 1.2 cores busy.
# With arguments, one pytest run as given.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
python=${HVD_ADAPT_VENV:-$root/.venv}/bin/python

run_pytest() {
    set +e
    "$python" -m pytest "$@"
    local status=$?
    set -e
    if [ "$status" -eq 5 ]; then
        echo "test.sh: pytest collected no tests; that is a failure" >&2
        status=1
    fi
    return "$status"
}

if [ "$#" -gt 0 ]; then
    run_pytest "$@"
    exit $?
fi
workers=${HVD_ADAPT_TEST_WORKERS:-3}
case "$workers" in
    ''|*[!0-9]*|0) echo "test.sh: HVD_ADAPT_TEST_WORKERS must be a whole number >= 1, not '$workers'" >&2
                   exit 2 ;;
esac
start=$(date +%s)
parallel=0
run_pytest -n "$workers" --dist loadfile -m "not serial and not smoke" || parallel=$?
middle=$(date +%s)
serial=0
run_pytest -m serial || serial=$?
last=$(date +%s)
smoke=0
run_pytest -n 2 --dist load -m smoke || smoke=$?
end=$(date +%s)
echo "test.sh: parallel phase ($workers at a time) $((middle - start)) s (exit $parallel)," \
     "serial phase $((last - middle)) s (exit $serial)," \
     "benchmark smokes (2 at a time) $((end - last)) s (exit $smoke), $((end - start)) s in all"
[ "$parallel" -eq 0 ] && [ "$serial" -eq 0 ] && [ "$smoke" -eq 0 ]
