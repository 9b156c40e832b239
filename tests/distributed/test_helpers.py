"""ntkgp.distributed in one process: shards, no-op collectives, and validation of ``distributed=``."""

from __future__ import annotations

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp import distributed as d
from ntkgp.laplace.weight_space import compute_curvature
from ntkgp.training import train_marglik
from tests.helpers import mlp, snapshot


@pytest.mark.parametrize("n", [0, 1, 5, 17, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_shards_partition_the_rows_in_order(n, world):
    ranges = [d.shard_range(n, r, world) for r in range(world)]
    assert [i for rows in ranges for i in rows] == list(range(n))
    sizes = [len(rows) for rows in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_shard_returns_this_ranks_rows():
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    xs, ys = d.shard(x, y, rank_=1, world=2)
    assert torch.equal(xs, x[3:]) and torch.equal(ys, y[3:])
    assert torch.equal(d.shard(x), x)  # one process: everything
    with pytest.raises(ValueError, match="same number of rows"):
        d.shard(x, y[:4])
    with pytest.raises(ValueError, match="rank"):
        d.shard_range(4, 2, 2)


def test_collectives_are_no_ops_in_one_process():
    assert not d.is_distributed() and d.world_size() == 1 and d.rank() == 0
    t = torch.arange(3.0)
    assert d.all_reduce_sum([t])[0] is t and torch.equal(t, torch.arange(3.0))
    assert torch.equal(d.all_gather_rows(t), t)
    assert d.all_reduce_max(4) == 4
    d.check_replicated([t], "t")
    with d.together("work"):
        pass
    with pytest.raises(KeyError), d.together("work"):
        raise KeyError("kept")


def test_distributed_true_without_a_process_group_is_rejected_before_anything_happens():
    x, y = torch.randn(8, 2, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    net = mlp(d_in=2, width=3, d_out=1, depth=1)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    before = snapshot(net)
    with pytest.raises(ValueError, match="distributed=True needs an initialized"):
        ntkgp.models.sfr.SFR(net, x, y, lik, num_inducing=3, distributed=True)
    with pytest.raises(ValueError, match="distributed=True needs an initialized"):
        compute_curvature(net, x, y, lik, "kfac", distributed=True)
    with pytest.raises(ValueError, match="distributed=True needs an initialized"):
        train_marglik(net, x, y, lik, epochs=2, progress=False, distributed=True)
    with pytest.raises(TypeError, match="distributed must be True or False"):
        compute_curvature(net, x, y, lik, "kfac", distributed="yes")
    after = snapshot(net)
    assert all(torch.equal(before["state"][k], after["state"][k]) for k in before["state"])
