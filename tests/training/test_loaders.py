"""train_marglik on a torch.utils.data.DataLoader: a full-batch loader gives the tensor run, shuffled
mini-batches of any size give a hand-written loop over an identically seeded loader, images keep their shape,
bad loaders are refused before any side effect, and data-parallel ranks with loaders match one process."""

import copy

import gpytorch
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ntkgp
from ntkgp.training import HyperparameterSchedule, train_marglik
from tests.helpers import mlp

ROUNDS = dict(lr=1e-2, schedule=HyperparameterSchedule(burn_in=2, frequency=3, hyper_steps=4), progress=False)


def _assert_same_run(a, b, net_a, net_b, rtol):
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=rtol)
    assert [h["epoch"] for h in a.history] == [h["epoch"] for h in b.history]
    assert [h["log_evidence"] for h in a.history] == pytest.approx([h["log_evidence"] for h in b.history], rel=rtol)
    torch.testing.assert_close(a.prior_precision, b.prior_precision, rtol=rtol, atol=0)
    assert a.train_loss == pytest.approx(b.train_loss, rel=rtol)


@pytest.mark.parametrize("structure", ["full_ggn", "full_ef", "kfac", "diag_ggn"])
def test_a_full_batch_loader_equals_the_tensor_run(small_regression, structure):
    x, y, net, lik = small_regression()
    net_t, lik_t = copy.deepcopy(net), copy.deepcopy(lik)
    loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
    on_loader = train_marglik(net, loader, None, lik, structure=structure, epochs=8, **ROUNDS)
    on_tensors = train_marglik(net_t, x, y, lik_t, structure=structure, epochs=8, **ROUNDS)
    _assert_same_run(on_loader, on_tensors, net, net_t, rtol=1e-10)
    torch.testing.assert_close(lik.noise, lik_t.noise, rtol=1e-10, atol=0)


