"""Integer token ids and structured outputs through every entry point, against dense ``torch.func.jacrev``.

The networks: an ``nn.Embedding`` → mean-pool → ``nn.Linear`` model on integer ids, and a model taking
``{"ids": ..., "mask": ...}`` and returning ``{"logits": ...}`` (chosen with ``output="logits"``). The references
are dense Jacobians of the network by ``jacrev`` and the closed-form Gaussian posteriors built from them.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import ntkgp
from ntkgp.laplace import laplace_posterior, PassOptions, predict
from ntkgp.ntk import NTKEngine
from ntkgp.ntk.inputs import cat, check_structure, num_rows, rows, take
from ntkgp.ntk.outputs import with_output
from ntkgp.fsvi import FSVIOptions
from ntkgp.training import HyperparameterSchedule

VOCAB, LENGTH = 7, 5
NOISE = 0.1  # the Gaussian likelihood's noise, read back from it in regression_data()


class BagOfEmbeddings(nn.Module):
    """Token ids ``(N, L)`` → mean of their embeddings → linear."""

    def __init__(self, outputs: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.out = nn.Linear(4, outputs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(1))


class MaskedDictModel(BagOfEmbeddings):
    """``{"ids", "mask"}`` → ``{"logits": ..., "pooled": ...}`` (a Hugging Face-like model)."""

    def forward(self, batch: dict) -> dict:
        e = self.emb(batch["ids"])
        m = batch["mask"].unsqueeze(-1).to(e.dtype)
        pooled = (e * m).sum(1) / m.sum(1).clamp_min(1)
        return {"logits": self.out(pooled), "pooled": pooled}


class TupleModel(BagOfEmbeddings):
    """Returns ``(outputs, auxiliary)``."""

    def forward(self, ids: torch.Tensor) -> tuple:
        return super().forward(ids), ids.shape[0]


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))


def dense_jacobian(net: nn.Module, x, output=None) -> torch.Tensor:
    """``J`` as ``(N·C, P)`` (interleaved rows, columns in ``named_parameters`` order), by ``jacrev``."""
    params = {k: v.detach() for k, v in net.named_parameters()}

    def f(p):
        out = functional_call(net, p, (x,))
        return out if output is None else out[output]

    jac = jacrev(f)(params)
    n, c = f(params).shape
    return torch.cat([jac[k].reshape(n * c, -1) for k in params], dim=-1)


def gaussian_posterior_variance(j_train: torch.Tensor, j_test: torch.Tensor, noise: float, delta: float):
    """Diagonal of ``J_* (JᵀJ/σ² + δI)⁻¹ J_*ᵀ``, the linearized network's posterior variance of ``f``."""
    h = j_train.T @ j_train / noise + delta * torch.eye(j_train.shape[1], dtype=j_train.dtype)
    return (j_test @ torch.linalg.solve(h, j_test.T)).diagonal()


