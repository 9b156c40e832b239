"""The remaining long passes follow the ``progress`` option of the model or function that owns them
(ntkgp.progress): SFR.update(iterate=True)'s passes over the new points, SFR's inducing-point selection, NTKGP's
prediction (its mean and the lazy covariance's evaluations, the kernel's own Gram passes silent within them), a
weight-space posterior's predict (PassOptions.progress), the layer-block GGN of the weight-space evidence, and the
loader reads of train_marglik and train_fsvi. ``None`` off a terminal gives one line with the estimated time (forced
here for any duration, or from a fake slow clock), ``False`` nothing (standard error and the ``"ntkgp"`` logger both
read)."""


import gpytorch
import torch
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

import ntkgp.progress as progress_module
from ntkgp import NTKGP, NTKKernel
from ntkgp.fsvi import train_fsvi
from ntkgp.laplace import KFACLaplace, PassOptions, predict
from ntkgp.laplace.function_space.evidence_curvature import weight_space_blocks
from ntkgp.laplace.ggn.layer_ggn import layer_ggn
from ntkgp.laplace.ggn.scaling import output_scale, unit_hessian_sqrt
from ntkgp.likelihoods import SoftmaxLikelihood, validate_targets
from ntkgp.models import SFRInducingOptions, SFRMemoryOptions
from ntkgp.models.sfr import SFR
from ntkgp.models.sfr.inducing_points import inducing_inputs_from_data, pool_gram, uniform_subset
from ntkgp.models.sfr.streaming import CountedBatches
from ntkgp.models.sfr.validation import InputLayout
from ntkgp.ntk import NTKEngine
from ntkgp.ntk.network import NetworkCore
from ntkgp.options import InducingMethod
from ntkgp.progress import reporting
from ntkgp.training import HyperparameterSchedule, train_marglik


