"""NTKKernel on batches vs brute-force Grams slice by slice; lazy indexing, pickling, dtype, device."""

import copy
import pickle
from unittest import mock

import gpytorch
import pytest
import torch

from ntkgp import NTKKernel
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.ntk import NTKEngine, resolve_groups
from tests.helpers import brute_gram, float32_gram_tolerance, mlp, rel_err, small_cnn

D64 = torch.float64


def labels_of(net, prior_structure="layer"):
    pg = resolve_groups(net, prior_structure)
    return dict(zip(pg.names, pg.group_of))


def brute_batched(net, x1, x2, delta):
    """Brute-force Grams per slice of the broadcast batch of ``x1 (*b1, N1, D)``, ``x2 (*b2, N2, D)``."""
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2], delta.shape[:-1])
    x1 = x1.expand(*batch, *x1.shape[-2:]).reshape(-1, *x1.shape[-2:])
    x2 = x2.expand(*batch, *x2.shape[-2:]).reshape(-1, *x2.shape[-2:])
    delta = delta.expand(*batch, delta.shape[-1]).reshape(-1, delta.shape[-1])
    grams = [brute_gram(net, a, b, d, labels_of(net)) for a, b, d in zip(x1, x2, delta)]
    return torch.stack(grams).reshape(*batch, *grams[0].shape)


def counting(method):
    """Patch an NTKEngine method so that its calls are counted (the original still runs)."""
    original = getattr(NTKEngine, method)
    calls = []

    def wrapper(self, *args, **kwargs):
        calls.append([a.shape for a in args if torch.is_tensor(a)])
        return original(self, *args, **kwargs)

    return mock.patch.object(NTKEngine, method, wrapper), calls


@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("space", ["function", "weight"])
def test_batched_inputs_match_brute_force(c, space):
    net = mlp(d_out=c)
    delta = torch.tensor([0.5, 2.0, 3.0], dtype=D64)
    kernel = NTKKernel(net, prior_precision=delta, space=space)
    x = torch.randn(2, 3, 4, 3, dtype=D64)
    ref = brute_batched(net, x, x, delta)
    k = kernel(x)
    assert k.shape == (2, 3, 4 * c, 4 * c)
    assert rel_err(k.to_dense(), ref) < 1e-10
    assert rel_err(kernel(x, diag=True), ref.diagonal(dim1=-2, dim2=-1)) < 1e-10
    # broadcasting: (2, 1, 4, D) against (3, 5, D) gives a (2, 3) batch
    x1, x2 = torch.randn(2, 1, 4, 3, dtype=D64), torch.randn(3, 5, 3, dtype=D64)
    k12 = kernel(x1, x2)
    assert k12.shape == (2, 3, 4 * c, 5 * c)
    assert rel_err(k12.to_dense(), brute_batched(net, x1, x2, delta)) < 1e-10
    # diag of a cross-covariance with equal numbers of points
    x3 = torch.randn(3, 4, 3, dtype=D64)
    assert (
        rel_err(kernel(x1, x3, diag=True), brute_batched(net, x1, x3, delta).diagonal(dim1=-2, dim2=-1))
        < 1e-10
    )


@pytest.mark.parametrize("space", ["function", "weight"])
def test_kernel_batch_shape_gives_one_delta_per_batch_element(space):
    net = mlp(d_out=2)
    delta = torch.tensor([[0.5, 2.0, 3.0], [4.0, 0.25, 1.0]], dtype=D64)
    kernel = NTKKernel(net, prior_precision=delta, batch_shape=torch.Size([2]), space=space)
    assert kernel.prior_precision.shape == (2, 3) and kernel.column_weights(-1.0).shape == (
        2,
        net_params(net),
    )
    x = torch.randn(6, 3, dtype=D64)  # no batch: broadcast against the kernel's
    assert rel_err(kernel(x).to_dense(), brute_batched(net, x, x, delta)) < 1e-10
    assert rel_err(kernel(x, diag=True), brute_batched(net, x, x, delta).diagonal(dim1=-2, dim2=-1)) < 1e-10
    sub = kernel[1]
    assert (
        sub.batch_shape == torch.Size([])
        and rel_err(sub(x).to_dense(), brute_gram(net, x, x, delta[1], labels_of(net))) < 1e-10
    )
    wide = kernel.expand_batch(3, 2)
    xb = torch.randn(3, 2, 5, 3, dtype=D64)
    assert rel_err(wide(xb).to_dense(), brute_batched(net, xb, xb, delta.expand(3, 2, 3))) < 1e-10


