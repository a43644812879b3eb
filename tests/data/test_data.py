"""ElasticSampler and AdaptiveDataLoader in one process."""
import collections
import io
import logging
import math

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import hvd_adapt
from hvd_adapt import ElasticSampler, AdaptiveDataLoader
from hvd_adapt.autoscale.controller import MEASURE_EVERY
from hvd_adapt.autoscale.policy import AutoscalePolicy


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


class Indices(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def world_epoch(sampler, local_bsz, num_replicas):
    """Simulate every rank for the rest of an epoch: per-rank lists of index batches."""
    per_rank = [list(sampler.batches(local_bsz, num_replicas, r)) for r in range(num_replicas)]
    assert len({len(b) for b in per_rank}) == 1, "every rank must get the same number of batches"
    return per_rank


def test_permutation_is_deterministic_per_seed_and_epoch():
    a, b = ElasticSampler(range(50), seed=1), ElasticSampler(range(50), seed=1)
    assert np.array_equal(a.permutation(), b.permutation())
    first = a.permutation()
    a.set_epoch(1)
    assert not np.array_equal(first, a.permutation())
    assert sorted(a.permutation()) == list(range(50))
    assert not np.array_equal(first, ElasticSampler(range(50), seed=2).permutation())
    assert list(ElasticSampler(range(5), shuffle=False).permutation()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("num_replicas", range(1, 9))
@pytest.mark.parametrize("n,local_bsz", [(1, 1), (7, 2), (50, 3), (64, 4), (101, 5)])
def test_partition_covers_epoch_once_with_padding_only_at_end(num_replicas, n, local_bsz):
    sampler = ElasticSampler(range(n), seed=0)
    per_rank = world_epoch(sampler, local_bsz, num_replicas)
    counts = collections.Counter()
    num_steps = len(per_rank[0])
    for step in range(num_steps):
        world_count = per_rank[0][step][1]
        step_real = []
        for rank in range(num_replicas):
            indices, count = per_rank[rank][step]
            assert count == world_count
            pad = ElasticSampler.padding(count, num_replicas, rank)
            if step < num_steps - 1:
                assert pad == 0 and len(indices) == local_bsz
            step_real += indices[:len(indices) - pad]
        assert len(step_real) == world_count
        counts.update(step_real)
    assert counts == collections.Counter(range(n))


@pytest.mark.parametrize("position", [0, 1, 13, 29, 30])
@pytest.mark.parametrize("new_replicas", [1, 3, 4])
def test_rest_of_epoch_repartitions_over_a_new_world(position, new_replicas):
    sampler = ElasticSampler(range(30), seed=5)
    perm = sampler.permutation()
    sampler.advance(position)
    rest = [i for r in range(new_replicas) for idx, c in sampler.batches(2, new_replicas, r)
            for i in idx[:len(idx) - ElasticSampler.padding(c, new_replicas, r)]]
    assert sorted(rest) == sorted(perm[position:].tolist())


def test_consumed_samples_are_a_prefix_of_the_permutation():
    sampler = ElasticSampler(range(40), seed=9)
    perm = sampler.permutation()
    per_rank = world_epoch(sampler, 3, 2)
    consumed = []
    for step in range(3):
        consumed += per_rank[0][step][0] + per_rank[1][step][0]
        assert sorted(consumed) == sorted(perm[:len(consumed)].tolist())


def test_state_dict_resumes_exactly():
    sampler = ElasticSampler(range(20), seed=4)
    sampler.set_epoch(3)
    sampler.advance(7)
    other = ElasticSampler(range(20))
    other.load_state_dict(sampler.state_dict())
    assert list(other.batches(2, 2, 1)) == list(sampler.batches(2, 2, 1))
    with pytest.raises(ValueError, match="20 samples"):
        ElasticSampler(range(21)).load_state_dict(sampler.state_dict())


@pytest.mark.parametrize("kwargs,match", [
    (dict(local_bsz=0, num_replicas=1, rank=0), "local_bsz must be an int >= 1, got 0"),
    (dict(local_bsz=1, num_replicas=0, rank=0), "num_replicas must be an int >= 1, got 0"),
    (dict(local_bsz=1, num_replicas=2, rank=2), r"rank must be an int in \[0, 1\], got 2"),
])
def test_sampler_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        list(ElasticSampler(range(5)).batches(**kwargs))


def test_sampler_rejects_empty_dataset_and_bad_seed():
    with pytest.raises(ValueError, match="non-empty"):
        ElasticSampler([])
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        ElasticSampler(range(3), seed=-1)
    with pytest.raises(ValueError, match="count must be an int in"):
        ElasticSampler(range(3)).advance(4)


def test_sampler_as_plain_torch_sampler():
    sampler = ElasticSampler(range(10), shuffle=False)
    assert list(sampler) == list(range(10)) and len(sampler) == 10
    sampler.advance(4)
    assert list(sampler) == list(range(4, 10))


@pytest.mark.parametrize("key", ["sampler", "batch_sampler", "drop_last"])
def test_loader_rejects_custom_sampling(key):
    with pytest.raises(ValueError, match=key):
        AdaptiveDataLoader(Indices(10), batch_size=2, **{key: None})


def test_loader_rejects_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        AdaptiveDataLoader(Indices(10), batch_size=0)


def test_loader_epoch_passes_and_auto_epochs():
    loader = AdaptiveDataLoader(Indices(10), batch_size=4, shuffle=True)
    first = [b.tolist() for b in loader]
    assert [len(b) for b in first] == [4, 4, 2]
    assert sorted(sum(first, [])) == list(range(10))
    assert len(loader) == 3
    second = [b.tolist() for b in loader]
    assert loader.sampler.epoch == 1 and first != second


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_mid_epoch_from_state_dict(num_workers):
    loader = AdaptiveDataLoader(Indices(23), batch_size=5, shuffle=True, num_workers=num_workers)
    it = iter(loader)
    seen = [next(it).tolist(), next(it).tolist()]
    snapshot = loader.state_dict()
    del it
    resumed = AdaptiveDataLoader(Indices(23), batch_size=5, shuffle=True, num_workers=num_workers)
    resumed.load_state_dict(snapshot)
    rest = [b.tolist() for b in resumed]
    assert sorted(sum(seen + rest, [])) == list(range(23))
    assert resumed.sampler.epoch == 0


def test_loader_properties_without_autoscale():
    loader = AdaptiveDataLoader(Indices(10), batch_size=6)
    assert loader.current_local_bsz == 6 and loader.accumulation_steps == 0
    assert loader.current_batch_size == 6 and loader.is_optim_step() and loader.choice is None


def test_loader_passes_dataloader_kwargs():
    loader = AdaptiveDataLoader(Indices(6), batch_size=3, collate_fn=lambda b: sum(b))
    assert sum(loader) == sum(range(6))


@pytest.mark.parametrize("args,match", [
    ((4,), "max_batch_size must be an int >= the loader's batch_size \\(8\\), got 4"),
    ((64, (0, 8)), "lower bound must be an int >= 1 or None, got 0"),
    ((64, (16, 8)), r"lo <= hi, got \(16, 8\)"),
    ((64, (128, None)), "exceeds max_batch_size"),
    ((64, 5), r"pair \(lo, hi\)"),
    ((64, None, "yes"), "gradient_accumulation must be True or False"),
    ((64, None, False, 0), "decide_every must be an int >= 1, got 0"),
])
def test_autoscale_bad_arguments_name_the_value(args, match):
    loader = AdaptiveDataLoader(Indices(10), batch_size=8)
    with pytest.raises(ValueError, match=match):
        loader.autoscale_batch_size(*args)


def test_autoscale_default_respects_bounds_with_accumulation():
    loader = AdaptiveDataLoader(Indices(100), batch_size=32)
    loader.autoscale_batch_size(256, local_bsz_bounds=(4, 8), gradient_accumulation=True)
    assert (loader.current_local_bsz, loader.accumulation_steps) == (8, 3)
    assert loader.current_batch_size == 32
    optim_flags = []
    for _ in loader:
        optim_flags.append(loader.is_optim_step())
    # 100 samples at 8 per step: 13 batches, an optimizer step every 4th and at the end.
    assert optim_flags == [False, False, False, True] * 3 + [True]


def test_progress_line_mentions_batch_sizes():
    loader = AdaptiveDataLoader(Indices(10), batch_size=4)
    line = loader.progress_line()
    assert "bsz=4" in line and "local_bsz=4" in line and "accum=0" in line


def progress_job(features, epochs, batch_size=8, samples=64):
    """A job whose gradients are the features: constant features give noise-free gradients."""
    from torch.utils.data import TensorDataset
    w = torch.nn.Parameter(torch.zeros(features.shape[1]))
    opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD([w], lr=0.0))
    data = TensorDataset(features, torch.arange(samples))
    loader = AdaptiveDataLoader(data, batch_size=batch_size, shuffle=True)
    # lo = 16 forces B = 16 = 2 x B0 from the first step.
    loader.autoscale_batch_size(64, local_bsz_bounds=(16, 16), epochs_by_progress=True)
    state = hvd_adapt.State(optimizer=opt, loader=loader)
    seen = []  # per epoch, the samples of each optimizer step
    for epoch in hvd_adapt.remaining_epochs_until(epochs):
        seen.append([])
        step = []
        for x, idx in loader:
            opt.zero_grad()
            (x @ w).mean().backward()
            opt.step()
            step += idx.tolist()
            if loader.is_optim_step():
                seen[-1].append(step)
                step = []
                state.commit()
    return seen, opt, loader


def test_epochs_by_progress_run_longer_when_large_batches_gain_little():
    # Identical gradients: a batch of 16 is worth one step at 8 (gain 1), so
    # an epoch's progress of 64 / 8 = 8 B0-steps takes 8 steps: two passes.
    seen, opt, loader = progress_job(torch.ones(64, 3), epochs=2)
    for epoch in seen:
        assert len(epoch) in (8, 9), "gain is 1 only once the noise scale has an estimate"
        counts = collections.Counter(i for batch in epoch for i in batch)
        assert set(counts.values()) <= {1, 2, 3} and len(counts) == 64
    assert seen[1] and len(seen[1]) == 8
    assert loader.sampler.pass_index >= 1


def test_epochs_by_progress_are_shorter_when_noise_dominates():
    # Zero-mean noise: a batch of 16 is worth nearly two steps at 8 (gain
    # about 1.9 here), so an epoch of 8 B0-steps takes 5 steps, not 8.
    gen = torch.Generator().manual_seed(0)
    seen, opt, loader = progress_job(torch.randn(64, 50, generator=gen), epochs=4)
    gain = opt.gns.gain(16, 8)
    assert 1.5 < gain < 2.0
    assert all(len(epoch) <= math.ceil(8 / 1.5) for epoch in seen[1:])
    assert opt.gns.progress >= 4 * 8


def test_epochs_by_progress_needs_an_optimizer():
    loader = AdaptiveDataLoader(Indices(10), batch_size=2)
    loader.autoscale_batch_size(8, epochs_by_progress=True)
    with pytest.raises(RuntimeError, match="DistributedOptimizer"):
        next(iter(loader))
    with pytest.raises(ValueError, match="epochs_by_progress must be True or False"):
        loader.autoscale_batch_size(8, epochs_by_progress=1)


def test_decisions_come_every_decide_every_steps_across_short_epochs(caplog):
    # 8 steps per pass and decide_every=10: a per-pass step count never
    # reaches 10, so only a count kept across epochs (each pass's last step
    # included) decides at steps 10, 20, 30. Rank 0 logs every decision (an
    # unchanged one at debug level); what it chooses depends on measured step
    # times, so only when decisions come is checked.
    from torch.utils.data import TensorDataset
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(50))
    opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD([w], lr=0.0))
    loader = AdaptiveDataLoader(TensorDataset(torch.randn(64, 50, generator=gen)), batch_size=8,
                                shuffle=True)
    loader.autoscale_batch_size(128, decide_every=10)
    hvd_adapt.State(optimizer=opt, loader=loader)
    caplog.set_level(logging.DEBUG, logger="hvd_adapt")

    def decisions_logged():
        return sum("batch size" in record.getMessage() for record in caplog.records)

    decided_at, steps = [], 0
    while steps < 40:
        for (x,) in loader:
            decided_at += [steps] * (decisions_logged() - len(decided_at))
            opt.zero_grad()
            (x @ w).mean().backward()
            opt.step()
            steps += loader.is_optim_step()
            if steps == 40:
                break
    assert decided_at == [0, 10, 20, 30], decided_at


