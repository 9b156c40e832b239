r"""The one layer plan: which ``nn.Linear`` / ``nn.Conv2d`` layers take the structured form, decided once per
input shape and used by the NTK engine, the curvature (KFAC, diagonal), the weight posteriors and FSVI.

The safety rule: the exact types ``nn.Linear`` / ``nn.Conv2d`` (``groups=1``; any padding, padding mode, stride
and dilation), whose parameters belong to no other module
(:func:`candidate_layers`), called exactly once per forward pass on batched inputs, and whose structured
Jacobian equals autograd's on a probe example (this catches weights used outside the layer's forward;
:func:`verify_layers`: one forward and one backward pass, done once per architecture of the network and input
shape, :func:`cached_plan`). Layers that fail take the generic per-example route. Each verified layer has a number
of locations ``T`` per example on the probe: one for a linear layer on ``(N, d)`` inputs (its Grams factor,
:attr:`LayerPlan.single`), several for a convolution (:attr:`LayerPlan.multi`). The bias is folded into the
input once, by :meth:`~ntkgp.ntk.features.Layer.fold` (:math:`\bar a = [a; 1]`).

Normalization layers' affine parameters and ``nn.Embedding`` tables (:mod:`ntkgp.ntk.norm_features`) are verified
by the same check, in the same probe passes, and are the plan's :attr:`LayerPlan.elementwise` layers (with
``elementwise=True``, as :func:`cached_plan` and so every :meth:`NetworkCore.layer_plan
<ntkgp.ntk.network.NetworkCore.layer_plan>` asks; :func:`plan_layers` leaves them generic by default): they take
their per-example rows from the same forward and backward passes, :math:`\sum_t \hat x_{nt} \odot \Gamma_{nmt}`
and :math:`\sum_t \Gamma_{nmt}`, :math:`O(dT)` per example and column for :math:`d` channels on :math:`T`
locations, and a scatter of :math:`\Gamma` by token id, :math:`O(TD)`, instead of a per-example backward pass
through the whole network: in the curvature passes (diagonal GGN and EF, KFAC's exact diagonal part) and the NTK's
Grams (:mod:`ntkgp.ntk.token_grams` for the tables). Their parameters are not :attr:`LayerPlan.generic`: a consumer
without a route for them asks :func:`plan_layers` for a plan without them, or sends them to its generic route.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .additive_features import additive_candidates
from .architecture import cached
from .attention_features import AttentionProjection, attention_candidates
from .checks import check_outputs
from .features import LAYER_TYPES, Layer, record
from .functional import forward
from .inputs import detach, num_rows, signature
from .norm_features import elementwise_candidates


@dataclass(frozen=True)
class LayerPlan:
    """The route of every parameter of :math:`\\theta`, for inputs of one shape.

    Attributes:
        layers: the verified layers, in module order.
        locations: their number of locations per example on the probe.
        generic: the parameters of :math:`\\theta` outside the verified layers and the elementwise ones
            (per-example Jacobians).
        problems: for each candidate left out, why: ``NotImplementedError`` for an unsupported convolution,
            ``ValueError`` otherwise (unsafe: shared, called other than once, a Jacobian that differs).
        elementwise: the verified normalization and embedding layers (:mod:`ntkgp.ntk.norm_features`), in module
            order, their number of locations in ``locations`` (summed over their calls). An elementwise candidate
            that fails the check is generic, not a problem.
    """

    layers: tuple[Layer, ...] = ()
    locations: dict[str, int] = field(default_factory=dict)
    generic: tuple[str, ...] = ()
    problems: dict[str, Exception] = field(default_factory=dict)
    elementwise: tuple[Layer, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The verified layers' names."""
        return tuple(layer.name for layer in self.layers)

    @property
    def single(self) -> tuple[Layer, ...]:
        """The layers with one location per example (factorised Grams)."""
        return tuple(layer for layer in self.layers if self.locations[layer.name] == 1)

    @property
    def multi(self) -> tuple[Layer, ...]:
        """The layers with several locations per example (convolutions, linear layers on sequences)."""
        return tuple(layer for layer in self.layers if self.locations[layer.name] != 1)

    def routes(self) -> tuple:
        """What identifies the routes (two plans with equal routes treat the parameters alike)."""
        return (self.names, self.generic, tuple(layer.name for layer in self.multi),
                tuple(layer.name for layer in self.elementwise))

    def unsafe(self) -> dict[str, Exception]:
        """The problems other than an unsupported configuration."""
        return {m: e for m, e in self.problems.items() if not isinstance(e, NotImplementedError)}

    def raise_problems(self, prefix: str = "") -> None:
        """Raise the first problem (its own type, the message prefixed), if any."""
        if self.problems:
            problem = next(iter(self.problems.values()))
            raise type(problem)(f"{prefix}{problem}") from problem


