"""Problems solved both by one process on all the data and by each rank on its shard (tests/distributed).

Every function ``name(rank, world)`` returns plain tensors; ``rank=None`` means one process on all the data.
"""

from __future__ import annotations

import copy

import gpytorch
import torch
from torch.utils.data import DataLoader, TensorDataset

from ntkgp.laplace.weight_space import compute_curvature
from ntkgp.distributed import all_reduce_sum, shard
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from ntkgp.training import HyperparameterSchedule, train_marglik
from tests.helpers import mlp
from ntkgp.models import SFRInducingOptions, SFRMemoryOptions


def _data(n: int, d: int, seed: int, classes: int | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if classes is None:
        y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def _part(rank, world, *tensors):
    return tensors if rank is None else shard(*tensors, rank_=rank, world=world)


def sfr_results(rank, world):
    """SFR: softmax with joint coupling (random Z, loader input) and Gaussian with independent outputs (greedy Z)."""
    distributed = rank is not None
    out = {}
    # softmax, C = 3, per-layer δ, joint coupling, inducing inputs chosen from the data, a DataLoader per shard
    x, y = _data(41, 2, seed=1, classes=3)
    x_new, y_new = _data(13, 2, seed=2, classes=3)
    x_test, _ = _data(5, 2, seed=3, classes=3)
    net = mlp(d_in=2, width=6, d_out=3, depth=2, seed=4)
    xs, ys = _part(rank, world, x, y)
    loader = DataLoader(TensorDataset(xs, ys), batch_size=7)
    lik = SoftmaxLikelihood(num_classes=3).double()
    sfr = SFR(net, loader, None, lik, num_inducing=9, prior_precision=torch.tensor([1.0, 2.0, 0.5]),
              output_coupling="joint", memory=SFRMemoryOptions(batch_size=5), distributed=distributed)
    out["joint"] = _sfr_summary(sfr, x_test)
    sfr.update(*_part(rank, world, x_new, y_new), iterate=False)
    out["joint_updated"] = _sfr_summary(sfr, x_test)
    # Gaussian regression, C = 1, independent outputs, greedy-variance inducing inputs from a small pool
    x, y = _data(37, 3, seed=5)
    net = mlp(d_in=3, width=5, d_out=1, depth=1, seed=6)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = 0.05
    sfr = SFR(net, *_part(rank, world, x, y), lik, num_inducing=6,
              inducing=SFRInducingOptions(inducing_method="greedy_variance", pool_size=20),
              output_coupling="independent", distributed=distributed)
    out["greedy"] = _sfr_summary(sfr, x_test[:, :1].expand(-1, 3) * torch.tensor([1.0, -0.5, 2.0]))
    return out


def _sfr_summary(sfr, x_test):
    stats = sfr.dual_statistics
    with torch.no_grad():
        post = sfr(x_test)
        evidence = sfr.log_marginal_likelihood()
    return {
        "Z": sfr.inducing_points.clone(), "num_data": int(stats.num_data),
        "precision": stats.precision.clone(), "residual": stats.residual.clone(), "trace": stats.trace.clone(),
        "fit": stats.fit.clone(), "log_lik": stats.log_lik.clone(),
        "mean": post.mean.clone(), "covariance": post.covariance_matrix.clone(), "evidence": evidence.clone(),
    }


def curvature_results(rank, world):
    """KFAC (softmax, loader input), diagonal GGN and EF (Gaussian, per-output noise), with their evidences."""
    distributed = rank is not None
    out = {}
    x, y = _data(30, 3, seed=7, classes=4)
    net = mlp(d_in=3, width=5, d_out=4, depth=2, seed=8)
    lik = SoftmaxLikelihood(num_classes=4).double()
    xs, ys = _part(rank, world, x, y)
    delta = torch.tensor([0.7, 1.3, 2.0], dtype=torch.float64)
    for structure, data in (("kfac", (DataLoader(TensorDataset(xs, ys), batch_size=4), None)),
                            ("diag_ggn", (xs, ys)), ("diag_ef", (xs, ys))):
        curv = compute_curvature(net, *data, lik, structure=structure, batch_size=6, distributed=distributed)
        out[f"softmax_{structure}"] = _curvature_summary(curv, delta, lik)
    x, y = _data(26, 2, seed=9)
    y = torch.stack([y, 0.5 * y], -1)
    net = mlp(d_in=2, width=4, d_out=2, depth=1, seed=10)
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, has_global_noise=False).double()
    lik.task_noises = torch.tensor([0.1, 0.3])
    for structure in ("kfac", "diag_ggn", "diag_ef"):
        curv = compute_curvature(net, *_part(rank, world, x, y), lik, structure=structure, batch_size=5,
                                 distributed=distributed)
        out[f"gaussian_{structure}"] = _curvature_summary(curv, delta[:2], lik)
    return out


def _curvature_summary(curv, delta, lik):
    return {"dense": curv.dense(lik).clone(), "evidence": curv.log_marginal_likelihood(delta, lik).detach().clone(),
            "num_data": curv.num_data, "f": curv.f.clone()}


