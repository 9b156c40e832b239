r"""Evaluation metrics for regression, classification and out-of-distribution detection.

All functions take torch tensors. Aggregate metrics return a Python ``float``; per-example
quantities (:func:`predictive_entropy`) return a tensor.

Classification metrics accept predictive probabilities in two forms:

* ``(N, C)`` with ``C >= 2``: class probabilities, rows summing to one; labels ``y`` are integers
  in ``0..C-1``, shape ``(N,)`` (``(N, 1)`` is flattened).
* ``(N,)`` or ``(N, 1)``: binary, the entry is :math:`P(y = 1)` and ``y`` takes values in
  ``{0, 1}``. These are expanded to the two-class form :math:`[1 - p, p]`, so a binary model gives
  the same number whichever form it reports.

Every input is checked first: tensors only, finite values, probabilities in :math:`[0, 1]`, labels that are
whole numbers in ``0..C-1``, matching shapes (only ``(N,)`` and ``(N, 1)`` are interchangeable; nothing is
transposed, flattened or broadcast). A violation raises ``TypeError`` or ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = [
    "accuracy",
    "brier_score",
    "categorical_nlpd",
    "expected_calibration_error",
    "gaussian_nlpd",
    "ood_auroc",
    "predictive_entropy",
    "rmse",
]


def _finite(value: object, name: str) -> Tensor:
    """Check that ``value`` is a non-empty tensor of finite numbers; return it."""
    if not torch.is_tensor(value):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() == 0:
        raise ValueError(f"{name} is empty")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        count = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} contains {count} NaN or infinite value(s)")
    return value


def _is_column(shape: torch.Size) -> bool:
    """Whether ``shape`` is ``(N,)`` or ``(N, 1)``."""
    return len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)


def _match_shape(y: Tensor, reference: Tensor, name: str) -> Tensor:
    """Return ``y`` in ``reference.shape``; only ``(N,)`` and ``(N, 1)`` are interchangeable.

    Any other difference (a transposed ``(C, N)``, a flattened ``(N·C,)``, a broadcastable shape) raises
    ``ValueError`` naming ``name``, even when the numbers of entries agree.
    """
    if y.shape == reference.shape:
        return y
    if _is_column(y.shape) and _is_column(reference.shape) and y.shape[0] == reference.shape[0]:
        return y.reshape(reference.shape)
    raise ValueError(f"{name} has shape {tuple(y.shape)}, incompatible with {tuple(reference.shape)} "
                     "(only (N,) and (N, 1) are interchangeable)")


def _outputs(value: Tensor, name: str) -> Tensor:
    """Check that ``value`` has shape ``(N,)`` or ``(N, C)``; return it."""
    if value.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape (N,) or (N, C), got {tuple(value.shape)}")
    return value


def _class_probs(probs: Tensor) -> Tensor:
    """Return probabilities in ``(N, C)`` form; binary ``(N,)`` / ``(N, 1)`` becomes ``[1 - p, p]``."""
    _finite(probs, "probs")
    if not probs.is_floating_point():
        raise TypeError(f"probs must be floating point, got {probs.dtype}")
    if bool(((probs < -_PROB_TOLERANCE) | (probs > 1 + _PROB_TOLERANCE)).any()):
        raise ValueError("probs must lie in [0, 1] (pass probabilities, not logits)")
    probs = probs.clamp(0.0, 1.0)
    if probs.dim() == 1 or (probs.dim() == 2 and probs.shape[1] == 1):
        p1 = probs.reshape(-1)
        return torch.stack([1.0 - p1, p1], dim=-1)
    if probs.dim() == 2:
        return probs
    raise ValueError(f"probs must have shape (N,), (N, 1) or (N, C); got {tuple(probs.shape)}")


def _labels(y: Tensor, num_examples: int, num_classes: int) -> Tensor:
    """Return integer labels of shape ``(N,)`` (from ``(N,)`` or ``(N, 1)``), whole numbers in ``0..num_classes-1``."""
    _finite(y, "y")
    if not _is_column(y.shape):
        raise ValueError(f"y must have shape (N,) or (N, 1), got {tuple(y.shape)}")
    y = y.reshape(-1)
    if y.numel() != num_examples:
        raise ValueError(f"y has {y.numel()} entries but probs has {num_examples} rows")
    if y.is_complex() or (y.is_floating_point() and not bool((y == torch.round(y)).all())):
        raise ValueError("y must hold integer class labels")
    if bool(((y < 0) | (y >= num_classes)).any()):
        raise ValueError(f"y must hold class labels in 0..{num_classes - 1}, found {torch.unique(y).tolist()[:5]}")
    return y.long()


_PROB_TOLERANCE = 1e-6


def gaussian_nlpd(mean: Tensor, var: Tensor, y: Tensor, y_scale: float | Tensor = 1.0) -> float:
    r"""Mean negative log predictive density of independent Gaussian predictives.

    .. math::
        \mathrm{NLPD} = \frac{1}{N} \sum_{n=1}^N \sum_{c=1}^C
            \Big[\tfrac12 \log(2\pi \sigma^2_{nc}) + \frac{(y_{nc} - \mu_{nc})^2}{2\sigma^2_{nc}}
            + \log s_c\Big]

    Args:
        mean: predictive means :math:`\mu`, shape ``(N,)`` or ``(N, C)``.
        var: predictive variances :math:`\sigma^2` of ``y`` (observation noise included), the same shape as
            ``mean`` (``(N,)`` and ``(N, 1)`` are interchangeable).
        y: targets, the same shape as ``mean`` (``(N,)`` and ``(N, 1)`` are interchangeable).
        y_scale: :math:`s`, the standard deviation used to normalise the targets, a positive real scalar or a
            ``(C,)`` tensor (:math:`C = 1` for ``(N,)`` inputs).
            When ``mean``, ``var`` and ``y`` are in normalised units,
            :math:`y_\text{orig} = s\,y + m`, the result is the NLPD in the original units.

    Returns:
        The NLPD per example (summed over the ``C`` outputs, averaged over the ``N`` examples).

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: naming the argument, for non-finite values, a non-positive ``var`` or ``y_scale``, a
            ``y_scale`` that is not a scalar or ``(C,)``, or a ``var`` or ``y`` whose shape differs from
            ``mean``'s.

    Example:
        >>> round(gaussian_nlpd(torch.zeros(2), torch.ones(2), torch.zeros(2)), 6)  # ½ log 2π
        0.918939
    """
    mean = _outputs(_finite(mean, "mean"), "mean")
    y = _match_shape(_finite(y, "y"), mean, "y")
    var = _match_shape(_finite(var, "var"), mean, "var")
    if (var <= 0).any():
        raise ValueError("var must be strictly positive")
    num_outputs = mean.shape[1] if mean.dim() == 2 else 1
    if isinstance(y_scale, bool):
        raise TypeError("y_scale must be a real number or a tensor, got bool")
    scale = torch.as_tensor(y_scale)
    if scale.dim() > 1 or (scale.dim() == 1 and scale.shape[0] != num_outputs):
        raise ValueError(f"y_scale must be a scalar or have shape ({num_outputs},) (one per output), "
                         f"got shape {tuple(scale.shape)}")
    if scale.dtype == torch.bool or scale.is_complex() or not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"y_scale must be positive and finite, got {y_scale!r}")
    per_entry = 0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean) ** 2 / var
    scale = scale.to(dtype=per_entry.dtype, device=per_entry.device)
    per_entry = per_entry + torch.log(scale if per_entry.dim() == 2 else scale.reshape(()))
    if per_entry.dim() == 2:
        per_entry = per_entry.sum(dim=-1)
    return per_entry.mean().item()


def categorical_nlpd(probs: Tensor, y: Tensor, eps: float = 1e-12) -> float:
    r"""Mean negative log predictive probability of the observed class.

    .. math:: \mathrm{NLPD} = -\frac1N \sum_{n=1}^N \log \max(p_{n, y_n}, \epsilon)

    Args:
        probs: ``(N, C)`` class probabilities, or ``(N,)`` / ``(N, 1)`` with :math:`P(y=1)`.
        y: ``(N,)`` integer labels.
        eps: lower clamp on the probabilities, so that a confident wrong prediction gives
            :math:`-\log\epsilon` instead of infinity. The clamp and the logarithm are computed in at least
            float32, so the default ``1e-12`` does not underflow for float16 / bfloat16 ``probs``.

    Returns:
        The mean NLPD.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: for non-finite or out-of-range probabilities, invalid labels or mismatched sizes.

    Example:
        >>> round(categorical_nlpd(torch.tensor([[0.5, 0.5], [0.9, 0.1]]), torch.tensor([0, 0])), 4)
        0.3993
    """
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
        ValueError: for non-finite or out-of-range probabilities, invalid labels or mismatched sizes.

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
        ValueError: for an invalid ``num_bins``, non-finite or out-of-range probabilities, invalid labels
            or mismatched sizes.

    Example:
        >>> expected_calibration_error(torch.tensor([[0.8, 0.2], [0.8, 0.2]]), torch.tensor([0, 1]))
        0.30000001192092896
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, numbers.Integral) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")
    num_bins = int(num_bins)
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
        ValueError: for non-finite or out-of-range probabilities, invalid labels or mismatched sizes.

    Example:
        >>> brier_score(torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
        2.0
    """
    p = _class_probs(probs)
    y = _labels(y, p.shape[0], p.shape[1])
    one_hot = torch.nn.functional.one_hot(y, num_classes=p.shape[1]).to(p.dtype)
    return ((p - one_hot) ** 2).sum(dim=1).mean().item()


