"""``train_marglik`` with inputs (or targets) that require grad (issue 38, item 5): it trains as with plain tensors,
and the user's tensors keep their ``requires_grad``, values and ``.grad``. Before, the MAP epochs ran and the first
hyperparameter round failed with "Trying to backward through the graph a second time" (the batches kept a graph to
``train_x`` that the first backward freed).

The reference is the same training on detached clones of the data: Algorithm 1 differentiates with respect to θ and
the hyperparameters only, so a graph to the inputs must change nothing. Both runs take the same operations on the
same values; 1e-10 relative allows for a different order of summation in a gradient, nothing more.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ntkgp.training import HyperparameterSchedule, train_marglik

SETTINGS = dict(epochs=3, schedule=HyperparameterSchedule(burn_in=1, frequency=1, hyper_steps=2), lr=1e-2,
                progress=False)


def _run(net, likelihood, x, y, loader: bool, structure: str, batch_size):
    net, likelihood = copy.deepcopy(net), copy.deepcopy(likelihood)
    if loader:
        data = DataLoader(TensorDataset(x, y), batch_size=10, shuffle=False)
        result = train_marglik(net, data, None, likelihood, structure=structure, **SETTINGS)
    else:
        result = train_marglik(net, x, y, likelihood, structure=structure, batch_size=batch_size, **SETTINGS)
    return net, likelihood, result


@pytest.mark.parametrize("structure,data", [("full_ggn", "full batch"), ("full_ef", "mini-batches"),
                                            ("full_ggn", "loader"), ("kfac", "loader")])
def test_inputs_that_require_grad_train_as_plain_ones_and_stay_as_they_were(small_regression, structure, data):
    x, y, net, likelihood = small_regression(n=12, width=5)  # N ≤ P: the rounds take function space
    x_graph = x.clone().requires_grad_(True)
    y_graph = y.clone().requires_grad_(True)  # Gaussian targets with a graph, too
    saved = (x_graph.detach().clone(), y_graph.detach().clone())
    loader, batch_size = data == "loader", 7 if data == "mini-batches" else None
    trained, lik, result = _run(net, likelihood, x_graph, y_graph, loader, structure, batch_size)
    ref_net, ref_lik, reference = _run(net, likelihood, x, y, loader, structure, batch_size)

    for got, want in zip(trained.parameters(), ref_net.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result.kernel.prior_precision.detach(), reference.kernel.prior_precision.detach(),
                               rtol=1e-10, atol=0)
    torch.testing.assert_close(lik.noise.detach(), ref_lik.noise.detach(), rtol=1e-10, atol=0)
    assert result.log_evidence == pytest.approx(reference.log_evidence, rel=1e-10)
    for tensor, before in zip((x_graph, y_graph), saved):  # the user's tensors as they were
        assert tensor.requires_grad and tensor.grad is None and torch.equal(tensor.detach(), before)
