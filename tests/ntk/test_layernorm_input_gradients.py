"""Input gradients through normalization layers: ∂/∂x of the NTK Gram ``K(x, x') = J(x) P0⁻¹ J(x')ᵀ`` and of the
Jacobian products, for networks with LayerNorm (module and functional, one or several locations), InstanceNorm,
BatchNorm (eval mode), GroupNorm and RMSNorm, in both routes (the feature pass, ``strategy="auto"``; ``vmap(jacrev)``
for every parameter, ``strategy="contraction"``).

The reference Jacobian is built by ordinary autograd, one ``torch.autograd.grad(..., create_graph=True)`` per example
and output, and is itself checked against finite differences (``gradcheck``). It is not built with
``torch.func.jacrev``: torch's batching rule of ``native_layer_norm_backward`` forms γ's gradient from the saved mean
and inverse deviation, which ordinary autograd then holds constant, so a ``jacrev`` Gram of a LayerNorm network has
a wrong input gradient (the fault ``ntkgp.ntk.exact_norms`` works around; this file fails without it)."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ntkgp.kernels import NTKKernel
from ntkgp.ntk import NTKEngine
from ntkgp.ntk.exact_norms import exact_norms
from ntkgp.ntk.functional import per_example_jacobians
from tests.helpers import assert_unchanged, float32_roundings, snapshot


class FunctionalLayerNorm(nn.Module):
    """A LayerNorm written with ``F.layer_norm`` in a user's module (never a structured layer: generic route)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain, self.shift = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, h.shape[-1:], self.gain, self.shift)


def _norm(kind: str) -> list[nn.Module]:
    if kind == "layer_norm":
        return [nn.LayerNorm(6)]
    if kind == "layer_norm_no_bias":
        return [nn.LayerNorm(6, bias=False)]
    if kind == "layer_norm_locations":  # two locations of 3 features per example
        return [nn.Unflatten(1, (2, 3)), nn.LayerNorm(3), nn.Flatten()]
    if kind == "functional_layer_norm":
        return [FunctionalLayerNorm(6)]
    if kind == "instance_norm":
        return [nn.Unflatten(1, (2, 3)), nn.InstanceNorm1d(2, affine=True), nn.Flatten()]
    if kind == "batch_norm_eval":
        return [nn.BatchNorm1d(6)]
    if kind == "group_norm":
        return [nn.GroupNorm(2, 6)]
    if kind == "rms_norm":
        return [nn.RMSNorm(6)]
    raise KeyError(kind)


KINDS = ["layer_norm", "layer_norm_no_bias", "layer_norm_locations", "functional_layer_norm", "instance_norm",
         "batch_norm_eval", "group_norm", "rms_norm"]


def make_net(kind: str) -> nn.Module:
    """Linear → normalization → tanh → Linear, float64, weights and statistics away from their initial values."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 6), *_norm(kind), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.7)
        for m in net.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def reference_jacobian(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``J(x)`` ``(N·C, P)``, rows ``n·C + c``, by ordinary autograd with ``create_graph``: differentiable in ``x``."""
    params = [p for p in net.parameters() if p.requires_grad]
    out = net(x)
    rows = []
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            grads = torch.autograd.grad(out[n, c], params, create_graph=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                   for g, p in zip(grads, params)]))
    return torch.stack(rows)