def net_params(net):
    return sum(p.numel() for p in net.parameters())


def test_identical_slices_are_computed_once():
    net = mlp(d_out=2)
    kernel = NTKKernel(net, cache_size=0, space="function")
    train, test = torch.randn(7, 3, dtype=D64), torch.randn(5, 2, 3, dtype=D64)
    grams, calls = counting("group_grams")
    with grams:
        expanded = kernel(train.expand(5, 7, 3)).to_dense()  # stride-0 batch
        repeated = kernel(train.repeat(5, 1, 1)).to_dense()  # real copies, equal by value
    assert len(calls) == 2 and calls[0] == [torch.Size([7, 3])]
    ref = brute_gram(net, train, train, torch.ones(3, dtype=D64), labels_of(net))
    assert (
        rel_err(expanded, ref.expand(5, 14, 14)) < 1e-10 and rel_err(repeated, ref.expand(5, 14, 14)) < 1e-10
    )
    # test points against the training inputs broadcast over their batch: one call for the whole batch
    with grams:
        calls.clear()
        cross = kernel(test, train.expand(5, 7, 3)).to_dense()
    assert calls == [[torch.Size([10, 3]), torch.Size([7, 3])]]
    assert rel_err(cross, brute_batched(net, test, train, torch.ones(3, dtype=D64))) < 1e-10
    jac, jcalls = counting("jacobian")
    with jac:
        NTKKernel(net, cache_size=0, space="weight")(train.repeat(4, 1, 1)).to_dense()
    assert jcalls == [[torch.Size([7, 3])]]


@pytest.mark.parametrize("space", ["function", "weight"])
def test_getitem_on_lazy_results(space):
    net = mlp(d_out=2)
    kernel = NTKKernel(net, space=space)
    x = torch.randn(3, 8, 3, dtype=D64)
    dense = brute_batched(net, x, x, torch.ones(3, dtype=D64))
    lazy = kernel(x)
    assert rel_err(lazy[1].to_dense(), dense[1]) < 1e-10
    assert (
        rel_err(lazy[..., 2:6, 4:12].to_dense(), dense[..., 2:6, 4:12]) < 1e-10
    )  # whole points: re-evaluated
    assert rel_err(lazy[..., 1:6, 3:12].to_dense(), dense[..., 1:6, 3:12]) < 1e-10  # split points
    rows, cols = torch.tensor([0, 3, 5, 15]), torch.tensor([1, 2, 14, 15])
    assert rel_err(lazy[..., rows, cols], dense[..., rows, cols]) < 1e-10
    evaluated = lazy.evaluate_kernel()
    assert rel_err(evaluated[2, 1:5, :].to_dense(), dense[2, 1:5, :]) < 1e-10
    assert rel_err(evaluated[:, rows, cols], dense[:, rows, cols]) < 1e-10


