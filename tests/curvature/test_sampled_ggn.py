"""The Monte-Carlo sampled GGN (``mc_samples``): its root's distribution, its variance formula, and the unbiasedness of
the KFAC, diagonal and full GGN built from it, each against the exact GGN of the same network (dense formulas)."""

import pytest
import torch

from ntkgp.laplace import compute_curvature, PassOptions
from ntkgp.laplace.ggn.sampled_ggn import sampled_root_variance, sampled_unit_hessian_root
from ntkgp.likelihoods import SoftmaxLikelihood
from tests.helpers import EPS32


def test_the_sampled_root_is_unbiased_by_enumeration_of_its_labels():
    """Each column is (e_ŷ − p)/√S with ŷ ~ Cat(p): its label frequencies match p, and averaging the outer product
    over the C possible labels weighted by p (an enumeration, not a sample) gives diag(p) − p pᵀ exactly."""
    torch.manual_seed(0)
    f = torch.randn(4, 5, dtype=torch.float64)
    p = torch.softmax(f, dim=-1)
    gen = torch.Generator().manual_seed(3)
    root = sampled_unit_hessian_root(f, 20000, gen)  # (4, 5, S)
    assert root.shape == (4, 5, 20000)
    labels = (root * 20000**0.5 + p.unsqueeze(-1)).round()  # one-hot columns
    assert torch.all(labels.sum(dim=1) == 1)
    frequency = labels.mean(dim=-1)
    # a frequency of S draws has standard deviation sqrt(p(1-p)/S) <= 0.0036: 5 of them
    assert (frequency - p).abs().max() < 5 * (p * (1 - p) / 20000).sqrt().max()
    eye = torch.eye(5, dtype=torch.float64)
    expectation = sum(p[:, c, None, None] * torch.einsum("ni,nj->nij", eye[c] - p, eye[c] - p) for c in range(5))
    torch.testing.assert_close(expectation, torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2))


def test_the_variance_formula_matches_the_enumerated_variance_and_its_closed_diagonal():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(3, 4, dtype=torch.float64), dim=-1)
    eye = torch.eye(4, dtype=torch.float64)
    outer = [torch.einsum("ni,nj->nij", eye[c] - p, eye[c] - p) for c in range(4)]
    mean = sum(p[:, c, None, None] * outer[c] for c in range(4))
    second = sum(p[:, c, None, None] * outer[c].square() for c in range(4))
    torch.testing.assert_close(sampled_root_variance(p), second - mean.square())
    diagonal = p * (1 - p) * (1 - 2 * p).square()
    torch.testing.assert_close(sampled_root_variance(p).diagonal(dim1=-2, dim2=-1), diagonal)


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn", "full_ggn"])
def test_the_sampled_curvature_is_an_unbiased_estimate_of_the_exact_one(structure):
    """The curvature is linear in R Rᵀ, so one with S samples per example is the mean of S independent one-sample
    curvatures: with S samples it is within 5 standard errors of the exact curvature, entry by entry, the standard
    error σ₁/√S measured from ten one-sample curvatures (σ₁ their spread). KFAC runs one backward pass per
    sample (its cost model), so it gets fewer."""
    many_samples = 300 if structure == "kfac" else 4000
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4)).double()
    x, y = torch.randn(20, 3, dtype=torch.float64), torch.randint(0, 4, (20,))
    likelihood = SoftmaxLikelihood(num_classes=4)
    exact = compute_curvature(net, x, y, likelihood, structure=structure, progress=False).dense(likelihood)
    gen = torch.Generator().manual_seed(7)

    def sampled(s):
        return compute_curvature(net, x, y, likelihood, structure=structure, mc_samples=s, generator=gen,
                                 progress=False).dense(likelihood)

    singles = torch.stack([sampled(1) for _ in range(10)])
    assert not torch.allclose(singles[0], exact)  # one draw is an estimate, not the exact curvature
    error = singles.std(0) / many_samples**0.5
    many = sampled(many_samples)
    assert torch.all((many - exact).abs() <= 5 * error + 1e-12 * exact.abs().max())
    # the error falls as 1/√S: about 0.06 (S = 300) or 0.016 (S = 4000) of one draw's
    assert (many - exact).abs().max() < 0.3 * (singles - exact).abs().amax(dim=(1, 2)).mean()


