r"""The Monte-Carlo sampled GGN: :math:`S` sampled roots of the likelihood's Hessian per example instead of
:math:`C - 1` exact ones.

For a softmax likelihood the Hessian at the unit output scale is :math:`\tilde\Lambda_n = \operatorname{diag}(p_n) -
p_n p_n^\top`, the covariance of the one-hot vector :math:`e_{\hat y}` of a label drawn from the model's own
predictive :math:`\hat y \sim \operatorname{Cat}(p_n)`:

.. math::
    \tilde\Lambda_n = \mathbb E_{\hat y}\big[(e_{\hat y} - p_n)(e_{\hat y} - p_n)^\top\big], \qquad
    \hat R_n = \tfrac{1}{\sqrt S} \big[e_{\hat y_1} - p_n, \dots, e_{\hat y_S} - p_n\big] \in \mathbb R^{C \times S},

so :math:`\mathbb E[\hat R_n \hat R_n^\top] = \tilde\Lambda_n`. Every curvature formed linearly from
:math:`R_n R_n^\top` — the GGN :math:`\sum_n J_n^\top \Lambda_n J_n`, its diagonal, the KFAC output factor
:math:`G = \sum_n g_n g_n^\top` and with it :math:`A \otimes G` (:math:`A` is formed from the inputs, not
sampled) — is then an unbiased estimate at the cost of :math:`S` backward passes per batch instead of
:math:`C - 1` (laplace-torch's and curvlinops' "MC" GGN/Fisher). What is nonlinear in the estimate — a
log-determinant, a posterior covariance — is consistent (exact as :math:`N S \to \infty`), not unbiased.

Variance, per example and entry: :math:`\operatorname{Var}[(\hat R \hat R^\top)_{ij}] = \tfrac1S
\big(\sum_c p_c (\delta_{ci} - p_i)^2 (\delta_{cj} - p_j)^2 - \tilde\Lambda_{ij}^2\big)`
(:func:`sampled_root_variance`); on the diagonal this is :math:`\tfrac1S\, p_i (1 - p_i)(1 - 2 p_i)^2`, at most
:math:`1/(16 S)`, zero for :math:`p_i \in \{0, \tfrac12, 1\}`. A sum over :math:`N` examples has the sum of their
variances: its relative error falls as :math:`1/\sqrt{N S}`.

Only a softmax likelihood has a Hessian worth sampling: a Gaussian one's is the identity per output (each output has
its own noise, so its columns cannot be mixed), a logistic one's has one column already.
"""

from __future__ import annotations

import math

import torch
from gpytorch.likelihoods import Likelihood, SoftmaxLikelihood
from torch import Tensor


def check_mc_samples(mc_samples: object, likelihood: Likelihood, argument: str = "mc_samples") -> int | None:
    """``mc_samples`` after checking it: ``None`` (the exact GGN) or a positive integer, with a softmax likelihood.

    Raises:
        TypeError: ``mc_samples`` is not an integer or ``None``.
        ValueError: it is not positive, or the likelihood is not a softmax one, naming ``argument``.
    """
    if mc_samples is None:
        return None
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int):
        raise TypeError(f"{argument} must be a positive integer or None (the exact GGN), got {mc_samples!r}")
    if mc_samples < 1:
        raise ValueError(f"{argument} must be a positive integer or None (the exact GGN), got {mc_samples}")
    if not isinstance(likelihood, SoftmaxLikelihood):
        raise ValueError(
            f"{argument} samples a softmax likelihood's Hessian; {type(likelihood).__name__} has an exact root with "
            "as few columns as a sample would have (the identity per output for a Gaussian likelihood, one column "
            f"for a logistic one): pass {argument}=None"
        )
    return mc_samples


def check_no_samples_for_fisher(fisher: bool, mc_samples: object) -> None:
    """Refuse ``mc_samples`` for the empirical Fisher: it samples the roots of the GGN's Hessian, and the EF's
    rows are the gradients themselves (nothing to sample).

    Raises:
        ValueError: ``fisher`` and ``mc_samples`` is not ``None``.
    """
    if fisher and mc_samples is not None:
        raise ValueError("mc_samples samples the GGN's Hessian roots; the empirical Fisher has none: pass None")


def check_generator(generator: object, argument: str = "generator") -> torch.Generator | None:
    """``generator`` after checking that it is a ``torch.Generator`` or ``None``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{argument} must be a torch.Generator or None, got {type(generator).__name__}")
    return generator


def sampled_unit_hessian_root(f: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
    r"""A sampled root :math:`\hat R_n` of a softmax likelihood's unit-scale Hessian (module docstring), shape
    ``(n, C, S)``, without a graph: :math:`\mathbb E[\hat R_n \hat R_n^\top] = \operatorname{diag}(p_n) -
    p_n p_n^\top`, :math:`p_n = \operatorname{softmax}(f_n)`.

    Args:
        f: network outputs ``(n, C)``.
        num_samples: :math:`S`.
        generator: the random numbers' source (its device must be ``f``'s); ``None`` uses torch's global one.
    """
    with torch.no_grad():
        p = torch.softmax(f, dim=-1)
        draws = torch.multinomial(p.double() if p.dtype == torch.float16 else p, num_samples, replacement=True,
                                  generator=generator)  # (n, S)
        one_hot = torch.zeros(*draws.shape, f.shape[-1], dtype=f.dtype, device=f.device)
        one_hot.scatter_(-1, draws.unsqueeze(-1), 1.0)  # (n, S, C)
        return (one_hot - p.unsqueeze(-2)).mT / math.sqrt(num_samples)


def sampled_root_variance(p: Tensor) -> Tensor:
    r"""The variance of one sample's :math:`(e_{\hat y} - p)(e_{\hat y} - p)^\top` entry by entry, ``(..., C, C)``
    for probabilities ``p`` ``(..., C)``: :math:`\sum_c p_c (\delta_{ci} - p_i)^2 (\delta_{cj} - p_j)^2 -
    \tilde\Lambda_{ij}^2` (divide by :math:`S` for :math:`S` samples)."""
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    d = eye - p.unsqueeze(-2)  # (..., c, i): δ_ci − p_i
    fourth = torch.einsum("...c,...ci,...cj->...ij", p, d.square(), d.square())
    hessian = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    return fourth - hessian.square()


__all__ = ["check_generator", "check_mc_samples", "check_no_samples_for_fisher", "sampled_root_variance", "sampled_unit_hessian_root"]
