"""KFAC on ``nn.MultiheadAttention``'s projections and a learned position (issue 39, item 3): the in-projection
(``in_proj_weight``/``in_proj_bias``) and ``out_proj`` are Kronecker blocks of linear layers shared over the
positions, KFAC-expand and KFAC-reduce (Eschenhagen et al. 2023), and the position takes the exact diagonal from
the same passes.

References, independent of ntkgp's recording: the attention written out by hand (:func:`manual`: the
projections' outputs perturbed by zero tensors, checked equal to torch's ``nn.MultiheadAttention``), its per-position
output Jacobians :math:`J_{nt} = \\partial f_n / \\partial z_{nt}` by ``torch.func.jacrev``, and the factors'
definitions written out (:func:`reference_factors`). float64 to 1e-10 relative (the same sums in another order);
a float32 network against its float64 copy within an error model (each factor entry rounded by at most
r·ε·Σ|a||a|ᵀ, resp. r·ε·Σ|J|ᵀ|Λ||J|, with r = tests.helpers.float32_roundings + 6 for attention's two products
and softmax, forward and back).
"""

import copy
import math

import pytest
import torch
from torch import nn
from torch.func import jacrev

from ntkgp.laplace import PassOptions, compute_curvature, laplace_posterior
from ntkgp.likelihoods import SoftmaxLikelihood
from tests.helpers import brute_jacobian, float32_roundings

D, T, C, H = 4, 3, 3, 2