def regression_data(n: int = 10):
    torch.manual_seed(0)
    net = BagOfEmbeddings(outputs=1).double().eval()
    x = ids(n)
    y = torch.randn(n, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.1
    global NOISE
    NOISE = likelihood.noise.item()  # 0.1 up to the float32 rounding of GPyTorch's noise bound 1e-4
    return net, x, y, likelihood


# ---------------------------------------------------------------------------------------------- the NTK
def test_ntk_kernel_on_token_ids_matches_jacrev():
    torch.manual_seed(0)
    net = BagOfEmbeddings().double().eval()
    x1, x2 = ids(6), ids(4, seed=1)
    kernel = ntkgp.NTKKernel(net, prior_precision=2.0, prior_structure="network")
    gram = kernel(x1, x2).to_dense()
    expected = dense_jacobian(net, x1) @ dense_jacobian(net, x2).T / 2.0
    torch.testing.assert_close(gram, expected, rtol=1e-10, atol=1e-12)
    assert x1.dtype == torch.int64  # the user's ids are never converted


@pytest.mark.parametrize("strategy", ["auto", "contraction"])
def test_dict_output_selected_by_output_matches_jacrev(strategy):
    torch.manual_seed(0)
    net = MaskedDictModel().double().eval()
    x = ids(5)
    view = with_output(lambda_model := TupleModel().double().eval(), 0)
    kernel = ntkgp.NTKKernel(lambda_model, prior_structure="network", strategy=strategy, output=0)
    torch.testing.assert_close(kernel(x).to_dense(), dense_jacobian(lambda_model, x, 0) @ dense_jacobian(
        lambda_model, x, 0).T, rtol=1e-10, atol=1e-12)
    assert dict(view.named_parameters()) == dict(lambda_model.named_parameters())  # same names, same tensors
    # a dict input with a dict output: the engine's Jacobian and outputs
    mask = torch.rand(5, LENGTH, generator=torch.Generator().manual_seed(2)) > 0.3
    batch = {"ids": x, "mask": mask}
    engine = NTKEngine(with_output(net, "logits"), strategy=strategy)
    torch.testing.assert_close(engine.outputs(batch), net(batch)["logits"], rtol=1e-12, atol=1e-12)


def test_float32_network_on_token_ids_agrees_with_its_float64_copy():
    torch.manual_seed(0)
    net32 = BagOfEmbeddings().eval()
    net64 = BagOfEmbeddings().double().eval()
    net64.load_state_dict(net32.state_dict())
    x = ids(8)
    k32 = ntkgp.NTKKernel(net32, prior_structure="network")(x).to_dense()
    k64 = ntkgp.NTKKernel(net64, prior_structure="network")(x).to_dense()
    # Error model: each Gram entry is a dot product of two Jacobian rows over P parameters, each entry a product
    # of at most 3 float32 roundings (embedding mean, linear layer): |error| ≤ (P + 3)·ε·max|K| (worst case).
    p = sum(t.numel() for t in net32.parameters())
    eps = torch.finfo(torch.float32).eps
    assert (k32.double() - k64).abs().max() <= (p + 3) * eps * k64.abs().max()


def masked_batch(n: int, seed: int = 0) -> dict:
    mask = torch.rand(n, LENGTH, generator=torch.Generator().manual_seed(seed + 100)) > 0.3
    return {"ids": ids(n, seed), "mask": mask}


@pytest.mark.parametrize("strategy", ["auto", "contraction"])
def test_engine_on_dict_inputs_matches_jacrev(strategy):
    torch.manual_seed(0)
    net = MaskedDictModel().double().eval()
    x1, x2 = masked_batch(5), masked_batch(3, seed=1)
    engine = NTKEngine(with_output(net, "logits"), prior_structure="network", strategy=strategy, chunk_size=2)
    j1, j2 = dense_jacobian(net, x1, "logits"), dense_jacobian(net, x2, "logits")
    torch.testing.assert_close(engine.group_grams(x1, x2)[0], j1 @ j2.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(engine.group_grams(x1)[0], j1 @ j1.T, rtol=1e-10, atol=1e-12)
    blocks = (j1 @ j1.T).reshape(5, 3, 5, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    torch.testing.assert_close(engine.diag_blocks(x1)[0], blocks, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(engine.jacobian(x1), j1, rtol=1e-10, atol=1e-12)
    assert x1["ids"].dtype == torch.int64 and x1["mask"].dtype == torch.bool  # the user's inputs as they were
    kernel = ntkgp.NTKKernel(net, prior_precision=2.0, prior_structure="network", strategy=strategy, output="logits")
    torch.testing.assert_close(kernel(x1, x2).to_dense(), j1 @ j2.T / 2.0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kernel(x1, diag=True), (j1 * j1).sum(-1) / 2.0, rtol=1e-10, atol=1e-12)


def test_laplace_posterior_on_dict_inputs_and_outputs_matches_dense_posterior():
    net, _, y, likelihood = regression_data()
    dict_net = MaskedDictModel(outputs=1).double().eval()
    dict_net.load_state_dict(net.state_dict())
    x, x_test = masked_batch(y.shape[0]), masked_batch(4, seed=3)
    posterior = laplace_posterior(dict_net, x, y, likelihood, structure="full_ggn", prior_precision=1.5,
                                  prior_structure="network", output="logits", options=PassOptions(batch_size=4))  # batches of a dict
    expected = gaussian_posterior_variance(dense_jacobian(dict_net, x, "logits"),
                                           dense_jacobian(dict_net, x_test, "logits"), NOISE, 1.5)
    torch.testing.assert_close(predict(posterior, x_test).f.variance, expected, rtol=1e-9, atol=1e-12)
    # KFAC (an approximation: no dense reference) runs its layer passes on the same dict batches
    kfac = laplace_posterior(dict_net, x, y, likelihood, structure="kfac", prior_precision=1.5, output="logits")
    assert bool((predict(kfac, x_test).f.variance > 0).all())


# ---------------------------------------------------------------------------------------------- the models
def test_ntkgp_predictive_on_token_ids_matches_dense_posterior():
    net, x, y, likelihood = regression_data()
    x_test = ids(4, seed=3)
    model = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=1.5, prior_structure="network",
                        predictive_mean="nn").eval()
    dist = model(x_test)
    expected = gaussian_posterior_variance(dense_jacobian(net, x), dense_jacobian(net, x_test), NOISE, 1.5)
    torch.testing.assert_close(dist.variance, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dist.mean, net(x_test).squeeze(-1).detach(), rtol=1e-12, atol=1e-12)


def test_sfr_on_token_ids_chooses_inducing_ids_from_the_data_and_matches_the_full_posterior():
    net, x, y, likelihood = regression_data()
    x_test = ids(4, seed=3)
    model = ntkgp.SFR(net, x, y, likelihood, num_inducing=x.shape[0], prior_precision=1.5,
                      prior_structure="network").eval()
    z = model.inducing_points
    assert z.dtype == x.dtype  # ids, never averaged into non-integer values
    assert all(bool((x == row).all(-1).any()) for row in z)  # every inducing input is a training input
    # Z = X (all N training inputs): the sparse posterior is the full one (docs/sfr.md)
    expected = gaussian_posterior_variance(dense_jacobian(net, x), dense_jacobian(net, x_test), NOISE, 1.5)
    torch.testing.assert_close(model(x_test).variance, expected, rtol=1e-8, atol=1e-12)


def test_laplace_posterior_on_token_ids_matches_dense_posterior():
    net, x, y, likelihood = regression_data()
    x_test = ids(4, seed=3)
    posterior = laplace_posterior(net, x, y, likelihood, structure="full_ggn", prior_precision=1.5,
                                  prior_structure="network")
    expected = gaussian_posterior_variance(dense_jacobian(net, x), dense_jacobian(net, x_test), NOISE, 1.5)
    torch.testing.assert_close(predict(posterior, x_test).f.variance, expected, rtol=1e-9, atol=1e-12)


def test_laplace_posterior_with_tuple_output():
    net, x, y, likelihood = regression_data()
    tuple_net = TupleModel(outputs=1).double().eval()
    tuple_net.load_state_dict(net.state_dict())
    posterior = laplace_posterior(tuple_net, x, y, likelihood, structure="full_ggn", prior_precision=1.5,
                                  prior_structure="network", output=0)
    expected = gaussian_posterior_variance(dense_jacobian(net, x), dense_jacobian(net, x[:3]), NOISE, 1.5)
    torch.testing.assert_close(predict(posterior, x[:3]).f.variance, expected, rtol=1e-9, atol=1e-12)


def test_fsvi_on_token_ids_takes_context_from_the_data_and_matches_jacrev():
    torch.manual_seed(0)
    net = MaskedDictModel().double().eval()
    tuple_net = TupleModel().double().eval()
    tuple_net.load_state_dict(net.state_dict())
    x, y = ids(12), torch.randint(0, 3, (12,), generator=torch.Generator().manual_seed(4))
    likelihood = ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3)
    result = ntkgp.fsvi.train_fsvi(tuple_net, x, y, likelihood, epochs=2, num_context=4, lr=1e-2, progress=False,
                                   options=FSVIOptions(output=0))
    model = result.model
    q = model.variational_distribution
    means, variances = q.means(), q.variances()
    x_test = ids(3, seed=5)
    mean_net = BagOfEmbeddings().double()
    mean_net.load_state_dict({k: means[k] for k in net.state_dict()})
    j = dense_jacobian(mean_net, x_test)  # J at the variational mean μ
    s2 = torch.cat([variances[k].reshape(-1) for k, _ in mean_net.named_parameters()])
    dist = model(x_test)
    torch.testing.assert_close(dist.variance.reshape(-1), ((j * s2) @ j.T).diagonal(), rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(dist.mean, mean_net(x_test).detach(), rtol=1e-10, atol=1e-12)


def test_train_marglik_on_token_ids_with_a_dict_output():
    torch.manual_seed(0)
    net = TupleModel().double()
    x, y = ids(16), torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(4))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    result = ntkgp.training.train_marglik(
        net, x, y, ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3), epochs=2,
        schedule=HyperparameterSchedule(burn_in=1, frequency=1, hyper_steps=2),
        progress=False, output=0,
    )
    assert torch.isfinite(torch.tensor(result.log_evidence))
    assert not torch.equal(result.prior_precision, torch.ones_like(result.prior_precision))  # δ was learned
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items())  # the user's net was trained
    assert x.dtype == torch.int64