def test_shuffled_minibatches_of_any_size_follow_the_loader(small_regression, map_loss):
    """N = 30 in batches of 8 (the last of 6), shuffled: the weights are those of Adam on the MAP objective
    over the batches of an identically seeded loader (read once more first: train_marglik checks every batch
    before training), each batch's data term scaled by N / B."""
    x, y, net, lik = small_regression()
    reference = copy.deepcopy(net)
    noise = lik.noise.detach().clone()

    def loader():
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7))

    train_marglik(net, loader(), None, lik, epochs=3, lr=1e-2,
                  schedule=HyperparameterSchedule(burn_in=10, frequency=10, hyper_steps=0),
                  progress=False)
    batches = loader()
    sizes = [xb.shape[0] for xb, _ in batches]  # the check pass
    assert sizes == [8, 8, 8, 6]
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(3):
        for xb, yb in batches:
            opt.zero_grad()
            map_loss(reference, xb, yb, noise, 1.0, x.shape[0]).backward()
            opt.step()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.head = torch.nn.Linear(2 * 3 * 3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


@pytest.mark.parametrize("structure", ["kfac", "full_ggn"])
def test_image_batches_keep_their_shape(structure):
    """(B, 1, 5, 5) images from a loader: the input shape comes from the batches; the same as the tensor run."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 1, 5, 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (24,), generator=g)
    torch.manual_seed(1)
    net = TinyCNN().double()
    net_t = copy.deepcopy(net)
    lik, lik_t = (ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3).double() for _ in range(2))
    on_loader = train_marglik(net, DataLoader(TensorDataset(x, y), batch_size=24), None, lik, structure=structure,
                              epochs=5, **ROUNDS)
    on_tensors = train_marglik(net_t, x, y, lik_t, structure=structure, epochs=5, **ROUNDS)
    assert on_loader.kernel.engine.input_shape == (1, 5, 5)
    _assert_same_run(on_loader, on_tensors, net, net_t, rtol=1e-10)


def _nan_in_third_batch(x, y):
    x = x.clone()
    x[20, 0] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=8), None, {}


def _nan_target_in_second_batch(x, y):
    y = y.clone()
    y[9] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=8), None, {}


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (_nan_in_third_batch, ValueError, "train_x contains NaN"),
        (lambda x, y: (iter(DataLoader(TensorDataset(x, y), batch_size=8)), None, {}), ValueError, "re-iterable"),
        (lambda x, y: ((xb for xb in x.split(8)), None, {}), ValueError, "re-iterable"),
        (lambda x, y: (DataLoader(TensorDataset(x, y), batch_size=8), y, {}), TypeError,
         "train_x must be a torch.Tensor"),
        (lambda x, y: (x.tolist(), y, {}), TypeError, "train_x must be a torch.Tensor"),
        (lambda x, y: (DataLoader(TensorDataset(x, y), batch_size=8), None, {"batch_size": 4}), ValueError,
         "batch_size"),
        (lambda x, y: (DataLoader(TensorDataset(x), batch_size=8), None, {}), ValueError, "no targets"),
        (lambda x, y: ([], None, {}), ValueError, "empty"),
        (lambda x, y: (list(zip(x.split(8), (y[:4] for _ in range(4)))), None, {}), ValueError, "train_y"),
        (lambda x, y: ("data.csv", None, {}), TypeError, "train_x"),
        (_nan_target_in_second_batch, ValueError, "train_y"),
    ],
)
def test_bad_loaders_are_refused_before_any_side_effect(small_regression, make, error, match):
    x, y, net, lik = small_regression()
    before = copy.deepcopy(net.state_dict())
    data, targets, kwargs = make(x, y)
    with pytest.raises(error, match=match):
        train_marglik(net, data, targets, lik, epochs=2, progress=False, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_progress_false_is_silent(small_regression, capsys):
    x, y, net, lik = small_regression()
    train_marglik(net, DataLoader(TensorDataset(x, y), batch_size=10), None, lik, epochs=3, **ROUNDS)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def distributed_loaders(rank, world):
    """Each rank a loader over its shard (16 and 15 rows): full batch and mini-batches of 5 (4 and 3 batches)."""
    from ntkgp.distributed import shard

    g = torch.Generator().manual_seed(11)
    x = torch.randn(31, 2, dtype=torch.float64, generator=g)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(31, dtype=torch.float64, generator=g)
    out = {}
    for name, structure, batch in (("full_ggn", "full_ggn", None), ("kfac", "kfac", None),
                                   ("minibatch", "diag_ggn", 5)):
        net = mlp(d_in=2, width=5, d_out=1, depth=1, seed=12)
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        if rank is None:  # one process, tensors
            result = train_marglik(net, x, y, lik, structure=structure, epochs=6, batch_size=batch, **ROUNDS)
        else:
            xs, ys = shard(x, y, rank_=rank, world=world)
            loader = DataLoader(TensorDataset(xs, ys), batch_size=batch or xs.shape[0])
            result = train_marglik(net, loader, None, lik, structure=structure, epochs=6, distributed=True, **ROUNDS)
        out[name] = {"weights": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
                     "prior_precision": result.prior_precision.clone(), "noise": lik.noise.detach().clone(),
                     "history": torch.tensor([h["log_evidence"] for h in result.history])}
    return out


def test_data_parallel_loaders_match_one_process():
    from tests.distributed.launch import run

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        single = distributed_loaders(None, 2)
        ranks = run("tests.training.test_loaders:distributed_loaders", 2, timeout=300)
    finally:
        torch.set_default_dtype(default)
    for name in ("full_ggn", "kfac"):  # full batch: one process on all the data
        for rank in ranks:
            for key, value in single[name].items():
                torch.testing.assert_close(rank[name][key], value, rtol=1e-10, atol=1e-12)
    first, second = (r["minibatch"] for r in ranks)  # mini-batches: every rank ends identical
    for key in first:
        assert torch.equal(first[key], second[key])
    assert len(first["history"]) == 2 and torch.isfinite(first["history"]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("structure", ["full_ggn", "kfac"])
def test_a_cpu_loader_trains_a_cuda_network_as_on_the_cpu(small_regression, structure):
    """The batches go to the network's device; the run matches the CPU run (skipped without a GPU)."""
    x, y, net, lik = small_regression()
    gpu_net, gpu_lik = copy.deepcopy(net).cuda(), copy.deepcopy(lik).cuda()
    loader = DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(2))
    cpu = train_marglik(net, loader, None, lik, structure=structure, epochs=5, **ROUNDS)
    loader.generator.manual_seed(2)
    gpu = train_marglik(gpu_net, loader, None, gpu_lik, structure=structure, epochs=5, **ROUNDS)
    assert gpu.prior_precision.is_cuda and all(p.is_cuda for p in gpu_net.parameters())
    for p, q in zip(gpu_net.parameters(), net.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gpu.prior_precision.cpu(), cpu.prior_precision, rtol=1e-8, atol=0)
