r"""How :class:`~ntkgp.fsvi.FSVI` reads its inputs: GPyTorch's flat ``(*batch, N, D)`` form, the network's own
input shape, and the checks that the network takes them and gives the likelihood's number of outputs."""

from __future__ import annotations

import math

from torch import Tensor

from ..ntk.checks import check_fits


class NetworkInputs:
    """The input handling of :class:`~ntkgp.fsvi.FSVI` (a mixin: it reads ``linearized``,
    ``variational_distribution``, ``likelihood``, ``net`` and ``num_outputs`` of the model). Every check runs
    before anything changes."""

    def _reference(self) -> Tensor:
        """A tensor of the model's dtype and device (the first variational mean)."""
        return self.variational_distribution.mean[0]

    def prepare(self, x: Tensor, argument: str = "x") -> Tensor:
        """``x`` in the network's shape, dtype and device (a copy only if needed)."""
        if isinstance(x, Tensor) and x.is_meta:
            raise ValueError(f"{argument} is on the meta device, which holds shapes but no values to compute with")
        return self.linearized.prepare(x, self._reference(), argument)

    def _flat(self, x: Tensor, argument: str = "x", batch: bool = True) -> Tensor:
        """GPyTorch's ``(*batch, N, D)`` form of ``x`` (``D`` the product of ``input_shape``); ``batch=False``
        allows only ``(N, D)``. Checked before anything changes.

        Inputs ``(*batch, N, *input_shape)`` are flattened. While the input shape is unknown, an input with more
        than two dimensions is a batch of flat inputs if the network takes rows of its last dimension (one row is
        tried), else one set of inputs ``(N, *input_shape)`` (images): that fixes ``input_shape``, once the network
        was seen to take ``x[:1]``."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{argument} must have shape (N, ...) with a feature dimension, got {tuple(x.shape)}")
        shape = self.linearized.input_shape
        if shape is None and x.dim() > 2 and not self._takes_rows(x):
            shape = tuple(x.shape[1:])
            self._fits(self.prepare(x[:1], argument), argument)
            self.linearized.input_shape = shape
        if shape is not None and len(shape) > 1 and x.dim() > len(shape) and tuple(x.shape[-len(shape) :]) == shape:
            x = x.flatten(-len(shape))
        if shape is not None and x.shape[-1] != math.prod(shape):
            image = f" or (*batch, N, {', '.join(map(str, shape))})" if len(shape) > 1 else ""
            raise ValueError(
                f"{argument} must have shape (*batch, N, {math.prod(shape)}){image}, got {tuple(x.shape)}"
            )
        if not batch and x.dim() > 2:
            raise ValueError(f"{argument} must have shape (N, ...) without batch dimensions, got {tuple(x.shape)}")
        return x

    def _check_outputs(self, x: Tensor, argument: str = "x") -> None:
        """Raise unless the network gives the likelihood's number of outputs (one forward pass of one row of the
        flat ``x``, the first time; the routes are planned on it)."""
        row = self.prepare(x.reshape(-1, x.shape[-1])[:1], argument)
        c = self.linearized.num_outputs(self.variational_distribution.means(), row)
        if c != self.num_outputs:
            raise ValueError(
                f"net has {c} outputs but the likelihood {type(self.likelihood).__name__} expects {self.num_outputs}"
            )

    def _fits(self, x: Tensor, argument: str, num_outputs: int | None = None) -> int:
        r""":func:`~ntkgp.ntk.checks.check_fits` at :math:`\mu`: the network takes ``x[:1]`` (prepared) and gives
        ``(1, C)`` (``num_outputs`` if given); returns ``C``."""
        means = {n: t.detach() for n, t in self.variational_distribution.means().items()}
        return check_fits(self.linearized.core.module(), means, x, argument, num_outputs)  # ntkgp's private copy

    def _takes_rows(self, x: Tensor) -> bool:
        """Whether the network maps one row of ``x``'s last dimension, ``(1, x.shape[-1])``, to ``(1, C)``."""
        row = x.detach().reshape(-1, x.shape[-1])[:1]
        try:
            self._fits(self.prepare(row), "x")
        except (ValueError, TypeError):
            return False
        return True
