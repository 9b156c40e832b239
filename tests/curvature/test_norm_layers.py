"""Normalization layers' affine parameters and embedding tables from the curvature pass's own output gradients
(ntkgp.ntk.norm_features, ntkgp.laplace.weight_space.layers.norm_layers): the diagonal GGN, the diagonal EF and KFAC's exact
diagonal part against the dense GGN / EF of brute-force autograd Jacobians (tests/helpers.py), with no per-example
backward pass for these layers; the fallbacks (a weight also used outside the layer's forward, BatchNorm in
training mode, an embedding with max_norm) take the generic route and stay exact."""

import copy
import math

import torch
from torch import nn

from ntkgp.laplace import compute_curvature
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.ntk.network import NetworkCore
from ntkgp.ntk.norm_features import EmbeddingLayer, NormLayer, elementwise_candidates, elementwise_layers
from tests.helpers import dense_laplace, reference_log_prob

C = 3


class NormNet(nn.Module):
    """Conv → BatchNorm2d → GroupNorm → Linear → LayerNorm → BatchNorm1d → Linear; ``leak`` also uses the
    LayerNorm's weight outside its forward (the structured gradient is then wrong: the probe must catch it)."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.lin = nn.Linear(4 * 4 * 4, 6)
        self.ln = nn.LayerNorm(6)
        self.bn1 = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, C)
        self.leak = leak

    def forward(self, x):
        h = torch.tanh(self.gn(self.bn(self.conv(x)))).flatten(1)
        h = self.ln(self.lin(h))
        if self.leak:
            h = h + self.ln.weight.sum()
        return self.out(torch.tanh(self.bn1(h)))


class TokenNet(nn.Module):
    """Embedding (with a padding token) → LayerNorm on the sequence → Linear on the sequence → mean."""

    def __init__(self, max_norm: float | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 4, padding_idx=0, max_norm=max_norm)
        self.ln = nn.LayerNorm(4)
        self.lin = nn.Linear(4, C)

    def forward(self, ids):
        return self.lin(torch.tanh(self.ln(self.embed(ids)))).mean(dim=1)


def norm_net(leak: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = NormNet(leak).double()
    with torch.no_grad():  # statistics and affine parameters away from their defaults (1, 0)
        for m in net.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)):
                m.weight.normal_()
                m.bias.normal_()
    return net.eval()


def token_data():
    ids = torch.randint(0, 9, (6, 5), generator=torch.Generator().manual_seed(2))
    ids[0, 0] = 0  # a padding token
    ids[1, :3] = 4  # a token repeated within one example
    return ids


def elementwise_names(net, x):
    core = NetworkCore(net)
    return [n for layer in elementwise_layers(core, core.names, core.prepare(x[:1])) for n in layer.parameter_names]


def generic_calls(monkeypatch):
    """The parameter names passed to the generic per-example route, recorded."""
    asked: list[str] = []
    original = NetworkCore.per_example_vjps

    def spy(self, x, cotangents, names):
        asked.extend(names)
        return original(self, x, cotangents, names)

    monkeypatch.setattr(NetworkCore, "per_example_vjps", spy)
    return asked


def check_diagonal(net, x, y, structures, monkeypatch, routed):
    likelihood = SoftmaxLikelihood(num_classes=C)
    log_prob = lambda f, t: reference_log_prob("softmax", f, t)  # noqa: E731
    names = [n for n, _ in net.named_parameters()]
    sizes = [p.numel() for p in net.parameters()]
    starts = dict(zip(names, [0] + torch.tensor(sizes).cumsum(0).tolist()))
    asked_all, dense = [], {}
    for structure in structures:
        asked = generic_calls(monkeypatch)
        kind = "ef" if structure == "diag_ef" else "ggn"
        if kind not in dense:
            dense[kind] = dense_laplace(net, x, y, log_prob, torch.ones(sum(sizes), dtype=torch.float64),
                                        curvature=kind)["H"].diagonal() - 1.0
        exact = dense[kind]
        got = compute_curvature(net, x, y, likelihood, structure=structure, batch_size=4,
                                progress=False).dense(likelihood).diagonal()
        assert not set(asked) & set(routed), structure  # no per-example pass for the structured layers
        compared = routed if structure == "kfac" else names
        for name in compared:  # KFAC: its exact diagonal part only (the blocks are Kronecker approximations)
            part = slice(starts[name], starts[name] + dict(zip(names, sizes))[name])
            torch.testing.assert_close(got[part], exact[part], rtol=1e-10, atol=1e-12, msg=f"{structure} {name}")
        asked_all += asked
    return asked_all


def test_normalization_layers_take_the_structured_route_and_match_the_dense_ggn(monkeypatch):
    net = norm_net()
    x = torch.randn(7, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, C, (7,), generator=torch.Generator().manual_seed(3))
    routed = elementwise_names(net, x)
    assert routed == ["bn.weight", "bn.bias", "gn.weight", "gn.bias", "ln.weight", "ln.bias", "bn1.weight", "bn1.bias"]
    check_diagonal(net, x, y, ["diag_ggn", "kfac"], monkeypatch, routed)  # diag_ef: the embedding test


def test_embeddings_take_the_one_hot_route_with_padding_and_repeated_tokens(monkeypatch):
    torch.manual_seed(0)
    net = TokenNet().double().eval()
    ids = token_data()
    y = torch.randint(0, C, (6,), generator=torch.Generator().manual_seed(3))
    routed = elementwise_names(net, ids)
    assert routed == ["embed.weight", "ln.weight", "ln.bias"]
    check_diagonal(net, ids, y, ["diag_ggn", "kfac", "diag_ef"], monkeypatch, routed)


def test_unsafe_layers_fall_back_to_the_generic_route_and_stay_exact(monkeypatch):
    """A LayerNorm weight also used outside its forward fails the probe; BatchNorm in training mode and an
    embedding with max_norm are not candidates; their parameters take the per-example route, still exact."""
    net = norm_net(leak=True)
    x = torch.randn(5, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, C, (5,), generator=torch.Generator().manual_seed(3))
    routed = elementwise_names(net, x)
    assert "ln.weight" not in routed and "bn.weight" in routed
    assert "ln.weight" in check_diagonal(net, x, y, ["diag_ggn"], monkeypatch, routed)  # the spy sees the route
    names = [n for n, _ in net.named_parameters()]
    trained = [layer.name for layer in elementwise_candidates(norm_net().train(), names)]
    assert trained == ["gn", "ln"]  # batch statistics: the examples of a batch interact
    renormed = TokenNet(max_norm=1.0).double()
    assert elementwise_candidates(renormed, ["embed.weight"]) == []


def test_structured_rows_equal_autograd_per_example_with_any_number_of_columns():
    """The rows J_nᵀ u_nm of NormLayer / EmbeddingLayer from the recorded features, for M = 4 random cotangent
    columns, against autograd's per-example vector-Jacobian products (one backward pass per example and column)."""
    torch.manual_seed(0)
    for net, x in ((norm_net(), torch.randn(3, 2, 4, 4, dtype=torch.float64)),
                   (TokenNet().double().eval(), token_data()[:3])):
        core = NetworkCore(net)
        layers = elementwise_layers(core, core.names, core.prepare(x[:1]))
        u = torch.randn(x.shape[0], C, 4, dtype=torch.float64)
        features = core.features(core.prepare(x), layers, u)
        params = dict(net.named_parameters())
        for layer in layers:
            rows = layer.jacobians(features.inputs[layer.name], features.grads[layer.name])
            assert isinstance(layer, (NormLayer, EmbeddingLayer))
            for n in range(x.shape[0]):
                for m in range(4):
                    f = net(x[n : n + 1])[0]
                    grads = torch.autograd.grad(f, [params[k] for k in rows], u[n, :, m])
                    for (name, value), g in zip(rows.items(), grads):
                        torch.testing.assert_close(value[n, m], g.reshape(-1), rtol=1e-10, atol=1e-12)


