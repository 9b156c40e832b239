"""Dict and tuple inputs in the GPyTorch models (``NTKGP``, ``SFR``, FSVI, ``train_marglik``), end to end.

The network takes ``{"ids": LongTensor (N, L), "mask": BoolTensor (N, L)}`` (an embedding, a masked mean and a
linear head). The references are independent of the dict path:

* dense weight-space Laplace-GGN quantities from row-by-row autograd Jacobians (``tests/helpers.py``) for NTKGP;
* the same model built on one integer tensor ``[ids | mask]`` by a wrapper network that splits it back into the
  dict (the token-id path every entry point already takes), for SFR, FSVI and ``train_marglik``.

The models keep a dict as packed rows of bytes (``ntkgp.ntk.packed_inputs``); nothing here reads them.
"""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch
from torch import nn

import ntkgp
from ntkgp.fsvi import FSVI, train_fsvi
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models import SFRInducingOptions
from ntkgp.training import HyperparameterSchedule, train_marglik
from tests.helpers import dense_glm_predictive, dense_laplace, float32_laplace_tolerances, reference_log_prob

VOCAB, LENGTH, WIDTH, CLASSES = 11, 5, 4, 3


class MaskedBag(nn.Module):
    """``{"ids", "mask"}`` → masked mean of the embeddings → tanh → linear (``C`` outputs)."""

    def __init__(self, outputs: int = CLASSES) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, outputs)

    def forward(self, x: dict) -> torch.Tensor:
        m = x["mask"].to(self.emb.weight.dtype)[..., None]
        pooled = (self.emb(x["ids"]) * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(torch.tanh(pooled))


class TupleBag(MaskedBag):
    """The same network on ``(ids, mask)``."""

    def forward(self, x: tuple) -> torch.Tensor:
        return super().forward({"ids": x[0], "mask": x[1]})


class Joined(nn.Module):
    """The reference path: one integer tensor ``[ids | mask]`` ``(N, 2L)``, split back into the dict."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, z: torch.Tensor):
        return self.net({"ids": z[:, :LENGTH], "mask": z[:, LENGTH:].bool()})


def network(seed: int = 0, dtype=torch.float64, outputs: int = CLASSES) -> MaskedBag:
    torch.manual_seed(seed)
    return MaskedBag(outputs).to(dtype).eval()


def inputs(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, LENGTH, generator=g) > 0.35
    mask[:, 0] = True
    return {"ids": torch.randint(0, VOCAB, (n, LENGTH), generator=g), "mask": mask}


def joined(x: dict) -> torch.Tensor:
    return torch.cat([x["ids"], x["mask"].long()], 1)


def labels(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (n,), generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-10) -> None:
    """Normwise relative agreement (float64 paths that differ only by their rounding)."""
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape
    assert (a - b).norm() <= rtol * b.norm() + 1e-300, ((a - b).norm() / b.norm()).item()


def softmax_log_prob(f, y):
    return reference_log_prob("softmax", f, y)


# ---------------------------------------------------------------------- NTKGP
def test_ntkgp_on_a_dict_matches_the_dense_glm_predictive_and_evidence():
    net, x, y, xt = network(), inputs(10, 1), labels(10, 2), inputs(4, 3)
    before = {k: v.clone() for k, v in x.items()}
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(CLASSES)).eval()
    pred = model(xt)
    dense = dense_laplace(Joined(net), joined(x), y, softmax_log_prob, torch.ones(sum(p.numel() for p in net.parameters()),
                                                                              dtype=torch.float64))
    mean, cov = dense_glm_predictive(Joined(net), joined(xt), dense)
    close(pred.mean.reshape(-1), mean)
    close(pred.variance.reshape(-1), cov.diagonal())
    close(model.log_marginal_likelihood(), dense["evidence"])
    assert all(torch.equal(x[k], before[k]) for k in x)  # the user's tensors are untouched
    assert model.train_x.dtype == torch.uint8 and model.train_x.shape[0] == 10  # packed rows, one per example


def test_ntkgp_conditioning_on_a_dict_equals_the_model_on_the_joined_tensor():
    net, x, y, xt, x_new = network(), inputs(8, 1), labels(8, 2), inputs(4, 3), inputs(3, 5)
    y_new = labels(3, 6)
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(CLASSES)).eval()
    reference = ntkgp.NTKGP(Joined(net), joined(x), y, SoftmaxLikelihood(CLASSES)).eval()
    for iterate in (False, True):
        a = model.condition_on(x_new, y_new, iterate=iterate)(xt)
        b = reference.condition_on(joined(x_new), y_new, iterate=iterate)(joined(xt))
        close(a.mean, b.mean)
        close(a.variance, b.variance)


def test_exact_ntkgp_with_a_dict_input_and_a_dict_output_in_train_and_eval_mode():
    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = network(outputs=1)

        def forward(self, x):
            return {"f": self.body(x), "aux": x["ids"]}

    torch.manual_seed(0)
    net, x, xt, x_new = Regressor().double().eval(), inputs(9, 1), inputs(4, 3), inputs(2, 7)
    y = torch.randn(9, dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, lik, output="f")
    reference = ntkgp.NTKGP(Joined(net), joined(x), y, copy.deepcopy(lik), output="f")
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    ref_mll = gpytorch.mlls.ExactMarginalLogLikelihood(reference.likelihood, reference)
    expected = ref_mll(reference(*reference.train_inputs), reference.train_targets)
    close(mll(model(*model.train_inputs), model.train_targets), expected)  # GPyTorch's convention: packed rows
    close(mll(model(x), model.train_targets), expected)  # the dict itself
    model.eval(), reference.eval()
    fantasy = model.get_fantasy_model(x_new, torch.randn(2, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    ref_fantasy = reference.get_fantasy_model(joined(x_new), torch.randn(2, dtype=torch.float64,
                                                                         generator=torch.Generator().manual_seed(1)))
    a, b = fantasy(xt), ref_fantasy(joined(xt))
    close(a.mean, b.mean)
    close(a.variance, b.variance)


def test_ntkgp_on_tuple_inputs_equals_the_dict_model():
    net, x, y, xt = network(), inputs(8, 1), labels(8, 2), inputs(3, 3)
    tuple_net = TupleBag()
    tuple_net.load_state_dict(net.state_dict())
    tuple_net = tuple_net.double().eval()
    a = ntkgp.NTKGP(tuple_net, (x["ids"], x["mask"]), y, SoftmaxLikelihood(CLASSES)).eval()((xt["ids"], xt["mask"]))
    b = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(CLASSES)).eval()(xt)
    close(a.mean, b.mean)
    close(a.variance, b.variance)


def test_float32_ntkgp_on_a_dict_agrees_with_its_float64_copy():
    net64, x, y, xt = network(), inputs(10, 1), labels(10, 2), inputs(4, 3)
    net32 = copy.deepcopy(net64).float()
    p32 = ntkgp.NTKGP(net32, x, y, SoftmaxLikelihood(CLASSES)).eval()(xt)
    p64 = ntkgp.NTKGP(net64, x, y, SoftmaxLikelihood(CLASSES)).eval()(xt)
    assert p32.mean.dtype == torch.float32
    # first-order error model of a float32 Laplace-GGN model against float64, every term measured on the dense
    # float64 references at these inputs (tests/helpers.py, float32_laplace_tolerances; the condition number κ of H
    # enters through λ_min(H))
    tol = float32_laplace_tolerances(Joined(net64), joined(x), y, softmax_log_prob, joined(xt), gaussian=False)
    assert tol["mean"] < 1e-2 and tol["variance"] < 1e-2
    assert rel(p32.mean, p64.mean) <= tol["mean"]
    assert rel(p32.variance, p64.variance) <= tol["variance"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.detach().double() - b.detach()).norm() / b.detach().norm()).item()


def test_ntkgp_on_a_small_transformer_with_a_padding_mask_matches_the_dense_glm_predictive():
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            h = self.encoder(self.emb(x["ids"]), src_key_padding_mask=~x["mask"])
            m = x["mask"].to(h.dtype)[..., None]
            return self.head((h * m).sum(1) / m.sum(1))

    torch.manual_seed(0)
    net, x, xt = Encoder().double().eval(), inputs(6, 1), inputs(3, 3)
    y = torch.randint(0, 2, (6,), generator=torch.Generator().manual_seed(2))
    pred = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(2)).eval()(xt)
    delta = torch.ones(sum(p.numel() for p in net.parameters()), dtype=torch.float64)
    dense = dense_laplace(Joined(net), joined(x), y, softmax_log_prob, delta)
    mean, cov = dense_glm_predictive(Joined(net), joined(xt), dense)
    close(pred.mean.reshape(-1), mean, 1e-9)
    close(pred.variance.reshape(-1), cov.diagonal(), 1e-9)


# ---------------------------------------------------------------------- SFR
def test_sfr_on_a_dict_equals_sfr_on_the_joined_tensor():
    net, x, y, xt = network(), inputs(12, 1), labels(12, 2), inputs(4, 3)
    x_new, y_new = inputs(3, 5), labels(3, 6)
    sfr = ntkgp.SFR(net, x, y, SoftmaxLikelihood(CLASSES), num_inducing=5,
                    inducing=SFRInducingOptions(seed=1))
    reference = ntkgp.SFR(Joined(net), joined(x), y, SoftmaxLikelihood(CLASSES), num_inducing=5,
                          inducing=SFRInducingOptions(seed=1))
    for _ in range(2):  # as built, then conditioned on new data
        a, b = sfr(xt), reference(joined(xt))
        close(a.mean, b.mean)
        close(a.variance, b.variance)
        sfr.update(x_new, y_new)
        reference.update(joined(x_new), y_new)
    assert sfr.inducing_points.dtype == torch.uint8 and sfr.inducing_points.shape[0] == 5  # rows of the data


def test_sfr_from_a_loader_of_dict_batches_with_greedy_inducing_points_and_given_ones():
    net, x, y, xt = network(), inputs(12, 1), labels(12, 2), inputs(4, 3)
    loader = [({k: v[s:s + 4] for k, v in x.items()}, y[s:s + 4]) for s in range(0, 12, 4)]
    ref_loader = [(joined(bx), by) for bx, by in loader]
    kw = {"num_inducing": 4, "inducing": SFRInducingOptions(inducing_method="greedy_variance")}
    a = ntkgp.SFR(net, loader, None, SoftmaxLikelihood(CLASSES), **kw)(xt)
    b = ntkgp.SFR(Joined(net), ref_loader, None, SoftmaxLikelihood(CLASSES), **kw)(joined(xt))
    close(a.mean, b.mean)
    close(a.variance, b.variance)
    z = {k: v[:3] for k, v in x.items()}
    sfr = ntkgp.SFR(net, x, y, SoftmaxLikelihood(CLASSES), inducing_points=z)
    reference = ntkgp.SFR(Joined(net), joined(x), y, SoftmaxLikelihood(CLASSES), inducing_points=joined(z))
    sfr.update(iter(loader[:1]))  # a one-shot iterator of dict batches
    reference.update(iter(ref_loader[:1]))
    a, b = sfr(xt), reference(joined(xt))
    close(a.mean, b.mean)
    close(a.variance, b.variance)


# ---------------------------------------------------------------------- FSVI
def test_fsvi_on_a_dict_equals_fsvi_on_the_joined_tensor():
    torch.manual_seed(0)
    net, x, xt, x_new = network(outputs=1), inputs(10, 1), inputs(4, 3), inputs(2, 5)
    y = torch.randn(10, dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    kw = {"epochs": 2, "lr": 1e-2, "progress": False, "num_context": 4, "batch_size": 5}
    model = train_fsvi(copy.deepcopy(net), x, y, lik, **kw).model
    reference = train_fsvi(Joined(copy.deepcopy(net)), joined(x), y, lik, **kw).model
    a, b = model(xt), reference(joined(xt))
    close(a.mean, b.mean)
    close(a.variance, b.variance)
    a = model.predict(xt, num_samples=4, generator=torch.Generator().manual_seed(0))
    b = reference.predict(joined(xt), num_samples=4, generator=torch.Generator().manual_seed(0))
    close(a.mean, b.mean)
    y_new = torch.randn(2, dtype=torch.float64)
    a, b = model.condition_on(x_new, y_new)(xt), reference.condition_on(joined(x_new), y_new)(joined(xt))
    close(a.mean, b.mean)
    close(a.variance, b.variance)


def test_an_fsvi_model_built_directly_takes_the_structure_of_its_first_dict_input():
    net, xt = network(outputs=1), inputs(4, 3)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    a = FSVI(net, lik)(xt)
    b = FSVI(Joined(net), copy.deepcopy(lik))(joined(xt))
    close(a.mean, b.mean)
    close(a.variance, b.variance)


# ---------------------------------------------------------------------- train_marglik
def test_train_marglik_on_a_dict_equals_the_run_on_the_joined_tensor():
    net, x, y = network(), inputs(10, 1), labels(10, 2)
    kw = {"epochs": 2, "schedule": HyperparameterSchedule(frequency=1, burn_in=0, hyper_steps=2), "lr": 1e-2,
              "progress": False}
    a = train_marglik(copy.deepcopy(net), x, y, SoftmaxLikelihood(CLASSES), **kw)
    reference_net = Joined(copy.deepcopy(net))
    b = train_marglik(reference_net, joined(x), y, SoftmaxLikelihood(CLASSES), **kw)
    assert abs(a.log_evidence - b.log_evidence) <= 1e-10 * abs(b.log_evidence)
    for p, q in zip(a.net.parameters(), reference_net.parameters()):
        close(p, q)
    close(a.kernel.prior_precision, b.kernel.prior_precision)
    close(a.net(x), reference_net(joined(x)))  # the returned network takes the dict itself
    loader = [({k: v[s:s + 5] for k, v in x.items()}, y[s:s + 5]) for s in (0, 5)]
    c = train_marglik(copy.deepcopy(net), loader, None, SoftmaxLikelihood(CLASSES), **kw)
    d = train_marglik(Joined(copy.deepcopy(net)), [(joined(bx), by) for bx, by in loader], None,
                      SoftmaxLikelihood(CLASSES), **kw)
    assert abs(c.log_evidence - d.log_evidence) <= 1e-10 * abs(d.log_evidence)


# ---------------------------------------------------------------------- refusals
def _bad_dicts(x: dict) -> list[tuple[object, type, str]]:
    return [
        ({"ids": x["ids"], "mask": x["mask"][:-1]}, ValueError,
         r"the entries of {a} must share the leading \(batch\) dimension, got {a}\['ids'\]: 6, {a}\['mask'\]: 5"),
        ({"ids": x["ids"], "mask": 1}, TypeError, r"{a}\['mask'\] must be a torch.Tensor, got int"),
        ({}, ValueError, r"{a} is an empty dict"),
        ({"ids": x["ids"].double().requires_grad_(), "mask": x["mask"]}, NotImplementedError,
         r"{a}\['ids'\] requires grad"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_bad_training_dicts_are_refused_naming_train_x_before_anything_is_built(case):
    net, x, y = network(), inputs(6, 1), labels(6, 2)
    bad, error, pattern = _bad_dicts(x)[case]
    likelihood = SoftmaxLikelihood(CLASSES)
    for build in (lambda: ntkgp.NTKGP(net, bad, y, likelihood),
                  lambda: ntkgp.SFR(net, bad, y, likelihood, num_inducing=2),
                  lambda: train_fsvi(net, bad, y, likelihood, epochs=1, progress=False),
                  lambda: train_marglik(net, bad, y, likelihood, epochs=1, progress=False)):
        with pytest.raises(error, match=pattern.format(a="train_x")):
            build()


def test_test_inputs_unlike_the_training_dict_are_refused_naming_the_argument():
    net, x, y = network(), inputs(6, 1), labels(6, 2)
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(CLASSES)).eval()
    sfr = ntkgp.SFR(net, x, y, SoftmaxLikelihood(CLASSES), num_inducing=3)
    xt = inputs(3, 4)
    cases = [
        ({"ids": xt["ids"]}, TypeError, r"{a} must hold the entries \[\"\['ids'\]\", \"\['mask'\]\"\]"),
        ({"ids": xt["ids"].int(), "mask": xt["mask"]}, TypeError, r"{a}\['ids'\] must have dtype torch.int64"),
        ({"ids": xt["ids"][:, :3], "mask": xt["mask"]}, ValueError, r"{a}\['ids'\] must have shape \(N, 5\)"),
        ({"ids": xt["ids"], "mask": xt["mask"][:2]}, ValueError, r"the entries of {a} must share the leading"),
        (xt["ids"], TypeError, r"{a} must be a dict of tensors like the training inputs"),
        ((xt["ids"], xt["mask"]), TypeError, r"{a} must hold the entries"),
    ]
    for bad, error, pattern in cases:
        with pytest.raises(error, match=pattern.format(a="X")):
            model(bad)
        with pytest.raises(error, match=pattern.format(a="x")):
            sfr(bad)
    state = {k: v.clone() for k, v in sfr.state_dict().items()}
    with pytest.raises(ValueError, match="the entries of x_new must share the leading"):
        sfr.update({"ids": xt["ids"], "mask": xt["mask"][:1]}, labels(3, 5))
    assert all(torch.equal(v, sfr.state_dict()[k]) for k, v in state.items())  # nothing added


def test_a_dict_at_a_model_built_on_tensors_and_input_shape_with_a_dict_are_refused():
    net, x, y = network(), inputs(6, 1), labels(6, 2)
    model = ntkgp.NTKGP(Joined(net), joined(x), y, SoftmaxLikelihood(CLASSES)).eval()
    with pytest.raises(TypeError, match="X is a dict of tensors, but this model was built on tensor inputs"):
        model(x)
    with pytest.raises(ValueError, match="input_shape=.* applies to tensor inputs, but train_x is a dict"):
        ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(CLASSES), input_shape=(5,))


def test_models_on_dicts_pickle_and_deep_copy_with_their_structure():
    import pickle

    net, x, y, xt = network(), inputs(8, 1), labels(8, 2), inputs(3, 3)
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(CLASSES)).eval()
    sfr = ntkgp.SFR(net, x, y, SoftmaxLikelihood(CLASSES), num_inducing=4)
    for original in (model, sfr):
        expected = original(xt).variance
        for twin in (copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
            close(twin(xt).variance, expected)


def test_float32_sfr_on_a_dict_agrees_with_its_float64_copy():
    net64, x, y, xt = network(), inputs(10, 1), labels(10, 2), inputs(4, 3)
    net32 = copy.deepcopy(net64).float()
    # Z = X: SFR's posterior is the GLM predictive, whose float32 error model is that of NTKGP (tests/helpers.py,
    # float32_laplace_tolerances; SFR sums its statistics in float64, which only removes roundings)
    v32 = ntkgp.SFR(net32, x, y, SoftmaxLikelihood(CLASSES), num_inducing=10)(xt).variance
    v64 = ntkgp.SFR(net64, x, y, SoftmaxLikelihood(CLASSES), num_inducing=10)(xt).variance
    tol = float32_laplace_tolerances(Joined(net64), joined(x), y, softmax_log_prob, joined(xt), gaussian=False)
    assert v32.dtype == torch.float32 and tol["variance"] < 1e-2
    assert rel(v32, v64) <= tol["variance"]


def test_condition_on_observations_takes_a_dict_as_condition_on_and_update_do():
    net, x, xt, x_new = network(outputs=1), inputs(8, 1), inputs(3, 3), inputs(2, 7)
    g = torch.Generator().manual_seed(0)
    y, y_new = torch.randn(8, dtype=torch.float64, generator=g), torch.randn(2, 1, dtype=torch.float64, generator=g)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    reference = ntkgp.NTKGP(Joined(net), joined(x), y, copy.deepcopy(lik)).eval()
    a = model.condition_on_observations(x_new, y_new)(xt)
    b = reference.condition_on_observations(joined(x_new), y_new)(joined(xt))
    close(a.variance, b.variance)
    close(a.mean, b.mean)
    sfr = ntkgp.SFR(net, x, y, copy.deepcopy(lik), num_inducing=8)
    sfr_reference = ntkgp.SFR(Joined(net), joined(x), y, copy.deepcopy(lik), num_inducing=8)
    a = sfr.condition_on_observations(x_new, y_new)(xt)
    b = sfr_reference.condition_on_observations(joined(x_new), y_new)(joined(xt))
    close(a.variance, b.variance)
    close(a.mean, b.mean)