def test_autoscaling_rank_loads_scipy_before_training():
    # Loading scipy's BLAS starts a thread that spins for 0.1 s; during
    # training that slowed the steps whose times the next fit reads.
    import subprocess
    import sys
    code = ("import sys, torch, hvd_adapt\nhvd_adapt.init()\n"
            "loader = hvd_adapt.AdaptiveDataLoader(torch.utils.data.TensorDataset(torch.zeros(8)),"
            " batch_size=2)\n"
            "before = 'scipy.optimize' in sys.modules\n"
            "loader.autoscale_batch_size(8)\n"
            "print(before, 'scipy.optimize' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr


class SwitchingPolicy(AutoscalePolicy):
    """Decides (2, 0) before the first batch and (5, 0) at every later decision."""

    def decide(self, profile, grad_params, num_nodes, num_replicas, current, forced):
        return ((2, 0) if forced else (5, 0)), None


def test_len_follows_a_mid_epoch_change_of_batch_size():
    from tqdm import tqdm
    loader = AdaptiveDataLoader(Indices(20), batch_size=2)
    loader.controller.configure(SwitchingPolicy(2, 64, (1, 64), False, decide_every=3))
    assert len(loader) == 10
    bar = tqdm(loader, file=io.StringIO())
    sizes = []
    for batch in bar:
        sizes.append(len(batch))
        bar.total = len(loader)
    # Three batches of 2, then the rest of the 20 samples at 5: 6 batches in all.
    assert sizes == [2, 2, 2, 5, 5, 4]
    assert bar.n == bar.total == len(sizes)
    assert len(loader) == 4  # the next pass, at 5


def test_drop_last_leaves_out_a_short_last_step_on_every_rank():
    sampler = ElasticSampler(range(23), shuffle=False)
    per_rank = [list(sampler.batches(2, 3, rank, drop_last=True)) for rank in range(3)]
    assert [len(batches) for batches in per_rank] == [3, 3, 3]
    assert all(count == 6 for batches in per_rank for _, count in batches)
    assert sampler.num_batches(2, 3, drop_last=True) == 3

    loader = AdaptiveDataLoader(Indices(10), batch_size=4, shuffle=True, drop_last=True)
    assert len(loader) == 2
    first = [b.tolist() for b in loader]
    assert [len(b) for b in first] == [4, 4] and len(set(sum(first, []))) == 8
    assert loader.sampler.remaining == 0
    second = [b.tolist() for b in loader]
    assert loader.sampler.epoch == 1 and [len(b) for b in second] == [4, 4]


def test_iterable_dataset_is_refused_with_what_to_use():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    with pytest.raises(ValueError, match="map-style dataset.*IterableDataset Stream"):
        AdaptiveDataLoader(Stream(), batch_size=2)


def test_loader_iterated_twice_in_an_epoch_makes_two_passes_but_resumes_finished_ones():
    loader = AdaptiveDataLoader(Indices(10), batch_size=4)
    state = hvd_adapt.State(val_loader=loader, snapshot_budget=None)
    passes = []
    for epoch in hvd_adapt.remaining_epochs_until(2):
        for _ in range(2):  # read mid-epoch and at the end
            assert len(loader) == 3
            passes.append(sorted(int(i) for batch in loader for i in batch))
        state.commit()
    assert passes == [list(range(10))] * 4
    # A restore that finds this epoch's pass finished does not repeat it.
    for epoch in hvd_adapt.remaining_epochs_until(3):
        list(loader)
        state.commit()
        state.restore()
        assert list(loader) == []


def split_job(batch_size, measure_noise, samples=40, **autoscale):
    """One pass of a one-replica loop: the sizes of the batches handed out, the samples
    of each optimizer step, and len(loader) as read before the pass and at every batch."""
    from torch.utils.data import TensorDataset
    w = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([w], lr=0.1)
    opt = hvd_adapt.DistributedOptimizer(sgd, measure_noise=measure_noise)
    gen = torch.Generator().manual_seed(0)
    loader = AdaptiveDataLoader(TensorDataset(torch.randn(samples, 3, generator=gen),
                                              torch.arange(samples)), batch_size=batch_size)
    if autoscale:
        loader.autoscale_batch_size(**autoscale)
    hvd_adapt.State(optimizer=opt, loader=loader)
    sizes, steps, lens, step = [], [], [len(loader)], []
    for x, idx in loader:
        lens.append(len(loader))
        opt.zero_grad()
        (x @ w).mean().backward()
        before = w.detach().clone()
        opt.step()
        sizes.append(len(idx))
        step += idx.tolist()
        # The weights move on the last batch of a cycle only.
        assert torch.equal(before, w.detach()) != loader.is_optim_step()
        if loader.is_optim_step():
            steps.append(step)
            step = []
    return sizes, steps, lens, opt, loader


def test_one_replica_measuring_the_noise_splits_one_step_in_four():
    sizes, steps, lens, opt, loader = split_job(8, measure_noise=True)
    # Steps 0 and 4 of the five come as two halves: two gradients of the same
    # weights, which is what the noise is measured on.
    assert sizes == [4, 4, 8, 8, 8, 4, 4]
    assert [len(s) for s in steps] == [8] * 5
    assert sorted(i for s in steps for i in s) == list(range(40))
    assert opt.gns.num_updates == 2
    assert lens == [7] * 8
    # The halves are timed as what they are: steps of 4 samples.
    assert 4 in {key[2] for key in loader.controller.profile.state_dict()}


@pytest.mark.parametrize("batch_size,measure_noise,autoscale", [
    (8, False, {}),
    (8, None, {}),  # measuring by default only while autoscaling
    (3, True, {}),  # halves of one sample: BatchNorm refuses those
    (8, True, dict(max_batch_size=8, local_bsz_bounds=(2, 2), gradient_accumulation=True)),
], ids=["not-measuring", "not-autoscaling", "small-batch", "accumulating"])
def test_steps_are_not_split_without_need(batch_size, measure_noise, autoscale):
    sizes, steps, lens, opt, loader = split_job(batch_size, measure_noise, **autoscale)
    local = loader.current_local_bsz
    assert set(sizes[:-1]) == {local}
    assert lens[0] == len(sizes)
    # Accumulating: one optimizer step in MEASURE_EVERY is measured.
    expected = len(range(0, 40 // 8, MEASURE_EVERY)) if autoscale else 0
    assert opt.gns.num_updates == expected


def test_decisions_publish_the_speed_up_curve(tmp_path, monkeypatch):
    # HVD_ADAPT_HINTS is read when autoscaling is switched on; after each
    # decision rank 0 rewrites the file with the curve from the fitted model.
    from hvd_adapt.scheduling.hints import CURVE_KEYS, read_hints
    path = tmp_path / "hints" / "job.json"
    monkeypatch.setenv("HVD_ADAPT_HINTS", str(path))
    samples = 160
    w = torch.nn.Parameter(torch.zeros(50))
    opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD([w], lr=0.01))
    gen = torch.Generator().manual_seed(0)
    loader = AdaptiveDataLoader(TensorDataset(torch.randn(samples, 50, generator=gen)),
                                batch_size=8)
    loader.autoscale_batch_size(64, decide_every=5, hints_max_replicas=6)
    hvd_adapt.State(optimizer=opt, loader=loader)
    written = []
    for epoch in range(2):
        for (x,) in loader:
            opt.zero_grad()
            (x @ w).pow(2).mean().backward()
            opt.step()
            if path.exists():
                written.append(read_hints(str(path))["written_at"])
    hints = read_hints(str(path))
    assert len(set(written)) >= 2, "the file is rewritten at each decision"
    assert hints["replicas"] == 1 and hints["replica_counts_timed"] == [1]
    assert not hints["timed_two_counts"] and hints["fitted_at"] is not None
    curve = hints["curve"]
    assert [c["replicas"] for c in curve] == [1, 2, 3, 4, 5, 6]
    assert all(set(c) == set(CURVE_KEYS) for c in curve)
    assert curve[0]["speedup"] == 1.0 and all(c["goodput"] > 0 for c in curve)
    for c in curve:
        assert c["batch_size"] == c["replicas"] * c["local_bsz"] * (c["accumulation_steps"] + 1)
        assert c["batch_size"] <= 64


def test_hints_max_replicas_is_checked():
    loader = AdaptiveDataLoader(Indices(10), batch_size=8)
    with pytest.raises(ValueError, match="hints_max_replicas must be an int >= 1, got 0"):
        loader.autoscale_batch_size(64, hints_max_replicas=0)


class IndexAndPid(Dataset):
    """Each sample is its index and the process that loaded it."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import os
        return torch.tensor([float(i), float(os.getpid())])


class AlternatingPolicy(AutoscalePolicy):
    """Switches the local batch between B0 and twice B0 at every decision after the first."""

    def decide(self, profile, grad_params, num_nodes, num_replicas, current, forced):
        if forced:
            return self.default(num_replicas), None
        return (self.init_batch_size * 3 - current[0], 0), (1.0, 1.0)


def test_persistent_workers_stay_across_epochs_and_re_plans():
    # Before, a torch DataLoader was made for every pass and every re-plan, so
    # persistent_workers=True forked its workers again each time (6 PIDs in 3 epochs).
    samples = 160
    loader = AdaptiveDataLoader(IndexAndPid(samples), batch_size=8, shuffle=True,
                                num_workers=2, persistent_workers=True)
    loader.controller.configure(AlternatingPolicy(8, 64, (1, 64), False, decide_every=3))
    pids, local_sizes = set(), set()
    for epoch in range(3):
        seen = []
        for x in loader:
            seen += x[:, 0].long().tolist()
            pids |= set(x[:, 1].long().tolist())
            local_sizes.add(len(x))
        assert sorted(seen) == list(range(samples)), epoch
    assert local_sizes >= {8, 16}, "the batch size changed mid-pass: re-plans happened"
    assert len(pids) == 2, f"worker PIDs over 3 epochs and re-plans: {sorted(pids)}"


@pytest.mark.parametrize("kwargs,match", [
    ({"generator": torch.Generator()}, "does not take generator="),
    ({"persistent_workers": True}, "persistent_workers option needs num_workers > 0"),
    ({"no_such_option": 1}, "no_such_option"),
])
def test_dataloader_options_are_checked_when_the_loader_is_made(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AdaptiveDataLoader(Indices(10), batch_size=2, **kwargs)
