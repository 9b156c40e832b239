r"""Evaluation metrics for regression, classification and out-of-distribution detection.

All functions take torch tensors. Aggregate metrics return a Python ``float``; per-example
quantities (:func:`predictive_entropy`) return a tensor.

Classification metrics accept predictive probabilities in two forms:

* ``(N, C)`` with ``C >= 2``: class probabilities, rows summing to one; labels ``y`` are integers
  in ``0..C-1``, shape ``(N,)`` (``(N, 1)`` is flattened).
* ``(N,)`` or ``(N, 1)``: binary, the entry is :math:`P(y = 1)` and ``y`` takes values in
  ``{0, 1}``. These are expanded to the two-class form :math:`[1 - p, p]`, so a binary model gives
  the same number whichever form it reports.

Every input is checked first: tensors only, finite values, probabilities in :math:`[0, 1]` with ``(N, C)`` rows
summing to one (within :math:`\sqrt\epsilon` of the dtype, at least float32's, 3.5e-4), labels that are whole
numbers in ``0..C-1``, matching shapes (only ``(N,)`` and ``(N, 1)`` are interchangeable; nothing is
transposed, flattened or broadcast). A violation raises ``TypeError`` or ``ValueError`` naming the argument.

Modules: :mod:`.regression` (:func:`gaussian_nlpd`, :func:`rmse`), :mod:`.classification`
(:func:`categorical_nlpd`, :func:`accuracy`, :func:`expected_calibration_error`, :func:`brier_score`,
:func:`predictive_entropy`), :mod:`.ood` (:func:`ood_auroc`) and :mod:`.checks` (the input checks they share).
"""

from .classification import (
    accuracy,
    brier_score,
    categorical_nlpd,
    expected_calibration_error,
    predictive_entropy,
)
from .ood import ood_auroc
from .regression import gaussian_nlpd, rmse

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
