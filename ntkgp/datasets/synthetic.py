r"""Synthetic data: 1-D regression with a gap in the inputs, and scikit-learn's two moons."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from ..validation import float_dtype, integer, non_negative

__all__ = [
    "GAP_REGRESSION_INTERVALS",
    "GAP_REGRESSION_TEST_RANGE",
    "GapRegression",
    "gap_regression",
    "gap_regression_function",
    "two_moons",
]

GAP_REGRESSION_INTERVALS: tuple[tuple[float, float], tuple[float, float]] = ((-1.0, -0.35), (0.35, 1.0))
"""The two intervals the training inputs of :func:`gap_regression` are drawn from; (-0.35, 0.35) is empty."""

GAP_REGRESSION_TEST_RANGE: tuple[float, float] = (-1.5, 1.5)
"""The interval covered by the test grid of :func:`gap_regression`."""


class GapRegression(NamedTuple):
    """Output of :func:`gap_regression`."""

    x_train: Tensor
    """``(n, 1)`` training inputs, sorted, none inside the gap."""
    y_train: Tensor
    """``(n, 1)`` noisy targets :math:`f(x) + \\varepsilon`."""
    x_test: Tensor
    """``(n_test, 1)`` evenly spaced grid over :data:`GAP_REGRESSION_TEST_RANGE`."""
    f_test: Tensor
    """``(n_test, 1)`` noise-free function values on the grid."""
    noise_std: float
    """Standard deviation of the observation noise :math:`\\varepsilon`."""



def gap_regression_function(x: Tensor) -> Tensor:
    r"""The noise-free function of :func:`gap_regression`, :math:`f(x) = \sin(4x)`, elementwise.

    Args:
        x: inputs of any shape.

    Returns:
        :math:`\sin(4x)`, same shape and dtype.

    Example:
        >>> gap_regression_function(torch.zeros(2))
        tensor([0., 0.])
    """
    return torch.sin(4.0 * x)


def gap_regression(
    n: int = 100,
    seed: int = 0,
    noise_std: float = 0.1,
    n_test: int = 300,
    dtype: torch.dtype = torch.float64,
) -> GapRegression:
    r"""1-D regression with a gap in the inputs, for checking "in-between" uncertainty.

    Inputs: ``n // 2`` points uniform on :math:`[-1, -0.35]` and ``n - n // 2`` uniform on
    :math:`[0.35, 1]` (:data:`GAP_REGRESSION_INTERVALS`), sorted. Targets:
    :math:`y = \sin(4x) + \varepsilon`, :math:`\varepsilon \sim \mathcal N(0, \sigma^2)`,
    :math:`\sigma` = ``noise_std``. The test grid has ``n_test`` evenly spaced points on
    :math:`[-1.5, 1.5]`, so it covers the gap and extrapolation on both sides. Sampling uses a private
    ``torch.Generator`` seeded with ``seed`` (the global RNG is left untouched); the values do not
    depend on ``dtype`` beyond rounding.

    Args:
        n: number of training points, at least 2 (one on each side of the gap).
        seed: seed of the private generator.
        noise_std: :math:`\sigma \ge 0`.
        n_test: number of test grid points, at least 1.
        dtype: floating-point dtype of the returned tensors.

    Returns:
        :class:`GapRegression` ``(x_train, y_train, x_test, f_test, noise_std)``.

    Raises:
        ValueError: naming the argument, for ``n < 2``, ``n_test < 1``, a negative, non-finite or non-numeric
            ``noise_std``, a ``seed`` that is not an integer or a ``dtype`` that is not floating point (counts
            and seeds may be numpy integers).

    Example:
        >>> data = gap_regression(n=20, n_test=50)
        >>> data.x_train.shape, data.x_test.shape
        (torch.Size([20, 1]), torch.Size([50, 1]))
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 2:
        raise ValueError(f"n must be an integer >= 2 (one point on each side of the gap); got {n!r}")
    n = int(n)
    n_test = integer(n_test, "n_test", minimum=1)
    noise_std = non_negative(noise_std, "noise_std")
    seed = integer(seed, "seed", minimum=-(2**63), maximum=2**64 - 1)  # torch.Generator.manual_seed's range
    float_dtype(dtype)
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    (left_lo, left_hi), (right_lo, right_hi) = GAP_REGRESSION_INTERVALS
    n_left = n // 2
    left = left_lo + (left_hi - left_lo) * u[:n_left]
    right = right_lo + (right_hi - right_lo) * u[n_left:]
    x = torch.cat([left, right]).sort().values[:, None]
    noise = noise_std * torch.randn(n, 1, generator=generator, dtype=torch.float64)
    y = gap_regression_function(x) + noise
    x_test = torch.linspace(*GAP_REGRESSION_TEST_RANGE, n_test, dtype=torch.float64)[:, None]
    return GapRegression(
        x_train=x.to(dtype),
        y_train=y.to(dtype),
        x_test=x_test.to(dtype),
        f_test=gap_regression_function(x_test).to(dtype),
        noise_std=float(noise_std),
    )


def two_moons(
    n: int = 200, noise: float = 0.1, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """Two interleaving half circles, from ``sklearn.datasets.make_moons``.

    Args:
        n: number of points (half per class, scikit-learn's split), at least 2.
        noise: standard deviation of the Gaussian noise added to the points, ``>= 0``.
        seed: scikit-learn's ``random_state``, in ``0..2**32 - 1``.
        dtype: floating-point dtype of ``x``.

    Returns:
        ``x`` of shape ``(n, 2)`` and labels ``y`` of shape ``(n,)`` in ``{0, 1}``.

    Raises:
        ImportError: without scikit-learn (the ``examples`` extra).
        ValueError: naming the argument, for ``n < 2``, a negative, non-finite or non-numeric ``noise``, a
            ``seed`` outside ``0..2**32 - 1`` or not an integer, or a ``dtype`` that is not floating point
            (counts and seeds may be numpy integers).

    Example:
        >>> x, y = two_moons(n=10, seed=1)
        >>> x.shape, sorted(y.unique().tolist())
        (torch.Size([10, 2]), [0, 1])
    """
    n = integer(n, "n", minimum=2)
    noise = non_negative(noise, "noise")
    seed = integer(seed, "seed", minimum=0, maximum=2**32 - 1)  # scikit-learn's random_state
    float_dtype(dtype)
    try:
        from sklearn.datasets import make_moons
    except ImportError as error:
        raise ImportError(
            "two_moons needs scikit-learn; install it with the examples extra: pip install 'ntkgp[examples]'"
        ) from error
    x, y = make_moons(n_samples=n, noise=noise, random_state=seed)
    return torch.as_tensor(x, dtype=dtype), torch.as_tensor(y, dtype=torch.long)