# ---------------------------------------------------------------------------------------------- errors
def test_a_dict_or_tuple_output_without_output_is_refused_at_construction_naming_output():
    net, x, y, likelihood = regression_data()
    tuple_net = TupleModel(outputs=1).double().eval()
    with pytest.raises(ValueError, match=r"returns a tuple of 2 elements.*output="):
        ntkgp.NTKGP(tuple_net, x, y, likelihood)
    with pytest.raises(ValueError, match=r"returns a tuple of 2 elements.*output="):
        ntkgp.SFR(tuple_net, x, y, likelihood, num_inducing=3)


def test_a_missing_output_key_or_an_output_for_a_tensor_network_is_named():
    torch.manual_seed(0)
    net = MaskedDictModel().double().eval()
    batch = {"ids": ids(3), "mask": torch.ones(3, LENGTH, dtype=torch.bool)}
    engine = NTKEngine(with_output(net, "logit"))
    with pytest.raises(ValueError, match=r"output='logit' is not in the network's output, a dict with keys "
                                         r"\['logits', 'pooled'\]"):
        engine.outputs(batch)
    with pytest.raises(ValueError, match="output=0 was given, but the network returns a Tensor"):
        ntkgp.NTKKernel(BagOfEmbeddings().double(), output=0)(ids(3)).to_dense()
    with pytest.raises(TypeError, match="output must be None, a key"):
        ntkgp.NTKKernel(BagOfEmbeddings().double(), output=1.5)