def marglik_results(rank, world):
    """Algorithm 1, full batch: the full GGN (weight space) on regression, KFAC on softmax; and mini-batches."""
    distributed = rank is not None
    out = {}
    settings = dict(epochs=6, lr=1e-2,
                    schedule=HyperparameterSchedule(burn_in=2, frequency=2, hyper_steps=5, hyper_lr=0.1),
                    progress=False)
    x, y = _data(31, 2, seed=11)
    for structure in ("full_ggn", "full_ef"):
        net = mlp(d_in=2, width=5, d_out=1, depth=1, seed=12)
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        result = train_marglik(net, *_part(rank, world, x, y), lik, structure=structure, distributed=distributed,
                               **settings)
        out[structure] = _marglik_summary(result, lik)
    x, y = _data(27, 2, seed=13, classes=3)
    net = mlp(d_in=2, width=4, d_out=3, depth=1, seed=14)
    lik = SoftmaxLikelihood(num_classes=3).double()
    result = train_marglik(net, *_part(rank, world, x, y), lik, structure="kfac", distributed=distributed,
                           prior_precision=0.5, **settings)
    out["kfac"] = _marglik_summary(result, lik)
    if distributed:  # mini-batches of 5 per rank on 16 + 15 rows: 4 and 3 batches, the ranks take 4 steps
        x, y = _data(31, 2, seed=15)
        net = mlp(d_in=2, width=5, d_out=1, depth=1, seed=16)
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        result = train_marglik(net, *_part(rank, world, x, y), lik, structure="diag_ggn", batch_size=5,
                               distributed=distributed, **settings)
        out["minibatch"] = _marglik_summary(result, lik)
    return out


def _marglik_summary(result, lik):
    return {
        "weights": torch.cat([p.detach().reshape(-1) for p in result.net.parameters()]),
        "prior_precision": result.prior_precision.clone(),
        "noise": torch.cat([p.detach().reshape(-1) for p in lik.parameters()]),
        "history": torch.tensor([h["log_evidence"] for h in result.history]),
        "train_loss": torch.tensor(result.train_loss),
        "best_epoch": result.best_epoch,
    }


def _message(call):
    try:
        call()
    except Exception as error:  # the test checks which error each rank saw
        return f"{type(error).__name__}: {error}"
    return "no error"


def failures(rank, world):
    """Bad data or different weights on one rank: every rank raises (none waits forever), the group survives."""
    out = {}
    x, y = _data(20, 2, seed=17, classes=3)
    xs, ys = shard(x, y, rank_=rank, world=world)
    bad = xs.clone()
    if rank == 1:
        bad[2, 0] = float("nan")
    net = mlp(d_in=2, width=4, d_out=3, depth=1, seed=18)
    lik = SoftmaxLikelihood(num_classes=3).double()
    loader = DataLoader(TensorDataset(bad, ys), batch_size=3)
    out["curvature_nan"] = _message(lambda: compute_curvature(net, loader, None, lik, "diag_ggn", distributed=True))
    out["sfr_nan"] = _message(lambda: SFR(net, bad, ys, lik, num_inducing=4, distributed=True))
    sfr = SFR(net, xs, ys, lik, num_inducing=4, distributed=True)
    out["update_nan"] = _message(lambda: sfr.update(bad, ys))
    out["update_iterate"] = _message(lambda: sfr.update(xs, ys, iterate=True))
    out["update_count"] = sfr.num_data  # unchanged by the failed update
    other = mlp(d_in=2, width=4, d_out=3, depth=1, seed=18 + rank)
    out["sfr_weights"] = _message(lambda: SFR(other, xs, ys, lik, num_inducing=4, distributed=True))
    out["kfac_weights"] = _message(lambda: compute_curvature(other, xs, ys, lik, "kfac", distributed=True))
    # the same weights in another dtype, or inducing inputs of another shape, on one rank: refused on every rank
    # before any collective of mismatched sizes (which would abort the process)
    cast = copy.deepcopy(net).float() if rank == 1 else net
    out["sfr_dtype"] = _message(lambda: SFR(cast, xs, ys, lik, num_inducing=4, distributed=True))
    out["kfac_dtype"] = _message(lambda: compute_curvature(cast, xs, ys, lik, "kfac", distributed=True))
    out["marglik_dtype"] = _message(lambda: train_marglik(copy.deepcopy(cast), xs, ys, lik, epochs=1, progress=False,
                                                          distributed=True))
    z = x[:5] if rank == 1 else x[:4]
    out["sfr_z_shape"] = _message(lambda: SFR(net, xs, ys, lik, inducing_points=z, distributed=True))
    # float32 targets on one rank (accepted in one process): the evidence of the union, on every rank
    xr, yr = _data(20, 2, seed=19)
    reg = mlp(d_in=2, width=4, d_out=1, depth=1, seed=20)
    gauss = gpytorch.likelihoods.GaussianLikelihood().double()
    xrs, yrs = shard(xr, yr, rank_=rank, world=world)
    yrs = yrs.float() if rank == 1 else yrs
    mixed = compute_curvature(reg, xrs, yrs, gauss, "kfac", distributed=True)
    union = compute_curvature(reg, xr, yr, gauss, "kfac")
    out["mixed_target_dtype"] = (mixed.log_marginal_likelihood(1.0, gauss).item(),
                                 union.log_marginal_likelihood(1.0, gauss).item())
    one = torch.ones(1)
    all_reduce_sum(one)
    out["after"] = one.item()
    return out


def everything(rank, world):
    return {"sfr": sfr_results(rank, world), "curvature": curvature_results(rank, world),
            "marglik": marglik_results(rank, world), "failures": failures(rank, world)}