def _elementwise(net: nn.Module, names: Sequence[str]) -> list[Layer]:
    """The elementwise candidates: normalization and embedding layers, and free parameters added to the activations
    (:mod:`ntkgp.ntk.additive_features`)."""
    return [*elementwise_candidates(net, names), *additive_candidates(net, names)]


def _conv_unsupported(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv2d) and module.groups != 1


def candidate_layers(net: nn.Module, names: Sequence[str]) -> tuple[list[Layer], dict[str, Exception]]:
    """Every ``nn.Linear`` / ``nn.Conv2d`` (exact types) with a weight or bias in ``names``, and the projections of
    every ``nn.MultiheadAttention`` (:mod:`ntkgp.ntk.attention_features`), in module order.

    Returns:
        The candidate layers, and for the layers left out the reason: ``ValueError`` when a parameter is
        shared with another module (unsafe), ``NotImplementedError`` for a convolution with ``groups > 1``
        (unsupported).
    """
    chosen = set(names)
    modules = list(net.named_modules())  # one walk of the modules for both loops
    owners: dict[int, int] = {}
    for _, module in modules:
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    layers, problems = [], {}
    for name, module in modules:
        if type(module) is nn.MultiheadAttention:  # its projections as shared linear layers (attention_features)
            layers += attention_candidates(name, module, chosen, lambda p: owners[id(p)] > 1)
            continue
        if type(module) not in LAYER_TYPES:
            continue
        prefix = f"{name}." if name else ""
        weight = prefix + "weight" if prefix + "weight" in chosen else None
        bias = prefix + "bias" if prefix + "bias" in chosen else None
        if weight is None and bias is None:
            continue
        shared = [k for k in ("weight", "bias") if getattr(module, k) is not None and owners[id(getattr(module, k))] > 1]
        if shared:
            problems[name] = ValueError(f"the {shared[0]} of layer '{name}' is shared with another module")
        elif _conv_unsupported(module):
            problems[name] = NotImplementedError(
                f"the structured form supports Conv2d with groups=1; layer '{name}' has groups={module.groups}"
            )
        else:
            layers.append(Layer(name, module, weight, bias))
    return layers, problems


def verify_layers(
    net: nn.Module, params: dict[str, Tensor], layers: Sequence[Layer], probe: Tensor
) -> tuple[list[Layer], dict[str, int], dict[str, Exception]]:
    r"""Keep the layers whose structured Jacobian equals autograd's on the probe (one example).

    The check compares :math:`u^\top J` of each layer's parameters for a random cotangent :math:`u` (seeded),
    from the features (:math:`\sum_t (u^\top \Gamma_t) a_t^\top`) and from autograd: one forward and one
    backward pass each, whatever the number of outputs. Two Jacobians that differ differ in :math:`u^\top J` for
    almost every :math:`u`.

    Args:
        net: the network.
        params: the parameters passed to ``functional_call``, detached.
        layers: candidates (:func:`candidate_layers`).
        probe: one prepared example ``(1, ...)``.

    Returns:
        The verified layers; their number of locations ``T`` on the probe; and, for the others, a
        ``ValueError`` saying why (called other than once, unbatched inputs, a Jacobian that differs, e.g.
        because the weight is also used outside the layer's forward).
    """
    if not layers:
        return [], {}, {}
    probe = detach(probe)
    names = [n for layer in layers for n in layer.parameter_names]
    with torch.enable_grad():
        local = {**params, **{n: params[n].detach().requires_grad_(True) for n in names}}
        f = forward(net, local, probe)
        check_outputs(f, num_rows(probe))
        generator = torch.Generator().manual_seed(0)
        u = torch.randn(f.shape, generator=generator, dtype=torch.float64).to(f)
        exact = dict(zip(names, torch.autograd.grad(f, [local[n] for n in names], u, allow_unused=True)))
    features, problems = record(net, params, layers, probe, u.unsqueeze(-1), graph=False)
    keep, locations = [], {}
    for layer in layers:
        if layer.name in problems:
            continue
        approx = layer.jacobians(features.inputs[layer.name], features.grads[layer.name])
        ok = True
        for name, value in approx.items():
            ref = exact[name]
            ref = torch.zeros_like(params[name]) if ref is None else ref
            ref = ref.reshape(value.shape) if ref.numel() == value.numel() else None
            tol = 1e-4 if value.dtype == torch.float32 else 1e-9
            ok &= ref is not None and torch.allclose(value, ref, rtol=tol, atol=tol * (1 + ref.abs().max().item()))
        if ok:
            keep.append(layer)
            locations[layer.name] = features.inputs[layer.name].shape[-1]
        else:
            problems[layer.name] = ValueError(
                f"the Jacobian of layer '{layer.name}' is not that of a layer applied once (is its weight also "
                "used outside its forward?)"
            )
    return keep, locations, problems