def test_mc_samples_is_refused_where_it_has_no_meaning():
    net = torch.nn.Sequential(torch.nn.Linear(2, 3))
    x = torch.randn(5, 2)
    likelihood = SoftmaxLikelihood(num_classes=3)
    y = torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="mc_samples"):
        compute_curvature(net, x, y, likelihood, structure="diag_ef", mc_samples=2)
    with pytest.raises(ValueError, match="mc_samples"):
        compute_curvature(net, x, y, likelihood, structure="kfac", mc_samples=0)
    with pytest.raises(TypeError, match="mc_samples"):
        compute_curvature(net, x, y, likelihood, structure="kfac", mc_samples=1.5)
    with pytest.raises(TypeError, match="generator"):
        compute_curvature(net, x, y, likelihood, structure="kfac", mc_samples=1, generator=3)
    import gpytorch
    with pytest.raises(ValueError, match="mc_samples=None"):
        compute_curvature(torch.nn.Linear(2, 1), x, torch.randn(5), gpytorch.likelihoods.GaussianLikelihood(),
                          structure="kfac", mc_samples=1)


def test_a_float32_sampled_curvature_matches_its_float64_copy_for_the_same_draws():
    """The same generator seed draws the same labels in both precisions (the probabilities differ by float32
    rounding, far from any label boundary here): the curvatures agree to float32 accuracy."""
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    x, y = torch.randn(30, 3), torch.randint(0, 4, (30,))
    likelihood = SoftmaxLikelihood(num_classes=4)
    low = compute_curvature(net, x, y, likelihood, structure="kfac", mc_samples=2,
                            generator=torch.Generator().manual_seed(5), progress=False).dense(likelihood)
    high = compute_curvature(net.double(), x.double(), y, likelihood, structure="kfac", mc_samples=2,
                             generator=torch.Generator().manual_seed(5), progress=False).dense(likelihood)
    # each entry is a sum over N = 30 examples of products of a few O(1) float32 factors: a sequential sum's
    # rounding is at most γ_N ≈ N·ε of the sum of magnitudes, and each product adds a few ε: 4·N·ε of the largest
    # entry bounds it (|H| entries are sums of like-signed squares on the diagonal, which set the scale)
    torch.testing.assert_close(low.double(), high, rtol=0, atol=4 * 30 * EPS32 * high.abs().max().item())


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn"])
def test_a_posterior_takes_mc_samples_from_the_front_door(structure):
    """laplace_posterior(..., mc_samples=S): the posterior's precision is the sampled GGN's plus the prior, close to
    the exact posterior's for many samples (error 5σ₁/√S, σ₁ the spread of one-sample precisions)."""
    from ntkgp.laplace import laplace_posterior

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)).double()
    x, y = torch.randn(15, 3, dtype=torch.float64), torch.randint(0, 4, (15,))
    likelihood = SoftmaxLikelihood(num_classes=4)
    exact = laplace_posterior(net, x, y, likelihood, structure=structure, options=PassOptions(progress=False)).dense_precision()
    gen = torch.Generator().manual_seed(11)
    ones = torch.stack([laplace_posterior(net, x, y, likelihood, structure=structure, mc_samples=1, generator=gen,
                                          options=PassOptions(progress=False)).dense_precision() for _ in range(8)])
    samples = 200 if structure == "kfac" else 2000
    many = laplace_posterior(net, x, y, likelihood, structure=structure, mc_samples=samples, generator=gen,
                             options=PassOptions(progress=False)).dense_precision()
    assert torch.all((many - exact).abs() <= 5 * ones.std(0) / samples**0.5 + 1e-12 * exact.abs().max())
    with pytest.raises(ValueError, match="mc_samples"):
        laplace_posterior(net, x, y, likelihood, structure="diag_ef", mc_samples=1)