class Attention(nn.Module):
    """A learned position added to the inputs, one ``nn.MultiheadAttention`` with padded keys (first feature above
    0.8, never the first position), mean pooling, a linear head; inputs flat ``(N, T·D)``."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.position = nn.Parameter(0.3 * torch.randn(T, D))
        self.attention = nn.MultiheadAttention(D, H, batch_first=batch_first)
        self.head = nn.Linear(D, C)

    def padding(self, h):
        mask = h[..., 0] > 0.8
        mask[:, 0] = False
        return mask

    def forward(self, x):
        h = x.view(-1, T, D) + self.position
        mask = self.padding(h)
        h = h if self.batch_first else h.transpose(0, 1)
        h = self.attention(h, h, h, key_padding_mask=mask)[0]
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head(h.mean(dim=1))


def build(batch_first: bool = True, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    net = Attention(batch_first).to(dtype).eval()
    with torch.no_grad():
        net.attention.in_proj_bias.uniform_(-0.5, 0.5)
        net.attention.out_proj.bias.uniform_(-0.5, 0.5)
    return net


def data(n: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, T * D, generator=gen, dtype=dtype), torch.randint(0, C, (n,), generator=gen)


def manual(net, x, d_in, d_out):
    """The network by hand, the in-projection's output ``(N, T, 3D)`` and the out-projection's ``(N, T, D)``
    perturbed by ``d_in``, ``d_out``; also returns both projections' inputs."""
    att = net.attention
    h = x.view(-1, T, D) + net.position
    z = h @ att.in_proj_weight.T + att.in_proj_bias + d_in
    q, k, v = (t.reshape(-1, T, H, D // H).transpose(1, 2) for t in z.split(D, dim=-1))  # (N, H, T, D/H)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
    scores = scores.masked_fill(net.padding(h)[:, None, None, :], float("-inf"))
    heads = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(-1, T, D)
    o = heads @ att.out_proj.weight.T + att.out_proj.bias + d_out
    return net.head(o.mean(dim=1)), h, heads


def reference_factors(net, x, approximation: str):
    """Per projection (``"attention"``, ``"attention.out_proj"``) the factors by their definitions:
    expand :math:`A = \\sum_{nt} \\bar a \\bar a^\\top`, :math:`G = (NT)^{-1} \\sum_{nt} J_{nt}^\\top \\Lambda_n J_{nt}`;
    reduce :math:`A = \\sum_n \\bar a_n \\bar a_n^\\top` (:math:`a_n` the mean over the positions),
    :math:`G = N^{-1} \\sum_n (\\sum_t J_{nt})^\\top \\Lambda_n (\\sum_t J_{nt})`; and the same sums of absolute
    values (the float32 bounds)."""
    n = x.shape[0]
    with torch.no_grad():
        zero_in, zero_out = torch.zeros(n, T, 3 * D, dtype=x.dtype), torch.zeros(n, T, D, dtype=x.dtype)
        f, a_in, a_out = manual(net, x, zero_in, zero_out)
        torch.testing.assert_close(f, net(x), rtol=1e-12, atol=1e-12)  # the hand-written network is torch's
        p = torch.softmax(f, dim=-1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    out = {}
    for name, a, arg in (("attention", a_in, 1), ("attention.out_proj", a_out, 2)):
        def fn(delta, arg=arg):
            args = [zero_in, zero_out]
            args[arg - 1] = delta
            return manual(net, x, *args)[0]

        jac = jacrev(fn)(zero_in if arg == 1 else zero_out)  # (N, C, N, T, d)
        jac = torch.stack([jac[i, :, i] for i in range(n)]).permute(0, 2, 1, 3)  # (N, T, C, d)
        a_bar = torch.cat([a, torch.ones(n, T, 1, dtype=a.dtype)], dim=-1)  # (N, T, d_a)
        if approximation == "reduce":
            a_bar, jac = a_bar.mean(dim=1, keepdim=True), jac.sum(dim=1, keepdim=True)
        count = a_bar.shape[0] * a_bar.shape[1]
        a_fac = torch.einsum("nti,ntj->ij", a_bar, a_bar)
        g_fac = torch.einsum("ntca,ncd,ntdb->ab", jac, lam, jac) / count
        a_abs = torch.einsum("nti,ntj->ij", a_bar.abs(), a_bar.abs())
        g_abs = torch.einsum("ntca,ncd,ntdb->ab", jac.abs(), lam.abs(), jac.abs()) / count
        out[name] = tuple(t.detach() for t in (a_fac, g_fac, a_abs, g_abs))
    return out


def blocks_of(curvature):
    return {b.module: b for b in curvature.blocks}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("approximation", ["expand", "reduce"])
def test_attention_factors_equal_their_definitions(batch_first, approximation):
    net = build(batch_first)
    x, y = data(7)
    curvature = compute_curvature(net, x, y, SoftmaxLikelihood(num_classes=C), structure="kfac", batch_size=4,
                                  kfac_approximation=approximation, progress=False)
    blocks = blocks_of(curvature)
    assert {"attention", "attention.out_proj", "head"} <= set(blocks)
    assert curvature.diagonal_names == ["position"]
    assert blocks["attention"].weight == "attention.in_proj_weight"
    for name, (a_ref, g_ref, _, _) in reference_factors(net, x, approximation).items():
        torch.testing.assert_close(blocks[name].input_factor, a_ref, rtol=1e-10, atol=1e-10 * a_ref.abs().max())
        g = blocks[name].output_factors.sum(dim=0)
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10 * g_ref.abs().max())


def test_position_takes_the_exact_ggn_diagonal():
    """The position's diagonal from the pass's own gradients equals diag(Σ_n J_nᵀ Λ_n J_n) of autograd's Jacobian."""
    net = build()
    x, y = data(6)
    likelihood = SoftmaxLikelihood(num_classes=C)
    curvature = compute_curvature(net, x, y, likelihood, structure="kfac", progress=False)
    jac, names = brute_jacobian(net, x)
    assert names[0] == "position"
    with torch.no_grad():
        p = torch.softmax(net(x), dim=-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    rows = jac[:, : T * D].reshape(x.shape[0], C, T * D)
    reference = torch.einsum("ncp,ncd,ndp->p", rows, lam, rows)
    diagonal = curvature.dense(likelihood).diagonal()[: T * D]
    torch.testing.assert_close(diagonal, reference, rtol=1e-10, atol=1e-12)


def test_float32_factors_agree_with_their_float64_copy():
    net64 = build()
    net32 = copy.deepcopy(net64).float()
    x, y = data(7)
    likelihood = SoftmaxLikelihood(num_classes=C)
    b64 = blocks_of(compute_curvature(net64, x, y, likelihood, structure="kfac", progress=False))
    b32 = blocks_of(compute_curvature(net32, x.float(), y, likelihood, structure="kfac", progress=False))
    eps = torch.finfo(torch.float32).eps
    r = float32_roundings(net64) + 6 + math.log2(x.shape[0] * T)  # the sums over N·T locations
    for name, (_, _, a_abs, g_abs) in reference_factors(net64, x, "expand").items():
        assert ((b32[name].input_factor.double() - b64[name].input_factor).abs() <= r * eps * a_abs).all()
        g32, g64 = b32[name].output_factors.sum(dim=0).double(), b64[name].output_factors.sum(dim=0)
        assert ((g32 - g64).abs() <= r * eps * g_abs + 1e-30).all()


def test_kfac_posterior_predicts_with_the_attention_blocks():
    """The posterior rebuilds the attention blocks' layers (by name) and its GLM covariance at test points equals
    J Σ Jᵀ with Σ its own dense precision inverted and J autograd's Jacobian."""
    net = build()
    x, y = data(6)
    posterior = laplace_posterior(net, x, y, SoftmaxLikelihood(num_classes=C), structure="kfac",
                                  prior_precision=1.0, options=PassOptions(progress=False))
    assert {b.layer.name for b in posterior.blocks} >= {"attention", "attention.out_proj"}
    x_test = data(9)[0][6:]
    jac, _ = brute_jacobian(net, x_test)
    jac = jac.reshape(3, C, -1)
    reference = jac @ torch.linalg.inv(posterior.dense_precision()) @ jac.mT
    torch.testing.assert_close(posterior.glm_covariance(x_test), reference, rtol=1e-9, atol=1e-12)


def test_diagonal_ggn_of_a_transformer_is_exact():
    """The diagonal GGN takes the projections' rows from the same passes (Σ_t Γ_t ā_tᵀ) and the position's from its
    output gradients: diag(Σ_n J_nᵀ Λ_n J_n) of autograd's Jacobian, every parameter."""
    net = build(batch_first=False)
    x, y = data(5)
    likelihood = SoftmaxLikelihood(num_classes=C)
    curvature = compute_curvature(net, x, y, likelihood, structure="diag_ggn", progress=False)
    jac, _ = brute_jacobian(net, x)
    with torch.no_grad():
        p = torch.softmax(net(x), dim=-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    rows = jac.reshape(x.shape[0], C, -1)
    reference = torch.einsum("ncp,ncd,ndp->p", rows, lam, rows)
    diagonal = curvature.dense(likelihood).diagonal()
    torch.testing.assert_close(diagonal, reference, rtol=1e-10, atol=1e-12 * reference.abs().max())
