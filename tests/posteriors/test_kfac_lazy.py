"""The KFAC factors are eigendecomposed at their first use, not in the fit: the posterior's and the evidence's
results after that first use against the explicit Kronecker products (explicit inverse and ``slogdet``, float64,
1e-10), a new prior precision without a new decomposition, and a network changed before the first use refused."""

from __future__ import annotations

import pytest
import torch

from ntkgp.laplace.weight_space import KFACLaplace, compute_curvature
from tests.posteriors.reference import DTYPE, check_against, close, kronecker_precision
from tests.posteriors.test_structured_laplace import cnn_case
from ntkgp.laplace import PassOptions


@pytest.fixture
def eigh_calls(monkeypatch):
    """The shapes of the matrices ``torch.linalg.eigh`` decomposes (linear_operator's ``_symeig`` calls it)."""
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a, *args, **kw: calls.append(tuple(a.shape)) or eigh(a, *args, **kw))
    return calls


def test_kfac_posterior_decomposes_at_its_first_use_and_not_again_for_a_new_delta(eigh_calls):
    net, lik, _, x, y, x_test = cnn_case()
    delta = torch.tensor([0.5, 2.0, 1.3], dtype=DTYPE)  # conv, bn, head
    posterior = KFACLaplace(net, x, y, lik, prior_precision=delta, options=PassOptions(batch_size=3))
    assert eigh_calls == []  # the fit: factors only
    curvature = compute_curvature(net, x, y, lik, structure="kfac")
    check_against(posterior, net, x_test, kronecker_precision(net, curvature, lik, delta))
    first = list(eigh_calls)
    sizes = sorted(s for b in posterior.blocks for s in (b.input_factor.shape, b.output_factors.shape[1:]))
    assert sorted(first) == sizes  # each factor once (A and G of each block)
    new = torch.tensor([3.0, 0.2, 0.9], dtype=DTYPE)
    posterior.prior_precision = new
    check_against(posterior, net, x_test, kronecker_precision(net, curvature, lik, new))
    assert eigh_calls == first  # a new δ reuses the decompositions


def test_kfac_evidence_decomposes_at_its_first_use(eigh_calls):
    net, lik, _, x, y, _ = cnn_case()
    curvature = compute_curvature(net, x, y, lik, structure="kfac")
    assert eigh_calls == []
    for delta in (torch.tensor([0.5, 2.0, 1.3], dtype=DTYPE), torch.tensor([4.0, 0.3, 0.7], dtype=DTYPE)):
        expected = torch.linalg.slogdet(kronecker_precision(net, curvature, lik, delta))[1]
        close(curvature.log_det(delta, lik), expected)
        spectrum_eigenvalues, groups, _ = curvature.diagonal_spectrum()
        close(torch.log(spectrum_eigenvalues * curvature.scale(lik) + delta[groups]).sum(), expected)
    assert len(eigh_calls) == 2 * len(curvature.blocks)  # once per factor, for both δ


def test_a_network_changed_between_the_fit_and_the_first_use_is_refused(eigh_calls):
    net, lik, _, x, y, x_test = cnn_case()
    posterior = KFACLaplace(net, x, y, lik, prior_precision=0.8)
    curvature = compute_curvature(net, x, y, lik, structure="kfac")
    with torch.no_grad():
        net.conv.weight.mul_(2.0)
    for call in (lambda: posterior.glm_covariance(x_test), lambda: posterior.log_det_precision(),
                 lambda: posterior.sample(2)):
        with pytest.raises(RuntimeError, match="weights changed"):
            call()
    assert eigh_calls == []  # refused before anything was decomposed
    with torch.no_grad():
        net.conv.weight.div_(2.0)
    precision = kronecker_precision(net, curvature, lik, torch.full((3,), 0.8, dtype=DTYPE))
    check_against(posterior, net, x_test, precision)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_factors_decomposition_is_linear_operators_bit_for_bit(dtype):
    """``symmetric_eigh`` (the factors' eigh without linear_operator's operators) against linear_operator's own
    ``_symeig`` of a dense operator: the same eigenvalues (chopped at 0) and eigenvectors, in its symeig dtype
    (double by default, and under its ``linalg_dtypes`` setting)."""
    from linear_operator import settings
    from linear_operator.operators import DenseLinearOperator

    from ntkgp.laplace.weight_space.kfac.blocks import symmetric_eigh

    torch.manual_seed(0)
    root = torch.randn(7, 5, dtype=dtype)
    matrix = root @ root.T  # rank 5: two eigenvalues round to about zero, some negative
    for context in (settings.linalg_dtypes(), settings.linalg_dtypes(symeig=torch.float32)):
        with context:
            values, vectors = symmetric_eigh(matrix)
            ref_values, ref_vectors = DenseLinearOperator(matrix)._symeig(eigenvectors=True)
        assert values.dtype == vectors.dtype == dtype and (values >= 0).all()
        assert torch.equal(values, ref_values) and torch.equal(vectors, ref_vectors.to_dense())
