"""SFR's dual statistics on a small CNN against a dense autograd computation (float64): joint and independent
outputs, linearized and zero prior mean, the inducing inputs' features kept or (beyond the budget) partly recomputed;
the outputs and offsets come from the same feature pass as the cross-Grams (no forward or JVP of their own)."""

import importlib

import pytest
import torch

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from tests.helpers import rel_err
from tests.ntk.test_cnn_passes import small_fmnist_cnn
from ntkgp.models import SFRMemoryOptions

system_grams = importlib.import_module("ntkgp.models.sfr.system_grams")


def dense_statistics(net, z, x, y, coupling, prior_mean):
    """``(precision, residual)`` as ``DualStatistics`` holds them (one group), from dense Jacobians."""
    theta = {n: p.detach() for n, p in net.named_parameters()}

    def jac(inputs):  # (n, C, P)
        j = torch.func.jacrev(lambda t: torch.func.functional_call(net, t, (inputs,)))(theta)
        return torch.cat([j[n].flatten(2) for n in theta], dim=-1)

    jz, jx = jac(z), jac(x)
    f = net(x).detach()
    flat = torch.cat([t.flatten() for t in theta.values()])
    offset = jx @ flat if prior_mean == "linearized" else f  # f − m
    p = f.softmax(-1)
    grad = torch.nn.functional.one_hot(y, 3).double() - p
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    cross = torch.einsum("mcp,ndp->mcnd", jz, jx)  # K(z_m c, x_n d)
    m, c = z.shape[0], 3
    if coupling == "joint":
        k = cross.reshape(m * c, -1, c)  # (MC, N, C)
        precision = torch.einsum("knc,ncd,lnd->kl", k, lam, k)
        residual = torch.einsum("knc,nc->k", k, torch.einsum("ncd,nd->nc", lam, offset) + grad)
        return precision[None], residual[None, None]
    diag = torch.stack([cross[:, k, :, k] for k in range(c)])  # (C, M, N)
    lam_d = lam.diagonal(dim1=-2, dim2=-1).T  # (C, N)
    precision = torch.einsum("cmn,cn,cln->cml", diag, lam_d, diag)
    residual = torch.einsum("cmn,cn->cm", diag, lam_d * offset.T + grad.T)
    return precision, residual[:, None]


@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("prior_mean", ["linearized", "zero"])
@pytest.mark.parametrize("budget", [None, 4])
def test_cnn_statistics_equal_dense_autograd(coupling, prior_mean, budget, monkeypatch):
    net = small_fmnist_cnn()
    torch.manual_seed(4)
    x, y = torch.randn(17, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (17,))
    if budget is not None:  # the inducing inputs' features of the first chunk kept, the others recomputed
        per_point = system_grams.inducing_feature_bytes(SFR(net, x, y, SoftmaxLikelihood(3).double(),
                                                            num_inducing=2).engine, x[:1])
        monkeypatch.setattr(system_grams, "INDUCING_FEATURE_BYTES", budget * per_point)
    sfr = SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=7, prior_structure="network",
              output_coupling=coupling, prior_mean=prior_mean,
              memory=SFRMemoryOptions(batch_size=6, chunk_size=4))
    precision, residual = dense_statistics(net, sfr.inducing_points, x, y, coupling, prior_mean)
    assert rel_err(sfr.dual_statistics.precision, precision) < 1e-11
    assert rel_err(sfr.dual_statistics.residual, residual) < 1e-11
