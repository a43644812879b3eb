"""The discovery's saved state: a named type whose every field has a default."""
import json

import pytest

from hvd_adapt.scheduling.discovery_state import DiscoveryState, load_state, save_state


def test_a_file_of_an_older_version_takes_the_defaults_of_what_it_lacks(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"hosts": [["a", 2], ["b", 1]], "changed_at": 7}))
    state = load_state(str(path))
    assert state == DiscoveryState(hosts={"a": 2, "b": 1}, changed_at=7)
    assert list(state.hosts) == ["a", "b"]          # the order offered


def test_what_is_saved_is_what_is_loaded(tmp_path):
    path = str(tmp_path / "state.json")
    state = DiscoveryState(hosts={"b": 1, "a": 3}, changed_at=1.5,
                           standbys={"/s/a/1.json": [10, None]}, said=["x"], watch=["a"],
                           unanswered={"a": [1.0, 2]}, ended={"b": 2.0},
                           keepalive_checked=True, grant=[("a", 3), ("b", 1)], generation=4,
                           reports=9)
    save_state(path, state)
    assert load_state(path) == state


@pytest.mark.parametrize("field, value", [
    ("hosts", [["a;id", 1]]), ("hosts", [["a", 0]]), ("changed_at", float("nan")),
    ("standbys", {"f": [1]}), ("said", [1]), ("watch", ["$(id)"]),
    ("unanswered", {"a": [1.0, 0]}), ("ended", {"a": "later"}), ("keepalive_checked", 1),
    ("grant", [["a", 1.5]]), ("generation", -1), ("reports", True)])
def test_a_field_of_the_wrong_kind_makes_the_file_ignored_with_its_name(tmp_path, capsys,
                                                                       field, value):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"hosts": [["a", 1]], field: value}))
    assert load_state(str(path)) == DiscoveryState()
    assert f"ignoring the state file {path}: {field} must be" in capsys.readouterr().err