def prior_columns(net: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One δ per parameter (``prior_structure="parameter"``) and δ⁻¹ per Jacobian column."""
    params = [p for p in net.parameters() if p.requires_grad]
    delta = torch.linspace(0.5, 2.0, len(params), dtype=torch.float64)
    return delta, torch.cat([torch.full((p.numel(),), 1.0 / d.item(), dtype=torch.float64)
                             for p, d in zip(params, delta)])


def reference_gram(net: nn.Module, x: torch.Tensor, x2: torch.Tensor | None) -> torch.Tensor:
    _, weights = prior_columns(net)
    j1 = reference_jacobian(net, x)
    j2 = j1 if x2 is None else reference_jacobian(net, x2)
    return (j1 * weights) @ j2.T


def kernel_gram(net: nn.Module, strategy: str, space: str = "function"):
    delta, _ = prior_columns(net)
    kernel = NTKKernel(net, prior_precision=delta.to(next(net.parameters()).dtype), prior_structure="parameter",
                       strategy=strategy, space=space)
    return lambda x, x2: (kernel(x) if x2 is None else kernel(x, x2)).to_dense()


def input_gradient(gram, x: torch.Tensor, x2: torch.Tensor | None, weights: torch.Tensor) -> torch.Tensor:
    """∂/∂x of Σ R ⊙ K(x, x2) (a fixed random R, so that no symmetry hides an error)."""
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((gram(x, x2) * weights).sum(), x)
    return grad


def data(dtype=torch.float64):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    x2 = torch.randn(3, 3, generator=generator, dtype=torch.float64)
    return x.to(dtype), x2.to(dtype), torch.Generator().manual_seed(6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", ["auto", "contraction"])
def test_gram_input_gradients_match_autograd_reference(kind, strategy):
    net = make_net(kind)
    before = snapshot(net)
    x, x2, generator = data()
    gram = kernel_gram(net, strategy)
    for other in (x2, None):  # K(x, x2) and the symmetric K(x): x on both sides
        weights = torch.randn(8, 8 if other is None else 6, generator=generator, dtype=torch.float64)
        got = input_gradient(gram, x, other, weights)
        want = input_gradient(lambda a, b: reference_gram(net, a, b), x, other, weights)
        scale = 1.0 + want.abs().max().item()
        assert (got - want).abs().max().item() <= 1e-10 * scale, (kind, strategy, other is None)
    assert_unchanged(net, before)


@pytest.mark.parametrize("strategy", ["auto", "contraction"])
def test_layer_norm_gram_passes_gradcheck_in_both_spaces(strategy):
    """Finite differences (``gradcheck``) of the library's Gram and of the reference itself."""
    net = make_net("layer_norm")
    x, x2, _ = data()
    x = x[:2].clone().requires_grad_(True)
    for space in ("function", "weight"):
        gram = kernel_gram(net, strategy, space)
        assert torch.autograd.gradcheck(lambda a, gram=gram: gram(a, x2), (x,), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)
    assert torch.autograd.gradcheck(lambda a: reference_gram(net, a, x2), (x,), eps=1e-6, atol=1e-6, rtol=1e-5,
                                    fast_mode=True)


@pytest.mark.parametrize("kind", ["layer_norm", "functional_layer_norm", "instance_norm"])
def test_products_input_gradients_match_autograd_reference(kind):
    """∂/∂x of J(x), Jᵀv, J u and the matrix-free K v (torch.func products, forward mode for J u)."""
    net = make_net(kind)
    engine = NTKEngine(net)
    x, _, generator = data()
    p = sum(q.numel() for q in net.parameters())
    v = torch.randn(8, 2, generator=generator, dtype=torch.float64)
    u = torch.randn(p, 2, generator=generator, dtype=torch.float64)
    g = engine.num_groups
    group_weights = torch.linspace(0.5, 2.0, g, dtype=torch.float64)
    columns = torch.cat([torch.full((q.numel(),), group_weights[i].item(), dtype=torch.float64)
                         for i, m in enumerate([m for m in net if any(True for _ in m.parameters())])
                         for q in m.parameters()])
    tangents, at = {}, 0
    for name, q in net.named_parameters():
        tangents[name] = u[at:at + q.numel()].reshape(*q.shape, 2)
        at += q.numel()
    cases = {
        "jacobian": (lambda a: engine.jacobian(a), lambda j: j),
        "vjp": (lambda a: torch.cat([t.reshape(-1, 2) for t in engine.vjp(a, v).values()]), lambda j: j.T @ v),
        "jvp": (lambda a: engine.jvp(a, tangents), lambda j: j @ u),
        "matvec": (lambda a: engine.matvec(a, v, group_weights), lambda j: (j * columns) @ (j.T @ v)),
    }
    for name, (ours, theirs) in cases.items():
        got_value = ours(x)
        weights = torch.randn(got_value.shape, generator=generator, dtype=torch.float64)
        got = input_gradient(lambda a, _, ours=ours: ours(a), x, None, weights)
        want = input_gradient(lambda a, _, theirs=theirs: theirs(reference_jacobian(net, a)), x, None, weights)
        assert (got - want).abs().max().item() <= 1e-10 * (1.0 + want.abs().max().item()), (kind, name)


def _relative_sensitivity(gram64, net: nn.Module, x, x2, weights, g64) -> float:
    """κ: the largest ‖Δg‖∞ / (δ‖g‖∞) over four random relative perturbations of size δ of every weight and
    input (float64; one kernel on a copy of the network whose weights are set for each)."""
    delta, worst = 1e-6, 0.0
    moved = copy.deepcopy(net)
    gram = gram64(moved)
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for q, p in zip(moved.parameters(), net.parameters()):
                q.copy_(p * (1 + delta * torch.randn(p.shape, generator=generator, dtype=p.dtype).sign()))
        xs = x * (1 + delta * torch.randn(x.shape, generator=generator, dtype=x.dtype).sign())
        x2s = x2 * (1 + delta * torch.randn(x2.shape, generator=generator, dtype=x.dtype).sign())
        g = input_gradient(gram, xs, x2s, weights)
        worst = max(worst, ((g - g64).abs().max() / (delta * g64.abs().max())).item())
    return worst


@pytest.mark.parametrize("kind", ["layer_norm", "instance_norm", "batch_norm_eval", "group_norm", "rms_norm"])
@pytest.mark.parametrize("strategy", ["auto", "contraction"])
def test_float32_gram_input_gradients_match_float64_copy(kind, strategy):
    net64 = make_net(kind)
    net32 = copy.deepcopy(net64).float()
    x, x2, generator = data()
    weights = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    g64 = input_gradient(kernel_gram(net64, strategy), x, x2, weights)
    g32 = input_gradient(kernel_gram(net32, strategy), x.float(), x2.float(), weights.float()).double()
    # Error model: the float32 evaluation is the exact one with every intermediate (inputs, weights, activations,
    # the backward and double-backward quantities, the Gram's sums) perturbed by at most r·ε relatively
    # (tests.helpers.float32_roundings: a rounding forward and backward per layer, log2 P for the sums); to first
    # order the gradient then moves by r·ε·κ·‖g‖∞, κ the gradient's relative sensitivity to relative perturbations
    # of the weights and inputs, measured here in float64 (4 random sign patterns).
    kappa = _relative_sensitivity(lambda n: kernel_gram(n, strategy), net64, x, x2, weights, g64)
    tolerance = float32_roundings(net64) * torch.finfo(torch.float32).eps * max(kappa, 1.0) * g64.abs().max().item()
    assert (g32 - g64).abs().max().item() <= tolerance, (kind, strategy, kappa)
    assert math.isfinite(tolerance) and tolerance < 1e-3 * g64.abs().max().item()  # a bound that can fail


def test_exact_norms_match_torch_kernels_and_refuse_running_statistics():
    """The decompositions give torch's values (float64, to rounding); normalizations that would update running
    statistics are refused inside a pass that keeps a graph."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=generator, dtype=torch.float64)
    w4, b4 = torch.randn(4, generator=generator, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    w5, b5 = torch.randn(5, generator=generator, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    calls = [
        lambda: F.layer_norm(x, (5,), w5, b5, 1e-5),
        lambda: F.layer_norm(x, (4, 5), None, None),
        lambda: F.layer_norm(input=x, normalized_shape=(5,), bias=b5),
        lambda: torch.layer_norm(x, [5], w5, b5, 1e-3, False),
        lambda: torch.native_layer_norm(x, [5], w5, None, 1e-5)[0],
        lambda: F.rms_norm(x, (5,), w5),
        lambda: F.instance_norm(x, None, None, w4, b4),
        lambda: torch.instance_norm(x, w4, None, None, None, True, 0.1, 1e-5, False),
        lambda: F.rms_norm(x, (4, 5), eps=1e-3),
        lambda: F.batch_norm(x, None, None, w4, b4, True),
        lambda: F.batch_norm(x, torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), w4, b4),
    ]
    for call in calls:
        plain = call()
        with exact_norms():
            mine = call()
        torch.testing.assert_close(mine, plain, rtol=1e-12, atol=1e-12)
    running = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    with exact_norms(), pytest.raises(NotImplementedError, match="running statistics"):
        F.batch_norm(x, *running, w4, b4, training=True)
    assert torch.equal(running[0], torch.zeros(4, dtype=torch.float64))  # nothing updated before the refusal


@pytest.mark.parametrize("kind", ["layer_norm", "instance_norm"])
def test_parameter_gradients_of_per_example_jacobians_pass_gradcheck(kind):
    """∂/∂θ of the per-example Jacobians (FSVI differentiates them in its variational means): the same fault as for
    the inputs, here through the first layer's weight that feeds the normalization."""
    net = make_net(kind)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, _, generator = data()
    norm = next(name for name, m in net.named_modules() if isinstance(m, (nn.LayerNorm, nn.InstanceNorm1d)))
    weights = torch.randn(4, 2, params[f"{norm}.weight"].numel(), generator=generator, dtype=torch.float64)

    def contracted(w0: torch.Tensor) -> torch.Tensor:
        jac = per_example_jacobians(net, {**params, "0.weight": w0}, x, [f"{norm}.weight"])
        return (jac[f"{norm}.weight"] * weights).sum()

    w0 = params["0.weight"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(contracted, (w0,), eps=1e-6, atol=1e-6, rtol=1e-5)
