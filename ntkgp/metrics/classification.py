r"""Classification metrics on predictive probabilities: NLPD, accuracy, calibration, Brier score, entropy."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from ..validation import positive_int
from .checks import _class_probs, _labels

__all__ = ["accuracy", "brier_score", "categorical_nlpd", "expected_calibration_error", "predictive_entropy"]


def _clamp(eps: object) -> float:
    """``eps`` of :func:`categorical_nlpd` as a float in ``[0, 1)`` (a real number or a one-element tensor), else
    ``ValueError`` naming it (``nan`` would make every clamped value NaN, ``eps >= 1`` every NLPD zero)."""
    if torch.is_tensor(eps) and eps.numel() == 1 and eps.dtype != torch.bool and not eps.is_complex():
        eps = eps.item()
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < 1:
        raise ValueError(f"eps must be a number in [0, 1), got {eps!r}")
    return float(eps)


def categorical_nlpd(probs: Tensor, y: Tensor, eps: float = 1e-12) -> float:
    r"""Mean negative log predictive probability of the observed class.

    .. math:: \mathrm{NLPD} = -\frac1N \sum_{n=1}^N \log \max(p_{n, y_n}, \epsilon)

    Args:
        probs: ``(N, C)`` class probabilities, or ``(N,)`` / ``(N, 1)`` with :math:`P(y=1)`.
        y: ``(N,)`` integer labels.
        eps: lower clamp on the probabilities, a number in :math:`[0, 1)`, so that a confident wrong prediction
            gives :math:`-\log\epsilon` instead of infinity. The clamp and the logarithm are computed in at least
            float32, so the default ``1e-12`` does not underflow for float16 / bfloat16 ``probs``.

    Returns:
        The mean NLPD.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: for non-finite or out-of-range probabilities, ``(N, C)`` rows that do not sum to one,
            invalid labels or mismatched sizes, or an ``eps`` that is not a number in :math:`[0, 1)`.

    Example:
        >>> round(categorical_nlpd(torch.tensor([[0.5, 0.5], [0.9, 0.1]]), torch.tensor([0, 0])), 4)
        0.3993
    """
    eps = _clamp(eps)
    p = _class_probs(probs)
    y = _labels(y, p.shape[0], p.shape[1])
    p_observed = p.gather(1, y[:, None]).squeeze(1)
    # 1e-12 underflows to 0 in float16 / bfloat16: clamp and take the log in at least float32.
    p_observed = p_observed.to(torch.promote_types(p_observed.dtype, torch.float32))
    return -torch.log(p_observed.clamp_min(eps)).mean().item()


def accuracy(probs: Tensor, y: Tensor) -> float:
    r"""Fraction of examples whose most probable class is the label.

    .. math:: \mathrm{acc} = \frac1N \sum_n \mathbb 1[\arg\max_c p_{nc} = y_n]

    For binary ``probs`` the predicted class is 1 iff :math:`P(y=1) > 1/2`.

    Args:
        probs: ``(N, C)``, or ``(N,)`` / ``(N, 1)`` binary.
        y: ``(N,)`` integer labels.

    Returns:
        The accuracy in :math:`[0, 1]`.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: for non-finite or out-of-range probabilities, ``(N, C)`` rows that do not sum to one,
            invalid labels or mismatched sizes.

    Example:
        >>> accuracy(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([1, 0, 0]))
        0.6666666666666666
    """
    p = _class_probs(probs)
    y = _labels(y, p.shape[0], p.shape[1])
    return (p.argmax(dim=1) == y).double().mean().item()


def expected_calibration_error(probs: Tensor, y: Tensor, num_bins: int = 10) -> float:
    r"""Top-label expected calibration error with equal-width confidence bins.

    With confidence :math:`\hat p_n = \max_c p_{nc}`, prediction :math:`\hat y_n = \arg\max_c p_{nc}`
    and bins :math:`B_b = \{n : b/M < \hat p_n \le (b+1)/M\}`, :math:`b = 0, \dots, M-1`,

    .. math::
        \mathrm{ECE} = \sum_{b} \frac{|B_b|}{N}
            \Big| \frac{1}{|B_b|}\sum_{n \in B_b} \mathbb 1[\hat y_n = y_n]
                - \frac{1}{|B_b|}\sum_{n \in B_b} \hat p_n \Big|

    Empty bins contribute nothing. The confidences are binned in the dtype of ``probs``, against edges
    :math:`b/M` rounded to that dtype, so the same probabilities fall into the same bins whatever their dtype;
    the sums are accumulated in float64.

    Args:
        probs: ``(N, C)``, or ``(N,)`` / ``(N, 1)`` binary.
        y: ``(N,)`` integer labels.
        num_bins: :math:`M`, a positive integer.

    Returns:
        The ECE in :math:`[0, 1]`.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: for an invalid ``num_bins``, non-finite or out-of-range probabilities, ``(N, C)`` rows
            that do not sum to one, invalid labels or mismatched sizes.

    Example:
        >>> expected_calibration_error(torch.tensor([[0.8, 0.2], [0.8, 0.2]]), torch.tensor([0, 1]))
        0.30000001192092896
    """
    num_bins = positive_int(num_bins, "num_bins")
    p = _class_probs(probs)
    y = _labels(y, p.shape[0], p.shape[1])
    confidence, prediction = p.max(dim=1)
    options = {"dtype": torch.float64, "device": confidence.device}
    # Edges b/M computed in float64 and rounded once to the dtype of the confidences, compared in that
    # dtype: casting float32 0.8 to float64 and comparing with the float64 edge 0.8 would move it up a bin.
    inner_edges = (torch.arange(1, num_bins, **options) / num_bins).to(confidence.dtype)
    # right=False puts c in bin b when b/M < c <= (b+1)/M.
    bins = torch.bucketize(confidence, inner_edges, right=False)
    confidence = confidence.double()
    correct = (prediction == y).double()
    conf_sum = torch.zeros(num_bins, **options).index_add_(0, bins, confidence)
    correct_sum = torch.zeros(num_bins, **options).index_add_(0, bins, correct)
    # |B_b|/N * |acc_b - conf_b| = |sum correct - sum confidence| / N
    return ((correct_sum - conf_sum).abs().sum() / confidence.numel()).item()


def brier_score(probs: Tensor, y: Tensor) -> float:
    r"""Multi-class Brier score (Brier, 1950).

    .. math:: \mathrm{BS} = \frac1N \sum_n \sum_{c=1}^C (p_{nc} - \mathbb 1[y_n = c])^2

    Binary ``probs`` are expanded to two classes, so for them the score is
    :math:`\frac2N \sum_n (p_n - y_n)^2`, twice scikit-learn's ``brier_score_loss``.

    Args:
        probs: ``(N, C)``, or ``(N,)`` / ``(N, 1)`` binary.
        y: ``(N,)`` integer labels.

    Returns:
        The score in :math:`[0, 2]`.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: for non-finite or out-of-range probabilities, ``(N, C)`` rows that do not sum to one,
            invalid labels or mismatched sizes.

    Example:
        >>> brier_score(torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
        2.0
    """
    p = _class_probs(probs)
    y = _labels(y, p.shape[0], p.shape[1])
    one_hot = torch.nn.functional.one_hot(y, num_classes=p.shape[1]).to(p.dtype)
    return ((p - one_hot) ** 2).sum(dim=1).mean().item()


def predictive_entropy(probs: Tensor) -> Tensor:
    r"""Entropy of each predictive distribution, in nats.

    .. math:: H_n = -\sum_c p_{nc} \log p_{nc}, \qquad 0 \log 0 = 0

    Args:
        probs: ``(N, C)``, or ``(N,)`` / ``(N, 1)`` binary.

    Returns:
        ``(N,)`` tensor.

    Raises:
        TypeError: if ``probs`` is not a floating-point tensor.
        ValueError: for non-finite or out-of-range probabilities, or ``(N, C)`` rows that do not sum to one.

    Example:
        >>> predictive_entropy(torch.tensor([0.5, 1.0]))  # log 2 and 0
        tensor([0.6931, 0.0000])
    """
    p = _class_probs(probs)
    return 0.0 - torch.special.xlogy(p, p).sum(dim=1)
