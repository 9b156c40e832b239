"""Many classes: the KFAC and diagonal last layers fit (with their evidence) in memory linear in C per example.

A structural check, independent of the machine's allocator: every tensor an aten operation produces during the fit,
the evidence and the GLM covariance is recorded (a ``TorchDispatchMode``), and the largest must stay within the
sizes of the memory formula of docs/laplace (last layer): ``N·C`` (the outputs of the pass), ``C²`` (KFAC's output
factor ``G``), ``C·d_a`` and ``d_a²`` — never an ``(N, C, C)`` stack of per-example Hessians nor a dense
``(C·d_a)²`` matrix, which is what the full last layer needs (checked too, so that the probe is seen to catch it).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ntkgp.laplace.weight_space import (
    LastLayerDiagLaplace,
    LastLayerKFACLaplace,
    LastLayerLaplace,
    PassOptions,
)
from ntkgp.likelihoods import SoftmaxLikelihood

C, F, N, N_TEST = 120, 8, 160, 3
D_A = F + 1  # features and the bias


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an aten operation returns while active."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), f"{func} -> {tuple(t.shape)}"
        return out


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, F), torch.nn.Tanh(), torch.nn.Linear(F, C)).double()
    x, y = torch.randn(N, 5, dtype=torch.float64), torch.randint(0, C, (N,))
    return net, x, y


@pytest.mark.parametrize("cls", [LastLayerKFACLaplace, LastLayerDiagLaplace])
def test_kfac_and_diagonal_last_layers_hold_nothing_quadratic_per_example(problem, cls):
    net, x, y = problem
    linear = max(N * C, C * C, C * D_A, D_A * D_A)  # the memory formula's terms (docs/laplace)
    assert linear * 10 < min(N * C * C, (C * D_A) ** 2)  # the sizes the probe must exclude are far above it
    with LargestTensor() as fit:
        posterior = cls(net, x, y, SoftmaxLikelihood(num_classes=C), prior_precision=1.0,
                        options=PassOptions(batch_size=40, progress=False))
        posterior.log_marginal_likelihood()
    assert fit.numel <= linear, fit.op
    with LargestTensor() as predictive:
        covariance = posterior.glm_covariance(x[:N_TEST])
    assert covariance.shape == (N_TEST, C, C)
    assert predictive.numel <= max(N_TEST * C * C, C * D_A, C * C), predictive.op  # the result's own size


def test_the_probe_sees_the_full_last_layers_dense_matrix(problem):
    """The full last layer is (C·d_a)² by nature: the same probe reports it (the check above can fail)."""
    net, x, y = problem
    small = 12  # classes: a dense (C·d_a)² of 108² numbers
    head = torch.nn.Sequential(*list(net)[:-1], torch.nn.Linear(F, small)).double()
    with LargestTensor() as fit:
        LastLayerLaplace(head, x, y % small, SoftmaxLikelihood(num_classes=small), prior_precision=1.0,
                         options=PassOptions(batch_size=40, progress=False)).log_marginal_likelihood()
    assert fit.numel >= (small * D_A) ** 2, fit.op