def rmse(pred: Tensor, y: Tensor) -> float:
    r"""Root mean squared error over all entries.

    .. math:: \mathrm{RMSE} = \Big(\frac{1}{NC} \sum_{n,c} (\hat y_{nc} - y_{nc})^2\Big)^{1/2}

    Args:
        pred: predictions, ``(N,)`` or ``(N, C)``.
        y: targets, the same shape as ``pred`` (``(N,)`` and ``(N, 1)`` are interchangeable).

    Returns:
        The RMSE.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: naming the argument, for non-finite values, or a ``y`` whose shape differs from ``pred``'s.

    Example:
        >>> rmse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        1.4142135381698608
    """
    pred = _outputs(_finite(pred, "pred"), "pred")
    y = _match_shape(_finite(y, "y"), pred, "y")
    return torch.sqrt(((pred - y) ** 2).mean()).item()


def predictive_entropy(probs: Tensor) -> Tensor:
    r"""Entropy of each predictive distribution, in nats.

    .. math:: H_n = -\sum_c p_{nc} \log p_{nc}, \qquad 0 \log 0 = 0

    Args:
        probs: ``(N, C)``, or ``(N,)`` / ``(N, 1)`` binary.

    Returns:
        ``(N,)`` tensor.

    Raises:
        TypeError: if ``probs`` is not a floating-point tensor.
        ValueError: for non-finite or out-of-range probabilities.

    Example:
        >>> predictive_entropy(torch.tensor([0.5, 1.0]))  # log 2 and 0
        tensor([0.6931, 0.0000])
    """
    p = _class_probs(probs)
    return 0.0 - torch.special.xlogy(p, p).sum(dim=1)


