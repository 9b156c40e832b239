"""KFAC-reduce (Eschenhagen et al. 2023, ``kfac_approximation="reduce"``) on ``nn.Linear`` applied to sequences:
exact against the dense GGN block (brute-force autograd) for one example when the sequence is averaged right after
the layer, its factors against their formulas written out by hand for N examples, a float32 network against its
float64 copy, and the argument's validation."""

import copy
import math

import pytest
import torch
from torch import nn

from ntkgp.laplace import compute_curvature, PassOptions
from ntkgp.likelihoods import SoftmaxLikelihood
from tests.helpers import dense_laplace, reference_log_prob

C, T = 3, 5


class SequenceNet(nn.Module):
    """Linear → tanh → Linear on each position of ``(N, T, d)``, then the mean over the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.last = nn.Linear(6, C)

    def hidden(self, x):
        return torch.tanh(self.first(x))

    def forward(self, x):
        return self.last(self.hidden(x)).mean(dim=1)


def sequence_net(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return SequenceNet().to(dtype)


def data(n):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, T, 4, dtype=torch.float64, generator=gen), torch.randint(0, C, (n,), generator=gen)


def last_block(net, curvature, likelihood):
    """The dense KFAC matrix restricted to ``last.weight``, ``last.bias`` (the last 6·C + C parameters)."""
    size = net.last.weight.numel() + net.last.bias.numel()
    return curvature.dense(likelihood)[-size:, -size:]


def test_reduce_is_exact_for_one_example_when_the_sequence_is_averaged_after_the_layer():
    """For f = T⁻¹ Σ_t (W h_t + b) the Jacobian is Γ h̄ᵀ with Γ = Σ_t ∂f/∂z_t: with N = 1, G ⊗ A is the GGN block.
    KFAC-expand is not (its A sums h_t h_tᵀ over the positions): the comparison can fail."""
    net = sequence_net()
    x, y = data(1)
    likelihood = SoftmaxLikelihood(num_classes=C)
    log_prob = lambda f, t: reference_log_prob("softmax", f, t)  # noqa: E731
    p = sum(q.numel() for q in net.parameters())
    size = net.last.weight.numel() + net.last.bias.numel()
    exact = (dense_laplace(net, x, y, log_prob, torch.ones(p, dtype=torch.float64))["H"]
             - torch.eye(p, dtype=torch.float64))[-size:, -size:]
    reduced = compute_curvature(net, x, y, likelihood, structure="kfac", kfac_approximation="reduce", progress=False)
    torch.testing.assert_close(last_block(net, reduced, likelihood), exact, rtol=1e-10, atol=1e-12)
    expanded = compute_curvature(net, x, y, likelihood, structure="kfac", progress=False)
    assert (last_block(net, expanded, likelihood) - exact).abs().max() > 1e-3


def reference_factors(net, x):
    """The last layer's reduce factors by hand: A = Σ_n [h̄_n; 1][h̄_n; 1]ᵀ, G = N⁻¹ Σ_n Λ_n (Σ_t ∂f/∂z_t = I)."""
    with torch.no_grad():
        h = net.hidden(x).mean(dim=1)
        p = torch.softmax(net(x), dim=-1)
    a_bar = torch.cat([h, torch.ones(x.shape[0], 1, dtype=h.dtype)], dim=1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return a_bar.T @ a_bar, lam.mean(dim=0), a_bar


def test_reduce_factors_equal_their_formulas_for_many_examples():
    net = sequence_net()
    x, y = data(9)
    likelihood = SoftmaxLikelihood(num_classes=C)
    curvature = compute_curvature(net, x, y, likelihood, structure="kfac", kfac_approximation="reduce",
                                  batch_size=4, progress=False)
    block = next(b for b in curvature.blocks if b.module == "last")
    a_ref, g_ref, _ = reference_factors(net, x)
    torch.testing.assert_close(block.input_factor, a_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(block.output_factors.sum(dim=0), g_ref, rtol=1e-10, atol=1e-12)
    first = next(b for b in curvature.blocks if b.module == "first")
    x_bar = torch.cat([x.mean(dim=1), torch.ones(9, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(first.input_factor, x_bar.T @ x_bar, rtol=1e-10, atol=1e-12)


def test_reduce_on_a_float32_network_agrees_with_its_float64_copy():
    """Each entry of A = Σ_n ā_n ā_nᵀ is rounded by at most k·ε·Σ_n |ā_n||ā_n|ᵀ, k = 2L + 2 + log2(N T) (L = 2
    layers forward and back, the mean over T, the sum over N); G = N⁻¹ Σ_n Λ_n likewise with the softmax rounded
    once more: bounds from the float64 reference's absolute values."""
    net64 = sequence_net()
    net32 = copy.deepcopy(net64).float()
    x, y = data(9)
    likelihood = SoftmaxLikelihood(num_classes=C)
    blocks = [next(b for b in compute_curvature(net, xx, y, likelihood, structure="kfac", kfac_approximation="reduce",
                                                progress=False).blocks if b.module == "last")
              for net, xx in ((net64, x), (net32, x.float()))]
    _, _, a_bar = reference_factors(net64, x)
    k = 2 * 2 + 2 + math.log2(9 * T)
    eps = torch.finfo(torch.float32).eps
    bound_a = k * eps * a_bar.abs().T @ a_bar.abs()
    assert ((blocks[1].input_factor.double() - blocks[0].input_factor).abs() <= bound_a).all()
    g64, g32 = blocks[0].output_factors.sum(dim=0), blocks[1].output_factors.sum(dim=0).double()
    assert ((g32 - g64).abs() <= (k + 2) * eps * g64.abs().max()).all()


def test_kfac_approximation_is_validated():
    net = sequence_net()
    x, y = data(2)
    likelihood = SoftmaxLikelihood(num_classes=C)
    with pytest.raises(ValueError, match="kfac_approximation"):
        compute_curvature(net, x, y, likelihood, structure="kfac", kfac_approximation="mean", progress=False)
    with pytest.raises(ValueError, match="kfac_approximation"):
        compute_curvature(net, x, y, likelihood, structure="diag_ggn", kfac_approximation="reduce", progress=False)


def test_the_kfac_posterior_takes_the_reduce_approximation():
    from ntkgp.laplace import laplace_posterior

    net = sequence_net()
    x, y = data(6)
    likelihood = SoftmaxLikelihood(num_classes=C)
    posterior = laplace_posterior(net, x, y, likelihood, structure="kfac", kfac_approximation="reduce",
                                  options=PassOptions(progress=False))
    a_ref, g_ref, _ = reference_factors(net, x)
    block = next(b.factors for b in posterior.blocks if b.layer.name == "last")
    torch.testing.assert_close(block.input_factor, a_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(block.output_factors.sum(dim=0), g_ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="kfac_approximation"):
        laplace_posterior(net, x, y, likelihood, structure="kfac", kfac_approximation="sum", options=PassOptions(progress=False))
