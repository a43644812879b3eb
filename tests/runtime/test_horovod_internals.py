"""The one module that touches Horovod's private elastic attributes, and its checks."""
import configparser
import os
import queue

import horovod
import horovod.common.elastic as common_elastic
import pytest

import hvd_adapt
from hvd_adapt._runtime import horovod_internals

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_horovod_outside_the_supported_range_is_refused_at_import(monkeypatch):
    monkeypatch.setattr(horovod, "__version__", "0.29.0")
    with pytest.raises(ImportError, match=r"Horovod >=0.28.1,<0.29.*found horovod 0.29.0"):
        horovod_internals._check_import()
    monkeypatch.setattr(horovod, "__version__", "0.28.0")
    with pytest.raises(ImportError, match="found horovod 0.28.0"):
        horovod_internals._check_import()


def test_a_horovod_without_a_method_hvd_adapt_overrides_is_refused(monkeypatch):
    monkeypatch.delattr(common_elastic.State, "on_hosts_updated")
    with pytest.raises(ImportError, match="on_hosts_updated"):
        horovod_internals._check_import()


def test_a_state_without_an_attribute_hvd_adapt_uses_is_refused():
    hvd_adapt.init()
    state = hvd_adapt.State()
    horovod_internals.check_state(state)
    del state._host_messages
    with pytest.raises(RuntimeError, match="_host_messages"):
        horovod_internals.check_state(state)


def test_the_package_requires_the_horovod_range_the_check_accepts():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    assert "horovod>=0.28.1,<0.29" in config["options"]["install_requires"].split()


def test_host_updates_are_all_taken_whatever_their_timestamps():
    # Two changes within one second share a timestamp; Horovod's own check kept
    # only the first. Every message counts, and removals alone say so.
    hvd_adapt.init()
    state = hvd_adapt.State()
    assert horovod_internals.take_host_updates(state) is None
    state.on_hosts_updated(100, 1)                 # removed
    assert horovod_internals.take_host_updates(state) == (True, False)
    state.on_hosts_updated(100, 1)
    state.on_hosts_updated(100, 2)                 # added, same second
    assert horovod_internals.take_host_updates(state) == (True, True)


def test_a_reset_keeps_host_updates_sent_during_it():
    hvd_adapt.init()
    state = hvd_adapt.State()
    kept = []
    state.register_reset_callbacks([lambda: kept.append("callback ran")])
    state.on_hosts_updated(200, 2)
    state.on_reset()
    assert kept == ["callback ran"]
    assert isinstance(state._host_messages, queue.Queue)
    assert horovod_internals.take_host_updates(state) == (False, True)
