"""The passes a model or function runs on an engine whose other passes are silent follow that model's or function's
own ``progress`` (ntkgp.progress.reporting): SFR's inducing inputs' features, K_ZZ and J(Z), the function-space
curvature's Gram (exact_curvature and train_marglik's rounds). ``None`` off a terminal gives one line with the
estimated time (forced here for any duration, or from a fake slow clock), ``True`` a bar, ``False`` nothing (standard
error and the ``"ntkgp"`` logger both read); the engine's own setting is restored after the pass."""


import gpytorch
import pytest
import torch

import ntkgp.progress as progress_module
from ntkgp.laplace.ggn import exact_curvature, function_space_curvature
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models import SFRMemoryOptions
from ntkgp.models.sfr import SFR
from ntkgp.models.sfr.factorization import inducing_feature_set
from ntkgp.models.sfr.system_grams import combined_system_gram, inducing_features, inducing_grams
from ntkgp.ntk import NTKEngine
from ntkgp.progress import reporting
from ntkgp.training import HyperparameterSchedule, train_marglik


def network(dtype=torch.float64, c=3):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(), torch.nn.Linear(5, c)).to(dtype)


# ---------------------------------------------------------------------------------------------- the helper
def test_reporting_names_the_chunk_passes_and_restores_the_engine(said, announce_every_pass):
    engine = NTKEngine(network(), chunk_size=4, progress=True)
    x = torch.randn(12, 2, dtype=torch.float64)
    with reporting(engine.core, None, "my pass"):
        assert engine.core.progress is None
        engine.group_grams(x)
    # the features of x (3 chunks), then the Gram's row chunks (3): each pass named, each with its estimate
    assert "ntkgp my pass (layer features): 3 of 3 chunks" in (text := said())
    assert "ntkgp my pass (Gram): 3 of 3 chunks" in text
    assert engine.core.progress is True and engine.core.pass_name is None  # restored
    with pytest.raises(RuntimeError, match="inside"), reporting(engine.core, False, "failing"):
        raise RuntimeError("inside")
    assert engine.core.progress is True and engine.core.pass_name is None  # restored after an error too
    with pytest.raises(TypeError, match="progress must be True, False or None"), reporting(engine.core, 1, "bad"):
        pass
    assert engine.core.progress is True  # refused before anything changed
    engine.group_grams(x)
    assert "Gram" in said() and "my pass" not in said()  # the engine's own bar again, under its own name


# ---------------------------------------------------------------------------------------------- function space
def test_the_function_space_curvature_reports_its_gram_pass(said, announce_every_pass):
    net = network()
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    likelihood = SoftmaxLikelihood(num_classes=3)
    engine = NTKEngine(net, chunk_size=4, progress=True)  # its own setting: a bar; the function's option wins
    function_space_curvature(net, x, y, likelihood, engine=engine, progress=False)
    assert said() == ""
    assert engine.core.progress is True
    function_space_curvature(net, x, y, likelihood, engine=engine)  # auto, the default
    assert "ntkgp function-space curvature (Gram): 3 of 3 chunks" in said()
    function_space_curvature(net, x, y, likelihood, engine=engine, progress=True)
    assert "function-space curvature (Gram)" in said()
    exact_curvature(net, x, y, likelihood, space="function", engine=engine, progress=False)
    assert said() == ""
    exact_curvature(net, x, y, likelihood, space="weight", batch_size=4)  # its weight-space pass is auto too
    assert "ntkgp full GGN: 3 of 3 batches" in said()
    exact_curvature(net, x, y, likelihood, space="weight", batch_size=4, progress=False)
    assert said() == ""
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        exact_curvature(net, x, y, likelihood, space="weight", progress="no")


