"""The one Cholesky (psd_safe_cholesky with a scaled jitter) and the block-diagonal algebra, against dense formulas."""

import warnings

import pytest
import torch
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning

from ntkgp.laplace.function_space.algebra import block_apply, block_sandwich, low_rank_log_det, site_cholesky
from ntkgp import linalg
from ntkgp.linalg import JitterWarning, cholesky, gram


def dense_factor(blocks: torch.Tensor) -> torch.Tensor:
    """The block-diagonal ``(N·C, N·k)`` matrix from blocks ``(N, C, k)``."""
    return torch.block_diag(*blocks)


def test_positive_definite_needs_no_jitter_and_no_warning():
    torch.manual_seed(0)
    a = torch.randn(6, 6, dtype=torch.float64)
    a = a @ a.T + torch.eye(6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        factor = cholesky(a, "A")
    assert torch.allclose(factor, torch.linalg.cholesky(a), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_singular_matrix_gets_a_jitter_relative_to_its_scale(dtype):
    torch.manual_seed(0)
    v = torch.randn(6, 2, dtype=dtype)
    a = 1e6 * (v @ v.T)  # rank 2, scale 1e6: an absolute jitter of 1e-8 would be meaningless
    copy = a.clone()
    with pytest.warns(NumericalWarning, match="the test matrix") as record:
        factor = cholesky(a, "the test matrix")
    assert len(record) == 1
    assert torch.equal(a, copy)
    jitter = (factor.double() @ factor.double().T - a.double()).diagonal()
    scale = a.diagonal().mean().item()
    base = 1e-8 if dtype == torch.float64 else 1e-6
    roundoff = 50 * torch.finfo(dtype).eps * scale
    assert torch.allclose(jitter, jitter.mean().expand(6), rtol=0, atol=roundoff)  # one jitter on the diagonal
    assert base * scale - roundoff <= jitter.mean() <= base * scale * 100 + roundoff  # at most GPyTorch's 3 tries


def test_indefinite_matrix_raises_after_bounded_tries():
    a = torch.diag(torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)
        with pytest.raises(NotPSDError, match="my matrix"):
            cholesky(a, "my matrix")
    nan = torch.full((2, 2), float("nan"), dtype=torch.float64)
    with pytest.raises(NotPSDError, match="NaN"):
        cholesky(nan, "nan matrix")


def test_one_warning_class():
    assert JitterWarning is NumericalWarning


def test_block_algebra_against_dense_matrices():
    torch.manual_seed(1)
    n, c, k = 4, 3, 2
    blocks = torch.randn(n, c, k, dtype=torch.float64)
    big = dense_factor(blocks)
    g = torch.randn(n * c, n * c, dtype=torch.float64)
    gram = g @ g.T
    assert torch.allclose(block_sandwich(blocks, gram), big.T @ gram @ big, atol=1e-12)
    v = torch.randn(n * k, 2, dtype=torch.float64)
    w = torch.randn(n * c, dtype=torch.float64)
    assert torch.allclose(block_apply(blocks, v), big @ v, atol=1e-12)
    assert torch.allclose(block_apply(blocks, w, transpose=True), big.T @ w, atol=1e-12)
    chol = site_cholesky(blocks, gram)
    assert torch.allclose(chol @ chol.T, torch.eye(n * k, dtype=torch.float64) + big.T @ gram @ big, atol=1e-10)


def test_low_rank_log_det_is_the_determinant_lemma():
    torch.manual_seed(2)
    n, c, k, p = 5, 2, 2, 3
    blocks = torch.randn(n, c, k, dtype=torch.float64)
    root = torch.randn(n * c, p, dtype=torch.float64)
    big = dense_factor(blocks)
    reference = torch.linalg.slogdet(torch.eye(n * k, dtype=torch.float64) + big.T @ root @ root.T @ big)[1]
    assert abs(low_rank_log_det(blocks, root) - reference) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p", [3, 7, 11])
def test_gram_from_lower_blocks_equals_the_sum_of_outer_products(monkeypatch, dtype, p):
    """Blocks of 2 columns (several panels, a ragged last block) and a batch dimension: AᵀA against the
    sum over rows of outer products (float64), exactly symmetric, and its gradient against autograd's."""
    monkeypatch.setattr(linalg, "GRAM_BLOCK", 2)
    torch.manual_seed(1)
    a = torch.randn(3, 13, p, dtype=torch.float64)
    reference = torch.einsum("bnp,bnq->bpq", a, a)
    out = gram(a.to(dtype))
    assert out.dtype == dtype and torch.equal(out, out.mT)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    assert ((out.double() - reference).abs().max() / reference.abs().max()) < tol
    weights = torch.randn(p, p, dtype=torch.float64)
    leaf = a.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((gram(leaf) * weights).sum(), leaf)
    assert torch.allclose(grad, a @ (weights + weights.T), rtol=1e-12, atol=1e-12)