def test_per_point_blocks_are_read_without_the_gram():
    """``SoftmaxLikelihood(link_approx="mc")`` reads each point's C×C block of a plain GPyTorch model's lazy
    covariance."""
    net = mlp(d_out=3)
    x = torch.randn(9, 3, dtype=D64)

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(
                x, torch.zeros(9, 3, dtype=D64), gpytorch.likelihoods.MultitaskGaussianLikelihood(3)
            )
            self.covar_module = NTKKernel(net, prior_precision=torch.tensor([0.5, 2.0, 3.0], dtype=D64))

        def forward(self, inputs):
            mean = torch.zeros(*inputs.shape[:-1], 3, dtype=inputs.dtype)
            return gpytorch.distributions.MultitaskMultivariateNormal(mean, self.covar_module(inputs))

    model = GP().double().eval()
    x_test = torch.randn(6, 3, dtype=D64)
    with gpytorch.settings.prior_mode(True):
        prior = model(x_test)
    dense = brute_gram(net, x_test, x_test, torch.tensor([0.5, 2.0, 3.0], dtype=D64), labels_of(net))
    blocks_ref = dense.view(6, 3, 6, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    grams, calls = counting("group_grams")
    with grams:
        probs = SoftmaxLikelihood(3)(
            prior, link_approx="mc", num_samples=20000, generator=torch.Generator().manual_seed(0)
        ).probs
        from ntkgp.likelihoods.link_approximation import output_covariance_blocks

        blocks = output_covariance_blocks(prior)
    assert calls == []  # no Gram was formed
    assert rel_err(blocks, blocks_ref) < 1e-10
    samples = torch.distributions.MultivariateNormal(torch.zeros(6, 3, dtype=D64), blocks_ref).sample(
        torch.Size([20000])
    )
    assert (probs - torch.softmax(samples, -1).mean(0)).abs().max() < 0.02
    # GPyTorch's generic path evaluates the kernel on inputs repeated once per entry: computed once
    k = model.covar_module
    k.clear_cache()
    with grams:
        calls.clear()
        k.forward(x_test.repeat(45, 1, 1), x_test.repeat(45, 1, 1))
    assert len(calls) == 1


@pytest.mark.parametrize("space", ["function", "weight"])
def test_images_with_input_shape_in_batches(space):
    net = small_cnn(c_out=2)
    delta = torch.linspace(0.5, 2.0, 3, dtype=D64)
    kernel = NTKKernel(net, prior_precision=delta, input_shape=(1, 6, 6), space=space)
    x = torch.randn(2, 3, 1, 6, 6, dtype=D64)
    unflat, flat = kernel(x).to_dense(), kernel(x.flatten(-3)).to_dense()
    assert unflat.shape == (2, 6, 6) and torch.equal(unflat, flat)
    for b in range(2):
        assert rel_err(unflat[b], brute_gram(net, x[b], x[b], delta, labels_of(net))) < 1e-10
    assert rel_err(kernel(x, diag=True), unflat.diagonal(dim1=-2, dim2=-1)) < 1e-10
    with pytest.raises(ValueError, match="x1 must have shape"):
        kernel(torch.randn(3, 35, dtype=D64))


def test_pickle_and_deepcopy():
    net = mlp(d_out=2)
    kernel = NTKKernel(net, prior_precision=torch.tensor([0.5, 2.0, 3.0], dtype=D64))
    x = torch.randn(5, 3, dtype=D64)
    k = kernel(x).to_dense()
    clone = pickle.loads(pickle.dumps(kernel))
    assert len(clone._cache) == 0 and torch.equal(clone.prior_precision, kernel.prior_precision)
    assert rel_err(clone(x).to_dense(), k) < 1e-14
    copied = copy.deepcopy(kernel)
    assert copied.net is net and copied._cache is kernel._cache  # the same network: pieces are shared


def test_dtype_conversion_changes_the_kernel_not_the_network():
    """The Jacobians keep the network's precision; the kernel matrix comes out in the kernel's dtype."""
    net32 = mlp(d_out=2, dtype=torch.float32)
    x = torch.randn(6, 3, dtype=D64)
    k32 = NTKKernel(net32)
    single = k32(x).to_dense()
    assert single.dtype == torch.float32  # float64 data, float32 network: the network's dtype
    k32.double()
    assert k32.dtype == D64 and all(p.dtype == torch.float32 for p in net32.parameters())
    double = k32(x).to_dense()
    net64 = mlp(d_out=2)
    exact = NTKKernel(net64)(x).to_dense()
    # float32 Jacobians (and a float32 Gram): within ε·r·tr K of the float64 Gram (tests.helpers.float32_gram_tolerance),
    # so the two differ by at most twice that
    tolerance = float32_gram_tolerance(net64, exact.diagonal())
    assert tolerance < 1e-2 * exact.norm()  # a meaningful bound: a 1 % error fails
    assert double.dtype == D64 and (double - single.double()).norm() <= 2 * tolerance
    k64 = NTKKernel(net64).float()
    assert k64(x).to_dense().dtype == torch.float32
    assert (k64(x).to_dense().double() - exact).norm() <= tolerance


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_moves():
    net = mlp(d_out=2)
    x = torch.randn(2, 6, 3, dtype=D64)
    cpu = NTKKernel(net)(x).to_dense()
    kernel = NTKKernel(net).cuda()
    assert kernel(x).to_dense().is_cuda  # hyperparameters on the GPU: the matrix is returned there
    gpu = NTKKernel(copy.deepcopy(net).cuda())
    out = gpu(x.cuda()).to_dense()
    assert out.is_cuda and rel_err(out.cpu(), cpu) < 1e-10


def test_last_dim_is_batch_and_incompatible_batches_raise():
    kernel = NTKKernel(mlp())
    x = torch.randn(4, 3, dtype=D64)
    with pytest.raises(NotImplementedError, match="last_dim_is_batch"):
        kernel(x, last_dim_is_batch=True)
    with (
        gpytorch.settings.lazily_evaluate_kernels(False),
        pytest.raises(ValueError, match="do not broadcast"),
    ):
        kernel(torch.randn(2, 4, 3, dtype=D64), torch.randn(3, 4, 3, dtype=D64))
    with pytest.raises(ValueError, match="same number of points"):
        kernel(x, torch.randn(5, 3, dtype=D64), diag=True)


def plain_exact_gp(net, x, y, c):
    """An ordinary GPyTorch ExactGP with the NTK as its covariance (no ntkgp model class)."""

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            likelihood = (
                gpytorch.likelihoods.GaussianLikelihood()
                if c == 1
                else gpytorch.likelihoods.MultitaskGaussianLikelihood(c, rank=0)
            )
            super().__init__(x, y, likelihood)
            self.covar_module = NTKKernel(net, prior_precision=torch.tensor([0.5, 2.0, 3.0], dtype=D64))

        def forward(self, z):
            covar = self.covar_module(z)
            if c == 1:
                return gpytorch.distributions.MultivariateNormal(
                    torch.zeros(z.shape[:-1], dtype=z.dtype), covar
                )
            mean = torch.zeros(*z.shape[:-1], c, dtype=z.dtype)
            return gpytorch.distributions.MultitaskMultivariateNormal(mean, covar)

    return GP().double().eval()


@pytest.mark.parametrize("c", [1, 3])
def test_batched_prediction_in_a_plain_exact_gp(c):
    """GPyTorch's exact prediction on ``(b, q, d)`` test inputs (BoTorch's shape) = one call per batch."""
    net = mlp(d_out=c)
    x, y = torch.randn(12, 3, dtype=D64), torch.randn(12, c, dtype=D64).squeeze(-1)
    model = plain_exact_gp(net, x, y, c)
    x_test = torch.randn(4, 5, 3, dtype=D64)
    with torch.no_grad():
        batched = model(x_test)
        single = [model(x_test[i]) for i in range(4)]
    assert batched.mean.shape == ((4, 5) if c == 1 else (4, 5, c))
    assert rel_err(batched.mean, torch.stack([s.mean for s in single])) < 1e-10
    assert rel_err(batched.covariance_matrix, torch.stack([s.covariance_matrix for s in single])) < 1e-10
    with torch.no_grad():
        kxx = model.likelihood(model.forward(x)).covariance_matrix  # K(X, X) + noise
    ks = brute_batched(net, x_test[1], x, torch.tensor([0.5, 2.0, 3.0], dtype=D64))
    assert rel_err(batched.mean[1].reshape(-1), ks @ torch.linalg.solve(kxx, y.reshape(-1))) < 1e-8


@pytest.mark.parametrize("space", ["function", "weight"])
def test_many_small_distinct_slices_take_one_engine_call(space):
    """Distinct candidates ``(b, q, d)`` (BoTorch's shape): one engine call, not one per candidate."""
    net = mlp(d_out=2)
    kernel = NTKKernel(
        net, cache_size=0, space=space, prior_precision=torch.tensor([0.5, 2.0, 3.0], dtype=D64)
    )
    x, other = torch.randn(64, 2, 3, dtype=D64), torch.randn(64, 2, 3, dtype=D64)
    method = "group_grams" if space == "function" else "jacobian"
    patch, calls = counting(method)
    with patch:
        square, cross = kernel(x).to_dense(), kernel(x, other).to_dense()
    assert len(calls) == (2 if space == "function" else 3)
    delta = torch.tensor([0.5, 2.0, 3.0], dtype=D64)
    for b in (0, 17, 63):
        assert rel_err(square[b], brute_gram(net, x[b], x[b], delta, labels_of(net))) < 1e-10
        assert rel_err(cross[b], brute_gram(net, x[b], other[b], delta, labels_of(net))) < 1e-10
