r"""The last layer of a network and its features :math:`\phi(x)`: one forward pass instead of per-example Jacobians.

For a last ``nn.Linear`` layer whose output is the network's output, :math:`f(x) = W \phi(x) + b`, the Jacobian
with respect to :math:`\Theta = [W \mid b]` (``(C, d + 1)``, row-major) is

.. math::
    J(x) = I_C \otimes \tilde\phi(x)^\top, \qquad \tilde\phi = [\phi; 1]

(``docs/math.md``, "Structured form", with :math:`\Gamma = I`), so every curvature and predictive of the layer
needs only the features :math:`\tilde\phi(x_n)`, from one forward pass of the network (the layer's input,
recorded by :meth:`~ntkgp.ntk.network.NetworkCore.features` without a backward pass). The flat order of
:math:`\theta` is the network's: the weight row-major ``c·d + j``, then the bias ``C·d + c``
(:meth:`~ntkgp.ntk.features.Layer.index` maps :math:`\Theta` to it).

**When the feature route applies** (decided on the first batch, :class:`LastLayerPass`): the layer is an exact
``nn.Linear`` that the layer plan verified (called once per forward pass, on ``(N, d)`` inputs), and the network's
output is the layer's output: one backward pass with random cotangents :math:`u` on the first batch returns
:math:`\Gamma = u` (:math:`\partial f / \partial z = I` there), and every later batch's outputs equal
:math:`\Theta \tilde\phi` up to rounding (:func:`head_features`; a head whose output differs, such as a ReLU
after the layer, raises). Other layers take per-example Jacobians (``vmap(jacrev)``), as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....ntk.features import Layer
from ....ntk.network import NetworkCore
from ...ggn.data_pass import Data, DataPass


def last_layer_names(net: nn.Module, layer: str | None) -> tuple[str, list[str]]:
    """The last layer's module name and its trainable parameters' names.

    Args:
        net: the network.
        layer: the module's name in ``net.named_modules()``; ``None``: the last module that owns trainable
            parameters.

    Raises:
        TypeError: ``net`` is not an ``nn.Module`` or ``layer`` not a string.
        ValueError: ``layer`` names no module with trainable parameters of its own, or ``net`` has none.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if layer is not None and not isinstance(layer, str):
        raise TypeError(f"layer must be a module name (a string) or None, got {type(layer).__name__}")
    owners = {}
    for name, module in net.named_modules():
        params = [f"{name}.{k}" if name else k for k, p in module.named_parameters(recurse=False) if p.requires_grad]
        if params:
            owners[name] = params
    if layer is None:
        if not owners:
            raise ValueError("net has no trainable parameters")
        layer = list(owners)[-1]
    elif layer not in owners:
        raise ValueError(
            f"layer must name a module of net with trainable parameters of its own, got {layer!r}; "
            f"candidates: {list(owners)}"
        )
    return layer, owners[layer]


def _no_cotangents(f: Tensor) -> Tensor:
    """No cotangent column: the feature pass records the layer's input without a backward pass."""
    return f.new_zeros(*f.shape, 0)


def head_features(core: NetworkCore, layer: Layer, x: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`\tilde\phi` ``(n, d_a)`` (:meth:`~ntkgp.ntk.features.Layer.fold`: a 1 appended when the bias is in
    :math:`\theta`) and the outputs ``(n, C)`` of a prepared batch, from one forward pass.

    Raises:
        ValueError: when the outputs differ from the layer's output :math:`W\phi + b` beyond rounding (error model
            :math:`64\, d\, \varepsilon \sum_j |W_{cj} \phi_j| + |b_c|`): the network's output is not the layer's.
    """
    features = core.features(x, [layer], _no_cotangents)
    phi = features.inputs[layer.name][..., 0]  # (n, d)
    f = features.outputs
    module = layer.module
    weight = module.weight.detach()
    z = phi @ weight.T
    bound = phi.abs() @ weight.abs().T
    if module.bias is not None:
        z = z + module.bias.detach()
        bound = bound + module.bias.detach().abs()
    tolerance = 64 * phi.shape[1] * torch.finfo(f.dtype).eps * bound + torch.finfo(f.dtype).tiny
    if z.shape != f.shape or bool(((z - f).abs() > tolerance).any()):
        raise ValueError(
            f"the network's output is not the output of its last layer '{layer.name}' on this batch (J = I ⊗ [φ, 1] "
            "needs f = W φ(x) + b): build the posterior over a layer whose output is the network's"
        )
    return layer.fold(phi.unsqueeze(-1))[..., 0], f


def feature_layer(core: NetworkCore, name: str, x: Tensor) -> Layer | None:
    r"""The layer ``name`` in structured form when the feature route applies on the prepared batch ``x`` (module
    docstring), else ``None``: the layer plan's verdict, then one backward pass with standard normal cotangents
    :math:`u` (seeded) whose output gradients must be :math:`u` itself."""
    plan = core.layer_plan(x, modules=[name])
    layer = next((candidate for candidate in plan.single if candidate.name == name), None)
    if layer is None or type(layer.module) is not nn.Linear or layer.weight is None:
        return None
    generator = torch.Generator().manual_seed(0)

    def cotangents(f: Tensor) -> Tensor:
        return torch.randn(*f.shape, 1, generator=generator, dtype=torch.float64).to(f)

    features = core.features(x, [layer], cotangents)
    generator.manual_seed(0)
    u = cotangents(features.outputs)  # the same draws
    g = features.grads.get(name)
    if g is None or g.shape[2] != features.outputs.shape[1]:
        return None
    tolerance = 64 * torch.finfo(g.dtype).eps * u.abs().max()
    return layer if bool(((g[:, 0, :, 0] - u[..., 0]).abs() <= tolerance).all()) else None


class LastLayerPass:
    r"""One pass over the data for a posterior over one layer's parameters: per batch the prepared inputs, the
    features :math:`\tilde\phi` (``None`` on the Jacobian route), the outputs and the normalised targets.

    Args:
        core: the network restricted to the layer's parameters.
        likelihood: the likelihood.
        name: the layer's module name.

    Attributes:
        layer: the layer in structured form on the feature route (decided on the first batch), else ``None``.
        data: the :class:`~ntkgp.laplace.ggn.data_pass.DataPass` (outputs and targets collected).
    """

    def __init__(self, core: NetworkCore, likelihood: Likelihood, name: str) -> None:
        self.core = core
        self.name = name
        self.data = DataPass.on(core, likelihood)
        self.layer: Layer | None = None
        self._decided = False

    def batches(self, x: Data, y: Tensor | None, batch_size: int, progress: bool, desc: str
                ) -> Iterator[tuple[Tensor, Tensor | None, Tensor, Tensor]]:
        """Yield ``(x_b, phi_b or None, f_b, y_b)`` (:meth:`DataPass.batches`: the data checked first)."""
        held: list[Tensor] = []

        def forward(xb: Tensor, root) -> Tensor:
            if not self._decided:
                self.layer = feature_layer(self.core, self.name, xb)
                self._decided = True
            if self.layer is None:
                with torch.no_grad():
                    return self.core.forward(xb)
            phi, f = head_features(self.core, self.layer, xb)
            held.append(phi)
            return f

        for xb, fb, yb in self.data.batches(x, y, batch_size, progress, desc, forward):
            yield xb, (held.pop() if held else None), fb, yb