def test_float32_network_agrees_with_its_float64_copy():
    """Each diagonal entry D_p = Σ_nm r_nmp² is a sum of squares of rows r_nmp = Σ_t x̂_t Γ_t (or Σ_t Γ_t): each row is
    rounded by at most k·ε·Σ_t |x̂_t Γ_t| (k = 2L + 2 + log2 T roundings: L parametrized layers forward and back,
    the normalization and the sum over T locations), so |ΔD_p| ≤ 3k·ε·Σ_nm (Σ_t |x̂_t Γ_t|)² — the float64
    features' absolute row sums, measured below (the condition of each entry)."""
    net64 = norm_net()
    net32 = copy.deepcopy(net64).float()
    x = torch.randn(6, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, C, (6,), generator=torch.Generator().manual_seed(3))
    likelihood = SoftmaxLikelihood(num_classes=C)
    d64 = compute_curvature(net64, x, y, likelihood, structure="diag_ggn", progress=False).dense(likelihood).diagonal()
    d32 = compute_curvature(net32, x.float(), y, likelihood, structure="diag_ggn", progress=False).dense(
        likelihood).diagonal()
    core = NetworkCore(net64)
    layers = elementwise_layers(core, core.names, core.prepare(x[:1]))
    f = net64(x).detach()
    p = torch.softmax(f, dim=-1)
    w, v = torch.linalg.eigh(torch.diag_embed(p) - p[:, :, None] * p[:, None, :])
    root = v * w.clamp_min(0).sqrt().unsqueeze(1)  # a root of Λ_n: the bound needs |J_nᵀ L| of any root
    features = core.features(core.prepare(x), layers, root)
    names = list(core.names)
    starts = dict(zip(names, [0] + torch.tensor(core.numels).cumsum(0).tolist()))
    layers_count = sum(1 for m in net64.modules() if any(True for _ in m.parameters(recurse=False)))
    for layer in layers:
        a, g = features.inputs[layer.name], features.grads[layer.name]
        absolute = layer.jacobians(a.abs(), g.abs())  # Σ_t |x̂_t Γ_t|, Σ_t |Γ_t|
        k = 2 * layers_count + 2 + math.log2(a.shape[-1])
        for name, rows in absolute.items():
            bound = 3 * k * torch.finfo(torch.float32).eps * rows.square().sum(dim=(0, 1))
            part = slice(starts[name], starts[name] + rows.shape[-1])
            assert ((d32[part].double() - d64[part]).abs() <= bound + 1e-30).all(), name
