"""The curvature on the engine's shared layer features: convolutions with stride/padding/dilation against
brute force, one safety rule for both, input validation before the pass, and the renamed vocabulary."""

from __future__ import annotations

import math
from unittest import mock

import gpytorch
import pytest
import torch
from torch import nn

from ntkgp.laplace.weight_space import KroneckerGGN, compute_curvature
from ntkgp.laplace.ggn.data_pass import DataPass
from ntkgp.laplace.weight_space.layers.curvature_layers import structured_layers, usable_layers
from ntkgp.likelihoods import SoftmaxLikelihood, gradient, hessian
from ntkgp.ntk import NTKEngine, resolve_groups
from tests.helpers import (
    EPS32,
    assert_unchanged,
    brute_jacobian,
    float32_roundings,
    mlp,
    rel_err,
    small_cnn,
    snapshot,
)

CONV = {"kernel_size": 2, "stride": 2, "padding": 1, "dilation": 2}


class StridedNet(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, bias=bias, **CONV)  # 6x6 input -> 3x3 output
        self.head = nn.Linear(27, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def strided_net(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return StridedNet(bias).double().eval()


def brute_diagonals(net, x, y, lik):
    jac, _ = brute_jacobian(net, x)
    f = net(x).detach()
    jn = jac.reshape(f.shape[0], f.shape[1], -1)
    ggn = torch.einsum("ncp,ncd,ndp->p", jn, hessian(lik, f, y).detach(), jn)
    ef = torch.einsum("nc,ncp->np", gradient(lik, f, y).detach(), jn).square().sum(0)
    return ggn, ef


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("structure", ["diag_ggn", "diag_ef"])
def test_strided_dilated_padded_conv_diagonals_equal_brute_force(bias, structure):
    net = strided_net(bias)
    lik = SoftmaxLikelihood(num_classes=3, temperature=0.9).double()
    torch.manual_seed(1)
    x, y = torch.randn(5, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    before = snapshot(net)
    curv = compute_curvature(net, x, y, lik, structure, batch_size=2)
    assert_unchanged(net, before)
    ggn, ef = brute_diagonals(net, x, y, lik)
    assert rel_err(curv.diagonal(lik).detach(), ggn if structure == "diag_ggn" else ef) < 1e-12


def explicit_patches(x: torch.Tensor) -> torch.Tensor:
    """(n, locations, C_in·k·k) patches of CONV by zero padding and loops (independent of unfold)."""
    k, s, p, d = CONV["kernel_size"], CONV["stride"], CONV["padding"], CONV["dilation"]
    padded = nn.functional.pad(x, (p, p, p, p))
    out = (x.shape[-1] + 2 * p - d * (k - 1) - 1) // s + 1
    rows = []
    for r in range(out):
        for c in range(out):
            window = padded[:, :, r * s : r * s + d * (k - 1) + 1 : d, c * s : c * s + d * (k - 1) + 1 : d]
            rows.append(window.reshape(x.shape[0], -1))
    return torch.stack(rows, 1)


def test_kfac_factors_of_a_strided_conv_equal_explicit_loops():
    net = strided_net()
    lik = SoftmaxLikelihood(num_classes=3).double()
    torch.manual_seed(2)
    x, y = torch.randn(4, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    curv = compute_curvature(net, x, y, lik, "kfac", batch_size=3)
    assert isinstance(curv, KroneckerGGN)
    patches = explicit_patches(x)  # (n, 9, 8)
    a_bar = torch.cat([patches, torch.ones_like(patches[..., :1])], -1)
    a_ref = torch.einsum("nti,ntj->ij", a_bar, a_bar)
    f = net(x).detach()
    evals, evecs = torch.linalg.eigh(hessian(lik, f, y).detach())
    root = evecs @ torch.diag_embed(evals.clamp_min(0).sqrt()) @ evecs.mT
    g_ref = 0
    for i in range(4):
        z = net.conv(x[i : i + 1])
        out = net.head(torch.tanh(z).flatten(1))[0]
        for m in range(3):
            (gz,) = torch.autograd.grad(out @ root[i, :, m], z, retain_graph=True)
            per_location = gz[0].reshape(3, -1)  # (d_out, 9)
            g_ref = g_ref + per_location @ per_location.T
    conv = curv.blocks[0]
    assert rel_err(conv.input_factor, a_ref) < 1e-12
    assert rel_err(conv.output_factor(curv.scale(lik)).detach(), g_ref / (9 * 4)) < 1e-12
    # the log-determinant through linear_operator's Kronecker operators equals a dense slogdet
    delta = torch.tensor([0.7, 1.9], dtype=torch.float64)
    dense = curv.dense(lik) + torch.diag(delta[resolve_groups(net).column_groups()])
    assert torch.allclose(curv.log_det(delta, lik), torch.linalg.slogdet(dense)[1], rtol=1e-11)


class OutsideUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) + nn.functional.linear(x, self.fc.weight.flip(0)))


def test_one_safety_rule_for_engine_and_curvature():
    """A weight used outside its module's forward is caught by the probe in both consumers."""
    torch.manual_seed(0)
    net = OutsideUse().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    lik = SoftmaxLikelihood(num_classes=2).double()
    data = DataPass.start(net, lik)
    layers = usable_layers(data.core, structured_layers(net, data.core.groups, strict=False), x[:1], strict=False)
    assert [layer.name for layer in layers] == list(NTKEngine(net).plan(x).names) == ["head"]
    curv = compute_curvature(net, x, y, lik, "diag_ggn")
    assert rel_err(curv.diagonal(lik).detach(), brute_diagonals(net, x, y, lik)[0]) < 1e-12
    with pytest.raises(ValueError, match="KFAC.*Jacobian of layer 'fc'"):
        compute_curvature(net, x, y, lik, "kfac")
    cnn = small_cnn()
    data = DataPass.start(cnn, lik)
    x_img = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    layers = usable_layers(data.core, structured_layers(cnn, data.core.groups, strict=False), x_img[:1], strict=False)
    assert [layer.name for layer in layers] == list(NTKEngine(cnn).plan(x_img).names) == ["conv", "head"]


def test_data_are_validated_before_the_pass():
    net = mlp(d_out=3)
    lik = SoftmaxLikelihood(num_classes=3).double()
    x, y = torch.randn(9, 3, dtype=torch.float64), torch.randint(0, 3, (9,))
    never = mock.patch.object(DataPass, "unit_hessian_sqrt", side_effect=AssertionError("the pass started"))
    with never:
        bad = x.clone()
        bad[8, 0] = float("nan")  # the last row, in the last batch
        with pytest.raises(ValueError, match="x contains NaN"):
            compute_curvature(net, bad, y, lik, "kfac", batch_size=2)
        bad_y = y.clone()
        bad_y[8] = 7
        with pytest.raises(ValueError, match="y"):
            compute_curvature(net, x, bad_y, lik, "kfac", batch_size=2)
        with pytest.raises(ValueError, match="batch_size"):
            compute_curvature(net, x, y, lik, "diag_ggn", batch_size=0)
        with pytest.raises(ValueError, match="x of shape"):
            compute_curvature(net, torch.randn(9, 4, dtype=torch.float64), y, lik, "diag_ef")
        with pytest.raises(ValueError, match="structure must be one of"):
            compute_curvature(net, x, y, lik, "diagonal")



def test_float32_kfac_agrees_with_float64():
    lik64 = SoftmaxLikelihood(num_classes=3).double()
    lik32 = SoftmaxLikelihood(num_classes=3)
    x, y = torch.randn(20, 3, dtype=torch.float64), torch.randint(0, 3, (20,))
    c64 = compute_curvature(mlp(d_out=3), x, y, lik64, "kfac")
    c32 = compute_curvature(mlp(d_out=3, dtype=torch.float32), x.float(), y, lik32, "kfac")
    v32 = c32.log_marginal_likelihood(0.5, lik32)
    assert v32.dtype == torch.float32
    v64 = c64.log_marginal_likelihood(0.5, lik64).item()
    # Error model (ε = ε32, r from float32_roundings; first order, a worst case over the roundings' directions, so
    # any CPU and thread count), measured on the float64 network (the same float32-exact weights):
    # log q = log p(y|f) − ½δ‖θ‖² − ½ log|H + δI| + ½P log δ, with H the dense Kronecker GGN.
    # - data fit: ‖g‖‖Δf‖, g = ∇f log p, |Δf_n| ≤ rε(|f_n| + ‖J_n‖‖θ‖) (float32_roundings);
    # - each Kronecker factor Σ_n a_n a_nᵀ (activations, or Λ-scaled backpropagated rows) is formed from rows within
    #   rε of their norm (the Jacobian row of a layer is a_n ⊗ b_n) summed over N (log2 N roundings), so by
    #   Cauchy–Schwarz ‖ΔA‖_F ≤ (2r + log2 N)ε tr A, and ‖Δ(A ⊗ G)‖_F ≤ 2(2r + log2 N)ε tr(A ⊗ G); the softmax
    #   sites move with f (8 max|Δf| relatively, float32_precision_error): ‖ΔH‖_F ≤ (2(2r + log2 N)ε +
    #   8 max|Δf|) tr H, and |Δ log|H + δI|| ≤ ‖(H + δI)⁻¹‖_F ‖ΔH‖_F;
    # - the P terms log(λ + δ) (3 roundings each) and their sum: ε(P + 3)Σ|log(λ_k + δ)| + 3εP; the prior's
    #   ½δ‖θ‖² summed over P squares: (P + 2)ε ½δ‖θ‖².
    net64 = mlp(d_out=3)
    j, _ = brute_jacobian(net64, x)
    theta = torch.cat([q.detach().reshape(-1) for q in net64.parameters()])
    r, eps, delta, count = float32_roundings(net64), EPS32, 0.5, theta.numel()
    f = net64(x).detach().requires_grad_()
    (g,) = torch.autograd.grad(torch.distributions.Categorical(logits=f).log_prob(y).sum(), f)
    df = r * eps * (f.detach().abs().reshape(-1) + j.norm(dim=-1) * theta.norm())
    h = c64.dense(lik64).detach()
    shifted = h + delta * torch.eye(count, dtype=torch.float64)
    d_h = (2 * (2 * r + math.log2(x.shape[0])) * eps + 8 * df.max().item()) * torch.diagonal(h).sum().item()
    logs = torch.linalg.eigvalsh(shifted).log().abs()
    bound = (g.norm().item() * df.norm().item()
             + 0.5 * torch.linalg.matrix_norm(torch.linalg.inv(shifted)).item() * d_h
             + 0.5 * eps * ((count + 3) * logs.sum().item() + 3 * count)
             + (count + 2) * eps * 0.5 * delta * theta.square().sum().item())
    assert abs(v32.item() - v64) <= bound, (v32.item(), v64, bound)
    assert bound < 1e-2 * abs(v64)  # a 1e-2 bug still fails


class WidthByBatch(nn.Module):
    """Three outputs for one example (the fit check's and the layer plan's probe), two for a larger batch."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        out = self.head(x)
        return out if x.shape[0] == 1 else out[:, :2]


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn"])
def test_a_batch_with_other_outputs_than_the_first_example_is_refused_with_tensor_data(structure):
    torch.manual_seed(0)
    net = WidthByBatch().double().eval()
    lik = SoftmaxLikelihood(num_classes=3).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    # refused when the network is first probed: 3 outputs for one example, 2 for a batch
    with pytest.raises(ValueError, match=r"outputs of shape \(1, 3\) for one example but \(2, 2\) for a batch"):
        compute_curvature(net, x, y, lik, structure, batch_size=2)


def test_tensor_data_is_validated_once_and_its_batches_equal_a_loaders():
    """Tensor data: the targets validated once, in full, and the batches sliced from the checked tensors (inputs
    that preparing copies, float32 into a float64 network, prepared batch by batch); a loader's batches validated
    one by one. All three give the same factors and evidence, bit for bit (the same products in the same
    order), and the factors are the explicit sums of their definition."""
    net = mlp(d_out=3)
    lik = SoftmaxLikelihood(num_classes=3).double()
    torch.manual_seed(2)
    x, y = torch.randn(9, 3, dtype=torch.float64).float().double(), torch.randint(0, 3, (9,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    from ntkgp.laplace.ggn import data_pass

    results = []
    for data, targets, calls in ((x, y, 1), (loader, None, 3), (x.float(), y, 1)):
        with mock.patch.object(data_pass, "validate_targets", wraps=data_pass.validate_targets) as spy:
            results.append(compute_curvature(net, data, targets, lik, "kfac", batch_size=4))
        assert spy.call_count == calls
    first = results[0].blocks[0]
    x1 = torch.cat([x, torch.ones(9, 1, dtype=x.dtype)], 1)
    assert rel_err(first.input_factor, x1.T @ x1) < 1e-14  # A of the first layer: Σ x̄ x̄ᵀ
    # three input paths (tensor, loader, converted copy) to the same float64 sums over N = 9 points: in any order
    # they agree to 9 ε Σ|terms| (~2e-15 relative); the evidence then to a few ε of its terms
    for other in results[1:]:
        for a, b in zip(results[0].blocks, other.blocks):
            assert rel_err(a.input_factor, b.input_factor) < 1e-13 and rel_err(a.output_factors, b.output_factors) < 1e-13
        value = results[0].log_marginal_likelihood(0.7, lik)
        assert (value - other.log_marginal_likelihood(0.7, lik)).abs() < 1e-12 * (1 + value.abs())
