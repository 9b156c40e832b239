r"""The mean-field Gaussian variational distribution over a network's weights, kept apart from the network."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class MeanFieldGaussian(nn.Module):
    r"""Mean-field Gaussian :math:`q(\theta) = N(\mu, \operatorname{diag}(s^2))` over the trainable parameters of a
    network, initialized from its weights.

    .. math:: \theta = \mu + s \odot \epsilon, \qquad \epsilon \sim N(0, I), \qquad s = \exp(\log s)

    The means :math:`\mu` start at a copy of the network's weights and the standard deviations at ``init_std``;
    both are ``nn.Parameter`` of this module (``mean`` and ``log_std``, one entry per trainable parameter of
    the network, in ``names`` order). The log-parameterization makes an optimizer step change :math:`s` by a
    factor, whatever its scale. The network itself is not stored and never modified.

    Args:
        net: the network whose trainable parameters (``requires_grad=True``) are made random.
        init_std: the initial :math:`s` of every weight, ``> 0``.

    Raises:
        TypeError: ``net`` is not an ``nn.Module``.
        ValueError: ``init_std`` is not a positive finite number, or ``net`` has no trainable parameters.

    Example:
        >>> q = MeanFieldGaussian(net, init_std=1e-3)
        >>> theta = q.sample()                      # {name: tensor} for torch.func.functional_call(net, theta, x)
    """

    def __init__(self, net: nn.Module, init_std: float = 1e-3) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or not (0 < init_std < math.inf):
            raise ValueError(f"init_std must be a positive finite number, got {init_std!r}")
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("net has no trainable parameters (all have requires_grad=False)")
        super().__init__()
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self.mean = nn.ParameterList([nn.Parameter(p.detach().clone()) for _, p in named])
        self.log_std = nn.ParameterList(
            [nn.Parameter(torch.full_like(p.detach(), math.log(init_std))) for _, p in named]
        )

    @property
    def num_params(self) -> int:
        """P, the number of random weights."""
        return sum(m.numel() for m in self.mean)

    def means(self) -> dict[str, Tensor]:
        r""":math:`\mu` per parameter name (the parameters themselves: differentiable)."""
        return dict(zip(self.names, self.mean))

    def stds(self) -> dict[str, Tensor]:
        r""":math:`s` per parameter name (differentiable)."""
        return {n: t.exp() for n, t in zip(self.names, self.log_std)}

    def variances(self) -> dict[str, Tensor]:
        r""":math:`s^2` per parameter name (differentiable)."""
        return {n: (2 * t).exp() for n, t in zip(self.names, self.log_std)}

    def sample(self, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        r"""One reparameterized draw :math:`\mu + s \odot \epsilon` per parameter name (differentiable in
        :math:`\mu` and :math:`s`)."""
        out = {}
        for n, m, t in zip(self.names, self.mean, self.log_std):
            eps = torch.randn(m.shape, dtype=m.dtype, device=m.device, generator=generator)
            out[n] = m + t.exp() * eps
        return out