def test_train_marglik_with_progress_false_is_silent_in_its_function_space_rounds(said, announce_every_pass):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    x = torch.randn(12, 2, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    # N = 12 < P = 65 and 2 steps a round: the rounds take function space; the kernel's chunk of 4 makes its Gram
    # 3 chunks, whose auto progress (the kernel's default) used to print while train_marglik was asked to be silent
    schedule = HyperparameterSchedule(burn_in=1, frequency=1, hyper_steps=2, curvature_batch_size=4)
    result = train_marglik(net, x, torch.sin(x.sum(-1)), likelihood, structure="full_ggn", epochs=2,
                           schedule=schedule, lr=1e-2, progress=False)
    assert said() == ""
    assert result.kernel.progress is None  # the kernel handed back keeps its own (auto) option


# ---------------------------------------------------------------------------------------------- SFR
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # on a float64 copy of the network / itself
def test_sfr_inducing_features_and_kzz_follow_the_models_option(said, announce_every_pass, dtype):
    engine = NTKEngine(network(dtype), chunk_size=4)  # silent by default, as SFR's own engine
    z = torch.randn(12, 2, dtype=dtype)
    exact = inducing_features(engine, z, progress=None)
    assert "ntkgp SFR inducing inputs (layer features): 3 of 3 chunks" in said()
    inducing_grams(z, "joint", torch.float64, exact, progress=None)
    assert "ntkgp SFR K_ZZ (Gram): 3 of 3 chunks" in said()
    inducing_grams(z, "independent", torch.float64, exact, progress=True)
    assert "SFR K_ZZ" in said()
    silent = inducing_features(engine, z, progress=False)
    inducing_grams(z, "joint", torch.float64, silent, progress=False)
    inducing_grams(z, "joint", torch.float64, silent, weights=torch.ones(2, dtype=torch.float64), rows=4,
                   progress=False)
    assert said() == ""
    assert engine.core.progress is False and silent[1].core.progress is False


class SlowClock:
    """``time`` for ntkgp.progress alone: each reading is 10 s after the last."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 10.0
        return self.now


def test_the_combined_kzz_estimates_its_time_in_inducing_points(monkeypatch, said):
    monkeypatch.setattr(progress_module, "time", SlowClock())
    engine = NTKEngine(network(), chunk_size=4)
    z = torch.randn(40, 2, dtype=torch.float64)
    features = inducing_features(engine, z)[0]
    weights = torch.tensor([0.5, 2.0], dtype=torch.float64)
    gram = combined_system_gram(engine, z, "joint", weights, 4, torch.float64, features, progress=None)
    # start at 10 s; the first step of 4 points reads 20 s: 10 s elapsed, past ESTIMATE_AFTER_SECONDS, so the
    # estimate is formed at once: 2.5 s a point, 36 points left, 90 s: 100 s = 1.7 min in all (above 30 s)
    assert "ntkgp SFR K_ZZ: 4 of 40 points in 10 s; the pass will take about 1.7 min in all (1.5 min left)" in said()
    # the value is unchanged by the progress: the weighted per-group Grams of the engine (an independent route)
    dense = torch.einsum("g,gij->ij", weights, engine.group_grams(z))
    # the two routes sum the same P products J_g(z_i)·J_g(z_j) per entry in other orders (and group sums):
    # each entry's rounding is below P·ε·Σ_g w_g |J_g(z_i)||J_g(z_j)| ≤ P·ε·max_i K_ii (Cauchy-Schwarz),
    # times 4 for the sums over groups and the symmetrization
    bound = 4 * engine.num_params * torch.finfo(torch.float64).eps * dense.diagonal().max()
    assert (gram[0, 0] - dense).abs().max() <= bound
    combined_system_gram(engine, z, "joint", weights, 4, torch.float64, features, progress=False)
    assert said() == ""


def test_a_recomputation_after_loading_follows_sfr_progress(said, announce_every_pass):
    net = network()
    x, y = torch.randn(30, 2, dtype=torch.float64), torch.randint(0, 3, (30,))
    sfr = SFR(net, x, y, SoftmaxLikelihood(num_classes=3), num_inducing=12,
              memory=SFRMemoryOptions(batch_size=10, chunk_size=4), progress=False)
    assert said() == ""
    sfr.load_state_dict(sfr.state_dict())  # drops the cached features of Z: the next prediction recomputes them
    inducing_feature_set(sfr)
    assert said() == ""
    sfr.load_state_dict(sfr.state_dict())
    sfr.progress = None  # assigned after construction: the next recomputation follows it
    inducing_feature_set(sfr)
    assert "ntkgp SFR inducing inputs (layer features): 3 of 3 chunks" in said()
    inducing_feature_set(sfr)  # cached: no pass, nothing said
    assert said() == ""
    sfr(x[:3].clone().requires_grad_())  # a graph to the inputs: J(Z) of the 12 inducing inputs, 3 chunks
    assert "ntkgp SFR J(Z) (Jacobians): 3 of 3 chunks" in said()


def test_sfr_construction_and_prediction_report_their_passes(said, announce_every_pass):
    net = network()
    x, y = torch.randn(30, 2, dtype=torch.float64), torch.randint(0, 3, (30,))
    kwargs = {"num_inducing": 12, "memory": SFRMemoryOptions(batch_size=10, chunk_size=4)}
    sfr = SFR(net, x, y, SoftmaxLikelihood(num_classes=3), progress=False, **kwargs)
    sfr(x)
    assert said() == ""
    sfr = SFR(net, x, y, SoftmaxLikelihood(num_classes=3), **kwargs)  # auto, the default
    text = said()
    assert "ntkgp SFR inducing inputs (layer features): 3 of 3 chunks" in text
    assert "ntkgp SFR K_ZZ (Gram): 3 of 3 chunks" in text
    assert "ntkgp SFR dual statistics: 30 of 30 points" in text
    sfr(x)  # 3 chunks of 10 test points
    assert "ntkgp SFR prediction: 30 of 30 points" in said()
    SFR(net, x, y, SoftmaxLikelihood(num_classes=3), num_inducing=12,
        memory=SFRMemoryOptions(batch_size=4, chunk_size=4, statistics="combined"))
    assert "ntkgp SFR K_ZZ: 12 of 12 points" in said()


def test_sfr_statistics_report_the_window_passes_of_a_step(said, announce_every_pass, monkeypatch):
    # inducing inputs beyond the feature budget, recomputed in windows: each step passes its points once per window
    # (long passes at scale), and those passes report under the statistics' name; with every inducing input kept a
    # step is one pass and only the steps report
    import importlib

    from tests.ntk.test_cnn_passes import small_fmnist_cnn

    system_grams = importlib.import_module("ntkgp.models.sfr.system_grams")
    net = small_fmnist_cnn()
    x, y = torch.randn(14, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (14,))
    kwargs = {"num_inducing": 8, "output_coupling": "independent", "memory": SFRMemoryOptions(batch_size=7, chunk_size=3)}
    SFR(net, x, y, SoftmaxLikelihood(num_classes=3), **kwargs)
    text = said()
    assert "SFR K_ZZ (Gram)" in text and "SFR dual statistics (" not in text
    per_point = system_grams.inducing_feature_bytes(NTKEngine(net, "network"), x[:8])
    monkeypatch.setattr(system_grams, "INDUCING_FEATURE_BYTES", 6 * per_point)  # 3 kept, windows of 3
    SFR(net, x, y, SoftmaxLikelihood(num_classes=3), **kwargs)
    text = said()
    assert "ntkgp SFR dual statistics (Gram, inducing points 3-6): 3 of 3 chunks" in text
    assert "ntkgp SFR dual statistics (Gram, inducing points 6-8): 3 of 3 chunks" in text
    SFR(net, x, y, SoftmaxLikelihood(num_classes=3), progress=False, **kwargs)
    assert said() == ""
