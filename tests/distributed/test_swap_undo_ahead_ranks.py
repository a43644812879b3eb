"""The undo copies written ahead (hvd_adapt/optim/swap_undo.py) at two ranks, where one
rank finds them valid and the other not, and either one's step fails part way."""
import pytest

from launch import run_ranks

pytestmark = pytest.mark.distributed


def test_ranks_that_disagree_on_their_copies_written_ahead_undo_a_failed_step_alike(tmp_path):
    reports = run_ranks("swap_ahead_ranks.py", np=2, args=[tmp_path]).check().reports
    for rank in (0, 1):
        report = reports[rank]
        for step in report["steps"]:
            label = step["label"]
            assert step["as_in_memory"], (rank, label)
            if "fails" in label:
                assert step["error"] and step["unchanged"], (rank, label, step["error"])
                assert step["ahead"] > 0, (rank, label, "no copies were written ahead")
            else:
                assert step["error"] is None, (rank, label, step["error"])
        assert report["used"] > 0, rank
        assert report["state_as_in_memory"], rank