def ood_auroc(scores_in: Tensor, scores_out: Tensor) -> float:
    r"""Area under the ROC curve for separating out-of-distribution from in-distribution inputs.

    Scores must be larger for inputs judged more likely out of distribution (e.g.
    :func:`predictive_entropy`; pass the negated maximum probability for a confidence score).
    The AUROC is the Mann–Whitney statistic

    .. math::
        \mathrm{AUROC} = P(s_\text{out} > s_\text{in}) + \tfrac12 P(s_\text{out} = s_\text{in})
            = \frac{R_\text{out} - N_\text{out}(N_\text{out}+1)/2}{N_\text{in} N_\text{out}},

    where :math:`R_\text{out}` is the sum of the ranks of the out-of-distribution scores in the
    pooled sample, tied scores sharing their average rank. Cost: one sort, :math:`O(N \log N)`.

    Args:
        scores_in: ``(N_in,)`` scores of in-distribution inputs.
        scores_out: ``(N_out,)`` scores of out-of-distribution inputs.

    Returns:
        The AUROC in :math:`[0, 1]`.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: naming the argument, for an empty or non-finite input.

    Example:
        >>> ood_auroc(torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.2]))
        0.875
    """
    if not torch.is_tensor(scores_in) or not torch.is_tensor(scores_out):
        name = "scores_in" if not torch.is_tensor(scores_in) else "scores_out"
        raise TypeError(f"{name} must be a torch.Tensor")
    if scores_in.numel() == 0 or scores_out.numel() == 0:
        raise ValueError("both scores_in and scores_out must be non-empty")
    scores_in = _finite(scores_in, "scores_in").reshape(-1).double()
    scores_out = _finite(scores_out, "scores_out").reshape(-1).double()
    n_in, n_out = scores_in.numel(), scores_out.numel()
    pooled = torch.cat([scores_in, scores_out])
    _, inverse, counts = torch.unique(pooled, sorted=True, return_inverse=True, return_counts=True)
    counts = counts.double()
    last_rank = counts.cumsum(0)
    average_rank = last_rank - (counts - 1) / 2
    rank_sum_out = average_rank[inverse[n_in:]].sum()
    u_statistic = rank_sum_out - n_out * (n_out + 1) / 2
    return (u_statistic / (n_in * n_out)).item()
