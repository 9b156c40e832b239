r"""Context distributions: where FSVI compares the variational and the prior distribution over functions.

At every training step a fresh set of ``K`` context points :math:`X_C` is drawn and the function-space KL is
evaluated there (docs/fsvi.md, "Context distributions"). Every distribution here has one method,
``sample(num_points, generator=None, batch_x=None)``, returning ``(num_points, ...)`` inputs; random numbers
are drawn on the CPU from ``generator`` (so a seed gives the same points on every device) and the points are
returned on the device of the data the distribution was built from.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..validation import positive_int, real_number


def _check_data(x: object, argument: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(f"{argument} must have shape (N, ...) with N >= 1 and a feature dimension, got {tuple(x.shape)}")
    if x.is_complex():  # floating point, or integer token ids
        raise TypeError(f"{argument} must be a real tensor, got {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{argument} contains NaN or Inf values")
    return x


def _indices(high: int, num: int, generator: torch.Generator | None, replacement: bool) -> Tensor:
    if replacement:
        return torch.randint(high, (num,), generator=generator)
    return torch.randperm(high, generator=generator)[:num]


class ContextDistribution(ABC):
    """A distribution over sets of context inputs."""

    @abstractmethod
    def sample(
        self, num_points: int, generator: torch.Generator | None = None, batch_x: Tensor | None = None
    ) -> Tensor:
        """``num_points`` context inputs ``(num_points, ...)``.

        Args:
            num_points: ``K``.
            generator: CPU random number generator.
            batch_x: the current mini-batch inputs (used only by :class:`BatchMixedContext`).
        """


class UniformBoxContext(ContextDistribution):
    r"""Uniform in a box, independently per input feature: :math:`x_d \sim U(l_d, u_d)`.

    The paper's choice for regression, with the box of the training inputs (:meth:`from_data`).

    Args:
        lower: lower bounds, one per feature (any shape: one input's shape).
        upper: upper bounds, same shape, ``upper >= lower``.

    Raises:
        ValueError: shapes differ, bounds are not finite, or ``upper < lower`` somewhere.
    """

    def __init__(self, lower: Tensor, upper: Tensor) -> None:
        lower, upper = torch.as_tensor(lower), torch.as_tensor(upper)
        if lower.shape != upper.shape:
            raise ValueError(f"lower and upper must have the same shape, got {tuple(lower.shape)} and {tuple(upper.shape)}")
        if not (torch.isfinite(lower).all() and torch.isfinite(upper).all()):
            raise ValueError("lower and upper must be finite")
        if (upper < lower).any():
            raise ValueError("upper must be >= lower in every feature")
        self.lower, self.upper = lower, upper

    @classmethod
    def from_data(cls, x: Tensor, margin: float = 0.0) -> UniformBoxContext:
        r"""The box of the inputs ``x`` ``(N, ...)``, widened by ``margin`` times its width on each side."""
        x = _check_data(x, "x")
        margin = real_number(margin, "margin")
        lower, upper = x.min(0).values, x.max(0).values
        width = upper - lower
        return cls(lower - margin * width, upper + margin * width)

    def sample(
        self, num_points: int, generator: torch.Generator | None = None, batch_x: Tensor | None = None
    ) -> Tensor:
        num_points = positive_int(num_points, "num_points")
        u = torch.rand((num_points, *self.lower.shape), generator=generator, dtype=torch.float64)
        u = u.to(dtype=self.lower.dtype if self.lower.is_floating_point() else torch.get_default_dtype(),
                 device=self.lower.device)
        return self.lower + (self.upper - self.lower) * u


class MonochromeContext(ContextDistribution):
    r"""Random monochrome images built from the training pixels (the paper's context for images).

    A sample is an image whose every channel :math:`c` is constant over its pixels, with a value drawn uniformly
    from the pixels of channel :math:`c` in the training images (each channel independently).

    Args:
        pixels: ``(channels, M)`` pixel values per channel.
        image_shape: the shape of one image ``(channels, H, W, ...)``, channel first; a shape without channel
            axis (``pixels`` with one row) is also accepted.
        output_shape: the shape samples are returned in (default ``image_shape``; e.g. flat ``(H·W,)``).

    Raises:
        ValueError: shapes that do not fit together.
    """

    def __init__(self, pixels: Tensor, image_shape: Sequence[int], output_shape: Sequence[int] | None = None) -> None:
        pixels = torch.as_tensor(pixels)
        image_shape = tuple(int(s) for s in image_shape)
        output_shape = image_shape if output_shape is None else tuple(int(s) for s in output_shape)
        if pixels.dim() != 2 or pixels.shape[1] == 0:
            raise ValueError(f"pixels must have shape (channels, M) with M >= 1, got {tuple(pixels.shape)}")
        channels = image_shape[0] if len(image_shape) >= 3 else 1
        if len(image_shape) < 2 or pixels.shape[0] != channels:
            raise ValueError(
                f"image_shape must be (channels, H, W, ...) with channels = {pixels.shape[0]} (pixels' rows) or "
                f"(H, W) for one channel, got {image_shape}"
            )
        if math.prod(output_shape) != math.prod(image_shape):
            raise ValueError(f"output_shape {output_shape} does not hold an image of shape {image_shape}")
        self.pixels, self.image_shape, self.output_shape = pixels, image_shape, output_shape

    @classmethod
    def from_data(
        cls,
        x: Tensor,
        image_shape: Sequence[int] | None = None,
        max_pixels: int = 2**20,
        generator: torch.Generator | None = None,
    ) -> MonochromeContext:
        """Pixel pools from training images ``x`` ``(N, *image_shape)`` or flat ``(N, prod(image_shape))``.

        Args:
            x: the training inputs.
            image_shape: one image's shape, channel first (default ``x.shape[1:]``).
            max_pixels: keep a uniform random subset of at most this many pixels per channel (memory bound).
            generator: for that subset.
        """
        x = _check_data(x, "x")
        image_shape = tuple(x.shape[1:]) if image_shape is None else tuple(int(s) for s in image_shape)
        if math.prod(image_shape) != math.prod(x.shape[1:]):
            raise ValueError(f"x of shape {tuple(x.shape)} does not hold images of shape {image_shape}")
        max_pixels = positive_int(max_pixels, "max_pixels")
        images = x.reshape(x.shape[0], *image_shape)
        channels = image_shape[0] if len(image_shape) >= 3 else 1
        pixels = images.reshape(x.shape[0], channels, -1).transpose(0, 1).reshape(channels, -1)
        if pixels.shape[1] > max_pixels:
            pixels = pixels[:, _indices(pixels.shape[1], max_pixels, generator, False).to(pixels.device)]
        return cls(pixels.clone(), image_shape, tuple(x.shape[1:]))

    def sample(
        self, num_points: int, generator: torch.Generator | None = None, batch_x: Tensor | None = None
    ) -> Tensor:
        num_points = positive_int(num_points, "num_points")
        channels, m = self.pixels.shape
        idx = torch.randint(m, (num_points, channels), generator=generator).to(self.pixels.device)
        values = self.pixels.gather(1, idx.T).T  # (K, channels)
        spatial = self.image_shape[1:] if len(self.image_shape) >= 3 else self.image_shape
        images = values.reshape(num_points, channels, *([1] * len(spatial))).expand(num_points, channels, *spatial)
        return images.reshape(num_points, *self.output_shape).clone()


class DatasetContext(ContextDistribution):
    """Random rows of a given data set (e.g. unlabeled inputs from a related task), without replacement when
    ``num_points`` does not exceed its size.

    Args:
        data: ``(M, ...)`` inputs.
    """

    def __init__(self, data: Tensor) -> None:
        self.data = _check_data(data, "data")

    def sample(
        self, num_points: int, generator: torch.Generator | None = None, batch_x: Tensor | None = None
    ) -> Tensor:
        num_points = positive_int(num_points, "num_points")
        idx = _indices(self.data.shape[0], num_points, generator, num_points > self.data.shape[0])
        return self.data[idx.to(self.data.device)]


class SamplerContext(ContextDistribution):
    """Context points from a user function ``sampler(num_points, generator) -> (num_points, ...)`` tensor.

    Raises:
        TypeError: ``sampler`` is not callable (at construction) or returns something else than a tensor.
        ValueError: it returns the wrong number of points.
    """

    def __init__(self, sampler: Callable[[int, torch.Generator | None], Tensor]) -> None:
        if not callable(sampler):
            raise TypeError(f"sampler must be callable, got {type(sampler).__name__}")
        self.sampler = sampler

    def sample(
        self, num_points: int, generator: torch.Generator | None = None, batch_x: Tensor | None = None
    ) -> Tensor:
        num_points = positive_int(num_points, "num_points")
        points = self.sampler(num_points, generator)
        if not isinstance(points, Tensor):
            raise TypeError(f"the context sampler must return a torch.Tensor, got {type(points).__name__}")
        if points.dim() < 2 or points.shape[0] != num_points:
            raise ValueError(
                f"the context sampler must return shape ({num_points}, ...), got {tuple(points.shape)}"
            )
        return points


class BatchMixedContext(ContextDistribution):
    r"""A fraction of the context points taken from the current mini-batch, the rest from ``base``.

    ``round(fraction · K)`` points (at most the batch size) are rows of ``batch_x`` drawn without replacement;
    the others are ``base.sample(...)``. The paper uses half mini-batch, half monochrome images.

    Args:
        base: the distribution for the other points.
        fraction: in ``[0, 1]``.
    """

    def __init__(self, base: ContextDistribution, fraction: float = 0.5) -> None:
        if not isinstance(base, ContextDistribution):
            raise TypeError(f"base must be a ContextDistribution, got {type(base).__name__}")
        self.base, self.fraction = base, real_number(fraction, "fraction", 0.0, 1.0, high_open=False)

    def sample(
        self, num_points: int, generator: torch.Generator | None = None, batch_x: Tensor | None = None
    ) -> Tensor:
        num_points = positive_int(num_points, "num_points")
        if batch_x is None:
            raise ValueError("BatchMixedContext needs the mini-batch inputs: pass batch_x")
        from_batch = min(round(self.fraction * num_points), batch_x.shape[0])
        parts = []
        if from_batch:
            parts.append(batch_x[_indices(batch_x.shape[0], from_batch, generator, False).to(batch_x.device)])
        if num_points > from_batch:
            other = self.base.sample(num_points - from_batch, generator)
            if parts:
                other = other.reshape(other.shape[0], *parts[0].shape[1:]).to(parts[0])
            parts.append(other)
        return torch.cat(parts)