def _restrict(candidates: list[Layer], problems: dict[str, Exception], modules: Sequence[str] | None
              ) -> tuple[list[Layer], dict[str, Exception]]:
    """The candidates and problems of the modules ``modules`` (``None``: all), which must be candidates or
    problems."""
    if modules is None:
        return candidates, problems
    known = {layer.name for layer in candidates} | set(problems)
    missing = [m for m in modules if m not in known]
    if missing:
        raise ValueError(f"modules {missing} are not Linear/Conv2d layers with parameters in the posterior")
    return [layer for layer in candidates if layer.name in modules], {m: p for m, p in problems.items() if m in modules}


def _plan(layers: Sequence[Layer], locations: dict[str, int], names: Sequence[str],
          problems: dict[str, Exception], elementwise: Sequence[Layer] = ()) -> LayerPlan:
    covered = {n for layer in (*layers, *elementwise) for n in layer.parameter_names}
    return LayerPlan(tuple(layers), locations, tuple(n for n in names if n not in covered), problems,
                     tuple(elementwise))


def plan_layers(
    net: nn.Module, params: dict[str, Tensor], names: Sequence[str], probe: Tensor | None,
    modules: Sequence[str] | None = None, runner: nn.Module | None = None, elementwise: bool = False,
) -> LayerPlan:
    """The layer plan of the parameters ``names``: candidates verified on ``probe`` (one prepared example).

    Args:
        net: the network.
        params: the parameters passed to ``functional_call``, detached.
        names: the parameters :math:`\\theta`.
        probe: ``(1, ...)``; ``None`` for no structured layer (every parameter generic).
        modules: restrict the candidates to these module names.
        runner: the module the probe passes run on (ntkgp's private copy of ``net``,
            :meth:`NetworkCore.module <ntkgp.ntk.network.NetworkCore.module>`); ``None``: ``net`` itself.
        elementwise: also verify the normalization and embedding layers
            (:func:`~ntkgp.ntk.norm_features.elementwise_candidates`, in the same probe passes): the plan's
            :attr:`LayerPlan.elementwise`; otherwise their parameters are generic.

    Raises:
        ValueError: when ``modules`` names a module that is not a Linear/Conv2d layer with parameters in
            ``names``.
    """
    if probe is None:
        return LayerPlan(generic=tuple(names))
    candidates, problems = _restrict(*candidate_layers(net, names), modules)
    extra = [la for la in _elementwise(net, names) if modules is None or la.name in modules] \
        if elementwise else []
    checked, locations, failed = verify_layers(net if runner is None else runner, params, [*candidates, *extra], probe)
    own = {layer.name for layer in extra}
    # an attention projection that fails the check is generic, not a problem (attention_features)
    quiet = own | {la.name for la in candidates if isinstance(la, AttentionProjection)}
    return _plan([la for la in checked if la.name not in own], locations, names,
                 {**problems, **{m: e for m, e in failed.items() if m not in quiet}},
                 [la for la in checked if la.name in own])


def cached_plan(
    net: nn.Module, params: Callable[[], dict[str, Tensor]], names: Sequence[str], probe: Tensor,
    modules: Sequence[str] | None = None, held: list | None = None, runner: nn.Module | None = None,
) -> LayerPlan:
    """:func:`plan_layers` (``params()``: its parameters, looked up only when the plan is computed), every
    candidate verified once per architecture of ``net``
    (:func:`ntkgp.ntk.architecture.cached`: its modules, parameters, attributes, forwards and hooks as they are
    now) and probe shape, dtype and device, whatever the number of cores built on the network and the
    ``modules`` asked for (the probe passes on ``runner``, :func:`plan_layers`): a layer's check does not depend on
    the others checked with it (its own hook, its own
    parameters' products), so the plan of some modules is that of all restricted to them. The candidates (and
    their sharing) are walked each time. The elementwise layers are verified in the same passes
    (``elementwise=True``: :attr:`LayerPlan.elementwise`)."""
    key = ("layer plan", tuple(names), *signature(probe))

    def verdict() -> tuple:  # the plan without its modules: the cache holds the network weakly
        plan = plan_layers(net, params(), names, probe, runner=runner, elementwise=True)
        return (plan.names, dict(plan.locations), tuple((m, type(e), str(e)) for m, e in plan.problems.items()),
                tuple(layer.name for layer in plan.elementwise))

    verified, locations, problems, elementwise = cached(net, key, verdict, held)
    candidates, _ = _restrict(*candidate_layers(net, names), modules)
    chosen = {layer.name: layer for layer in candidates}
    extra = [la for la in _elementwise(net, names)
             if la.name in elementwise and (modules is None or la.name in modules)]
    kept = [m for m in verified if m in chosen] + [la.name for la in extra]
    return _plan([chosen[m] for m in verified if m in chosen], {m: locations[m] for m in kept},
                 names, {m: kind(message) for m, kind, message in problems if modules is None or m in modules}, extra)