def test_structured_input_errors_name_the_argument_and_the_key():
    good = {"ids": ids(3), "mask": torch.ones(3, LENGTH)}
    assert check_structure(good, "train_x") == 3
    with pytest.raises(ValueError, match=r"train_x\['ids'\]: 3, train_x\['mask'\]: 2"):
        check_structure({"ids": ids(3), "mask": torch.ones(2, LENGTH)}, "train_x")
    with pytest.raises(TypeError, match=r"x\['mask'\]\[0\] must be a torch.Tensor, got int"):
        check_structure({"ids": ids(3), "mask": [1, 1, 1]}, "x")
    with pytest.raises(TypeError, match=r"x\[1\] must be a torch.Tensor, got int"):
        check_structure((ids(3), 1), "x")
    bad = torch.ones(3, LENGTH)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"x\['mask'\] contains NaN"):
        check_structure({"ids": ids(3), "mask": bad}, "x")
    engine = NTKEngine(with_output(MaskedDictModel().double().eval(), "logits"))
    with pytest.raises(ValueError, match=r"the entries of x must share the leading"):
        engine.outputs({"ids": ids(3), "mask": torch.ones(2, LENGTH)})


def test_rows_of_structured_inputs():
    x = {"ids": ids(5), "mask": torch.arange(5.0)}
    assert num_rows(x) == 5
    assert torch.equal(rows(x, 1, 3)["mask"], torch.tensor([1.0, 2.0]))
    assert torch.equal(take(x, torch.tensor([4, 0]))["ids"], x["ids"][[4, 0]])
    joined = cat([rows(x, 0, 2), rows(x, 2, None)])
    assert all(torch.equal(joined[k], x[k]) for k in x)


def test_models_take_a_dict_with_a_dict_output():
    """NTKGP, SFR, FSVI and train_marglik take dict inputs (packed rows, ntkgp.ntk.packed_inputs); their values are
    checked against independent references in tests/models/test_dict_inputs_models.py."""
    net = MaskedDictModel().double().eval()
    x, y = masked_batch(8), torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(4))
    likelihood = ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3)
    model = ntkgp.NTKGP(net, x, y, likelihood, output="logits").eval()
    sfr = ntkgp.SFR(net, x, y, likelihood, num_inducing=8, output="logits")  # Z = X: the full posterior
    torch.testing.assert_close(sfr(x).variance, model(x).variance, rtol=1e-8, atol=1e-12)


def test_a_kernel_with_output_pickles_and_deep_copies_as_the_network_view():
    import copy
    import pickle

    torch.manual_seed(0)
    net = TupleModel().double().eval()
    x = ids(4)
    kernel = ntkgp.NTKKernel(net, prior_structure="network", output=0)
    expected = dense_jacobian(net, x, 0) @ dense_jacobian(net, x, 0).T
    for other in (pickle.loads(pickle.dumps(kernel)), copy.deepcopy(kernel)):
        torch.testing.assert_close(other(x).to_dense(), expected, rtol=1e-10, atol=1e-12)
    view = copy.deepcopy(with_output(net, 0))  # a copy of the user's network, still selecting its output
    assert view.emb.weight is not net.emb.weight and torch.equal(view(x), net(x)[0])