class SlowClock:
    """``time`` for ntkgp.progress alone: each reading is 10 s after the last (a single update forms the estimate,
    ESTIMATE_AFTER_SECONDS being 5 s)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 10.0
        return self.now


def network(dtype=torch.float64, c=3, width=5):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.Tanh(), torch.nn.Linear(width, c)).to(dtype)


# ---------------------------------------------------------------------------------------------- SFR
def test_sfr_iterated_update_follows_sfr_progress(said, announce_every_pass):
    net = network()
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    sfr = SFR(net, x, y, SoftmaxLikelihood(num_classes=3), num_inducing=6,
              memory=SFRMemoryOptions(batch_size=4, chunk_size=4), progress=False)
    x_new, y_new = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    sfr.update(x_new, y_new, iterate=True)
    assert said() == ""
    sfr.progress = None  # auto, assigned after construction: the next update follows it
    sfr.update(x_new, y_new, iterate=True)
    text = said()
    # 12 new points, 4 a step: the cross-Grams K_Zx for the Newton iteration, then the statistics at the sites
    assert "ntkgp SFR update (cross-Grams): 12 of 12 points" in text
    assert "ntkgp SFR dual statistics: 12 of 12 points" in text
    assert "(Gram)" not in text  # the engine's own chunk passes stay silent


def test_uniform_subset_reports_its_read_and_keeps_the_bottom_k_keys(said, announce_every_pass):
    x = torch.arange(30, dtype=torch.float64)[:, None]
    subset, total = uniform_subset(CountedBatches(x.split(10), 30), 6, seed=5, progress=None)
    assert "ntkgp SFR choosing Z (train_x): 30 of 30 points" in said()
    # the value is the progress-free definition: the rows of the 6 smallest of 30 keys of one seeded stream
    keys = torch.rand(30, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = torch.sort(torch.topk(keys, 6, largest=False).indices).values
    assert total == 30 and torch.equal(subset[:, 0].long(), expected)
    uniform_subset(CountedBatches(x.split(10), 30), 6, seed=5, progress=False)
    assert said() == ""


def test_the_greedy_pool_gram_reports_its_rows_and_equals_the_output_trace(said, announce_every_pass):
    engine = NTKEngine(network(), chunk_size=4, progress=True)  # its own bar: silenced within the pass
    pool = torch.randn(12, 2, dtype=torch.float64)
    weights = torch.tensor([0.5, 2.0], dtype=torch.float64)
    rows_bytes = engine.num_groups * 3 * 12 * 8 * 4  # the temporary of 4 rows: three blocks of the 12 rows
    gram = pool_gram(engine, pool, weights, max_bytes=rows_bytes, progress=None)
    text = said()
    assert "ntkgp SFR choosing Z (pool Gram): 12 of 12 points" in text
    assert "(layer features)" not in text and "Gram:" not in text.replace("(pool Gram):", "")
    assert engine.core.progress is True  # restored
    # an independent route: the weighted per-group full Grams (N·C × N·C), traced over the outputs
    full = torch.einsum("g,gij->ij", weights, engine.group_grams(pool)).view(12, 3, 12, 3)
    dense = full.diagonal(dim1=1, dim2=3).sum(-1)
    said()  # the reference's own bars
    # both sum the same P products per entry in other orders (and over outputs and groups): each entry's rounding
    # is below P·ε·max_i K_ii (Cauchy-Schwarz), times 4 for the sums over outputs, groups and blocks
    bound = 4 * engine.num_params * torch.finfo(torch.float64).eps * dense.diagonal().max()
    assert (gram - dense).abs().max() <= bound
    pool_gram(engine, pool, weights, max_bytes=rows_bytes, progress=False)
    assert said() == ""


def test_inducing_selection_from_a_loader_reports_both_passes(monkeypatch, said, announce_every_pass):
    monkeypatch.setattr(progress_module, "time", SlowClock())  # the one block of the pool's Gram gets its line too
    engine = NTKEngine(network(), chunk_size=4)
    x, y = torch.randn(30, 2, dtype=torch.float64), torch.randint(0, 3, (30,))
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    args = (engine, loader, None, InputLayout((2,), False), 6, InducingMethod.GREEDY_VARIANCE, 0, 30,
            torch.ones(2, dtype=torch.float64), False)
    z = inducing_inputs_from_data(*args, progress=None)
    text = said()
    # the read: the first batch of 10 points at 10 s (the start at 10 s, the update at 20 s) forms the estimate
    assert "ntkgp SFR choosing Z (train_x): 10 of 30 points in 10 s" in text
    assert "ntkgp SFR choosing Z (pool Gram): 30 of 30 points in 10 s" in text
    assert z.shape == (6, 2) and all(any(torch.equal(r, xr) for xr in x) for r in z)
    silent = inducing_inputs_from_data(*args, progress=False)
    assert said() == "" and torch.equal(silent, z)


def test_sfr_constructor_chooses_z_with_its_progress(said, announce_every_pass):
    net = network()
    x, y = torch.randn(30, 2, dtype=torch.float64), torch.randint(0, 3, (30,))
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    inducing = SFRInducingOptions(inducing_method="greedy_variance", pool_size=12)
    kwargs = {"num_inducing": 6, "memory": SFRMemoryOptions(batch_size=10, chunk_size=4), "inducing": inducing}
    SFR(net, loader, None, SoftmaxLikelihood(num_classes=3), progress=False, **kwargs)
    assert said() == ""
    SFR(net, loader, None, SoftmaxLikelihood(num_classes=3), **kwargs)
    assert "ntkgp SFR choosing Z (train_x): 30 of 30 points" in said()


# ---------------------------------------------------------------------------------------------- NTKGP
def test_ntkgp_prediction_has_one_pass_per_evaluation_and_silences_the_kernel(said, announce_every_pass):
    net = network()
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=3).double()
    model = NTKGP(net, x, y, likelihood, prediction_chunk_size=4, chunk_size=4, progress=False).eval()
    x_test = torch.randn(12, 2, dtype=torch.float64)
    _ = model(x_test).variance  # the site posterior at the training data, formed once (silently here)
    assert said() == ""
    model.progress = None  # the kernel's option: its Gram over the 12 training points takes 3 chunks of 4
    dist = model(x_test)
    assert "ntkgp NTKGP prediction: 12 of 12 points" in said()  # the mean, 3 chunks of 4 test points
    variance = dist.variance
    text = said()
    assert "ntkgp NTKGP prediction (variances): 12 of 12 points" in text
    assert "Gram" not in text and "diagonal" not in text  # the per-chunk cross-Grams are silent
    dense = dist.covariance_matrix
    text = said()
    assert "ntkgp NTKGP prediction (covariance): 12 of 12 points" in text and "Gram" not in text
    dist.lazy_covariance_matrix @ torch.ones(36, dtype=torch.float64)
    # each point once in each of two passes: 24 units, the estimate formed after 3 chunks of 4
    assert "ntkgp NTKGP prediction (products): 12 of 24 points" in said()
    assert model.covar_module.engine.core.progress is None  # the kernel's own setting, restored
    # the variances are the dense covariance's diagonal (two evaluations of the operator, chunk by chunk and whole)
    assert torch.allclose(variance.reshape(-1), dense.diagonal(), rtol=1e-10, atol=1e-12)
    model.progress = False
    _ = model(x_test).variance
    assert said() == ""


# ---------------------------------------------------------------------------------------------- weight space
def test_a_weight_space_posteriors_predict_follows_its_pass_options(said, announce_every_pass):
    net = network()
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    likelihood = SoftmaxLikelihood(num_classes=3)
    posterior = KFACLaplace(net, x, y, likelihood, options=PassOptions(batch_size=4, chunk_size=4, progress=False))
    posterior.predict(x)
    assert said() == ""
    posterior.predict(x, progress=None)  # the call's own option wins
    assert "ntkgp predict (glm): 3 of 3 chunks" in said()
    auto = KFACLaplace(net, x, y, likelihood, options=PassOptions(batch_size=4, chunk_size=4))
    assert "ntkgp KFAC: 3 of 3 batches" in said()
    assert auto.progress is None
    auto.predict(x)
    assert "ntkgp predict (glm): 3 of 3 chunks" in said()
    auto.predictive_samples(x, n_samples=4, method="nn")
    assert "ntkgp predict (nn_sampling): 3 of 3 chunks" in said()
    auto.progress = False
    auto.predict(x)
    assert said() == ""


def test_the_predict_function_reports_by_default(said, announce_every_pass):
    # ntkgp.laplace.predict(posterior, x) as a function: auto (None) by default, like every other long pass; its
    # probabilities are those of the silent call (the option changes what is said, not what is computed)
    net = network()
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    posterior = KFACLaplace(net, x, y, SoftmaxLikelihood(num_classes=3),
                            options=PassOptions(batch_size=4, chunk_size=4, progress=False))
    said()
    loud = predict(posterior, x)
    assert "ntkgp predict (glm): 3 of 3 chunks" in said()
    quiet = predict(posterior, x, progress=False)
    assert said() == ""
    assert torch.allclose(loud.probs, quiet.probs, rtol=1e-12, atol=0)


def dense_ggn(net, x, root):
    """Σ_n J_nᵀ R_n R_nᵀ J_n with J_n from torch.func.jacrev, columns in the order of named_parameters."""
    params = {k: v.detach() for k, v in net.named_parameters()}
    jac = jacrev(lambda p: functional_call(net, p, (x,)))(params)
    j = torch.cat([jac[k].reshape(x.shape[0], -1, jac[k][0, 0].numel()) for k in params], dim=-1)  # (N, C, P)
    rows = torch.einsum("ncm,ncp->nmp", root, j)
    return torch.einsum("nmp,nmq->pq", rows, rows)


def test_the_layer_block_ggn_reports_its_pass_and_names_it_within_reporting(said, announce_every_pass):
    net = network()
    core = NetworkCore(net, chunk_size=2, progress=True)  # its feature chunks: silent within the pass
    x = torch.randn(12, 2, dtype=torch.float64)
    likelihood = SoftmaxLikelihood(num_classes=3)
    y = validate_targets(likelihood, torch.randint(0, 3, (12,)), 3)
    with torch.no_grad():
        f = net(x)
    root = unit_hessian_sqrt(likelihood, f, y, output_scale(likelihood).detach().to(f))
    layers = tuple(core.layer_plan(x).layers)
    blocks = layer_ggn(core, layers, x, root, chunk_size=4, progress=None)
    text = said()
    assert "ntkgp GGN layer blocks: 12 of 12 points" in text and "layer features" not in text
    dense = dense_ggn(net, x, root)
    # the same Σ_n over 12 examples of products of P-vectors in other orders: ε·N·max|D| with room for C
    assert (blocks - dense).abs().max() <= 12 * 3 * torch.finfo(torch.float64).eps * dense.abs().max() * 12
    with reporting(core, None, "my pass"):
        layer_ggn(core, layers, x, root, chunk_size=4, progress=core.progress)
    assert "ntkgp my pass (GGN layer blocks): 12 of 12 points" in said()
    layer_ggn(core, layers, x, root, chunk_size=4, progress=False)
    assert said() == "" and core.progress is True


def test_the_weight_space_evidence_route_follows_the_kernels_progress(monkeypatch, said, announce_every_pass):
    monkeypatch.setattr(progress_module, "time", SlowClock())  # the route's one chunk of 12 examples
    net = network()
    x = torch.randn(12, 2, dtype=torch.float64)
    likelihood = SoftmaxLikelihood(num_classes=3)  # M = 3 columns of the root: the blocks are the cheaper route
    kernel = NTKKernel(net, chunk_size=4, progress=None)
    with torch.no_grad():
        f = net(x)
    y = validate_targets(likelihood, torch.randint(0, 3, (12,)), 3)
    scale0 = output_scale(likelihood).detach().to(f)
    blocks = weight_space_blocks(kernel.engine, likelihood, x, f, y, scale0, False)
    assert blocks is not None  # the block route applies to this network of Linear layers
    assert "ntkgp GGN layer blocks: 12 of 12 points in 10 s" in said()
    kernel.progress = False
    weight_space_blocks(kernel.engine, likelihood, x, f, y, scale0, False)
    assert said() == ""


# ---------------------------------------------------------------------------------------------- training
def test_train_marglik_reports_its_check_of_a_loader(said, announce_every_pass):
    net = network(c=1, width=4)
    x = torch.randn(12, 2, dtype=torch.float64)
    loader = DataLoader(TensorDataset(x, torch.sin(x.sum(-1))), batch_size=4)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    schedule = HyperparameterSchedule(hyper_steps=1)  # one epoch and one short round: cheap
    train_marglik(net, loader, None, likelihood, epochs=1, schedule=schedule, progress=False)
    assert said() == ""
    train_marglik(net, loader, None, likelihood, epochs=1, schedule=schedule, progress=None)
    assert "ntkgp marglik training data: 3 of 3 batches" in said()


def test_train_fsvi_reports_its_reads_of_a_loader(said, announce_every_pass):
    torch.manual_seed(0)
    x = torch.randn(12, 2, dtype=torch.float64)
    batches = [(xb, torch.sin(xb.sum(-1))) for xb in x.split(4)]  # a list: no dataset, so N is counted
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    kwargs = {"epochs": 1, "num_context": 3, "context": "uniform"}
    train_fsvi(network(c=1, width=4), batches, None, likelihood, progress=False, **kwargs)
    assert said() == ""
    train_fsvi(network(c=1, width=4), batches, None, likelihood, progress=None, **kwargs)
    text = said()
    assert "ntkgp FSVI counting train_x: 3 of 3 batches" in text
    assert "ntkgp FSVI context bounds: 3 of 3 batches" in text
