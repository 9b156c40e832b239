r"""The mean-field Gaussian variational distribution over a network's weights, kept apart from the network."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..validation import real_number


def _positive(value: object, argument: str) -> float:
    return real_number(value, argument, low_open=True)


class MeanFieldGaussian(nn.Module):
    r"""Mean-field Gaussian :math:`q(\theta) = N(\mu, \operatorname{diag}(s^2))` over the trainable parameters of a
    network, initialized from its weights.

    .. math::
        \theta = \mu + s \odot \epsilon, \quad \epsilon \sim N(0, I), \qquad
        s = s_\text{max} \operatorname{sigmoid}(r) \ \text{(with a cap)} \quad\text{or}\quad s = e^{r},

    with the unconstrained ``raw_std`` :math:`r`. For :math:`s \ll s_\text{max}` both are :math:`\approx` a
    log-parameterization, so an optimizer step changes :math:`s` by a factor whatever its scale. The cap
    ``max_std`` (FSVI uses the prior's standard deviations :math:`s_0`) keeps every weight's variance below the
    prior's, as in any Gaussian posterior of a linear model. It matters for weights whose Jacobian vanishes at
    the context points (e.g. of inactive ReLU units): the function-space KL does not see them, and without a
    cap their :math:`s` drifts with the optimizer's noise until a draw switches the unit on.

    The means :math:`\mu` start at a copy of the network's weights; both ``mean`` and ``raw_std`` hold one
    ``nn.Parameter`` per trainable parameter of the network, in ``names`` order. The network itself is not
    stored and never modified.

    Args:
        net: the network whose trainable parameters (``requires_grad=True``) are made random.
        init_std: the initial :math:`s` of every weight, ``> 0`` (and below the cap).
        max_std: the cap :math:`s_\text{max}`: ``None`` (no cap), a positive float, or a mapping from every
            parameter name to a positive 0-dim tensor or a tensor of the parameter's shape.

    Raises:
        TypeError: ``net`` is not an ``nn.Module``.
        ValueError: ``init_std`` is not a positive finite number or not below the cap, ``max_std`` is invalid,
            or ``net`` has no trainable parameters.

    Example:
        >>> q = MeanFieldGaussian(net, init_std=1e-3)
        >>> theta = q.sample()                      # {name: tensor} for torch.func.functional_call(net, theta, x)
    """

    def __init__(
        self, net: nn.Module, init_std: float = 1e-3, max_std: float | Mapping[str, Tensor] | None = None
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        init_std = _positive(init_std, "init_std")
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("net has no trainable parameters (all have requires_grad=False)")
        caps = None
        if max_std is not None:
            if isinstance(max_std, Mapping):
                if set(max_std) != {n for n, _ in named}:
                    raise ValueError("max_std must name every trainable parameter exactly")
                caps = [torch.as_tensor(max_std[n]).detach().to(p) for n, p in named]
            else:
                caps = [torch.tensor(_positive(max_std, "max_std")).to(p) for _, p in named]
            for (n, p), cap in zip(named, caps):
                if cap.dim() and cap.shape != p.shape or not (cap > 0).all() or not torch.isfinite(cap).all():
                    raise ValueError(f"max_std[{n!r}] must be positive and finite, 0-dim or of shape {tuple(p.shape)}")
                if (init_std >= cap).any():
                    raise ValueError(f"init_std={init_std} must be below max_std ({cap.min().item():.3g} for {n!r})")
        super().__init__()
        self.names: tuple[str, ...] = tuple(n for n, _ in named)
        self.mean = nn.ParameterList([nn.Parameter(p.detach().clone()) for _, p in named])
        raw = []
        for i, (_, p) in enumerate(named):
            if caps is None:
                value = torch.full_like(p.detach(), math.log(init_std))
            else:
                ratio = init_std / caps[i]
                value = (torch.log(ratio) - torch.log1p(-ratio)).expand(p.shape).clone()  # logit(s / s_max)
            raw.append(nn.Parameter(value))
        self.raw_std = nn.ParameterList(raw)
        self.capped = caps is not None
        for i, cap in enumerate(caps or []):
            self.register_buffer(f"max_std_{i}", cap)

    @property
    def num_params(self) -> int:
        """P, the number of random weights."""
        return sum(m.numel() for m in self.mean)

    def means(self) -> dict[str, Tensor]:
        r""":math:`\mu` per parameter name (the parameters themselves: differentiable)."""
        return dict(zip(self.names, self.mean))

    def stds(self) -> dict[str, Tensor]:
        r""":math:`s` per parameter name (differentiable)."""
        if not self.capped:
            return {n: r.exp() for n, r in zip(self.names, self.raw_std)}
        return {
            n: getattr(self, f"max_std_{i}") * torch.sigmoid(r) for i, (n, r) in enumerate(zip(self.names, self.raw_std))
        }

    def variances(self) -> dict[str, Tensor]:
        r""":math:`s^2` per parameter name (differentiable)."""
        return {n: s.square() for n, s in self.stds().items()}

    def sample(self, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        r"""One reparameterized draw :math:`\mu + s \odot \epsilon` per parameter name (differentiable in
        :math:`\mu` and :math:`s`)."""
        out = {}
        for (n, s), m in zip(self.stds().items(), self.mean):
            eps = torch.randn(m.shape, dtype=m.dtype, device=m.device, generator=generator)
            out[n] = m + s * eps
        return out
