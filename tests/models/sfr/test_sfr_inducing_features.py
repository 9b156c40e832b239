"""SFR computes its inducing inputs' layer features once per model (issue 27): for K_ZZ, the statistics and every
prediction chunk; a float32 network's are computed on the float64 copy and kept in float64. The results equal a model
that recomputes them (the features are the same numbers), checked against the dense reference elsewhere
(test_sfr_dense_reference)."""

import copy
import importlib
from unittest import mock

import pytest
import torch

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from ntkgp.ntk import NTKEngine, feature_pass
from ntkgp.ntk.feature_pass import FeatureSet
from tests.helpers import EPS32, rel_err
from tests.ntk.test_cnn_passes import small_fmnist_cnn
from ntkgp.models import SFRInducingOptions, SFRMemoryOptions

system_grams = importlib.import_module("ntkgp.models.sfr.system_grams")


def data(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.randn(30, 1, 8, 8, dtype=dtype), torch.randint(0, 3, (30,)), torch.randn(11, 1, 8, 8, dtype=dtype)


@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inducing_features_are_computed_once_per_model(coupling, dtype):
    net = small_fmnist_cnn().to(dtype)
    x, y, xs = data(dtype)
    calls = []
    real = NTKEngine.feature_set

    def spy(engine, z, **kwargs):
        calls.append((z.shape[0], engine.dtype))
        return real(engine, z, **kwargs)

    with mock.patch.object(NTKEngine, "feature_set", spy):
        sfr = SFR(net, x, y, SoftmaxLikelihood(3).to(dtype), num_inducing=8, output_coupling=coupling,
                  memory=SFRMemoryOptions(batch_size=7))
        for chunk in (3, 5):
            sfr(xs, chunk_size=chunk).variance
        sfr.update(x[:5], y[:5])  # iterated sites
        sfr.update(x[5:9], y[5:9], iterate=False)
        sfr(xs).variance
    assert calls == [(8, torch.float64)]  # once, on the float64 copy for a float32 network


@pytest.mark.parametrize("coupling", ["joint", "independent"])
def test_a_model_without_kept_features_predicts_the_same(coupling, monkeypatch):
    net = small_fmnist_cnn()
    x, y, xs = data()
    kw = {"num_inducing": 8, "output_coupling": coupling, "memory": SFRMemoryOptions(batch_size=7)}
    kept = SFR(net, x, y, SoftmaxLikelihood(3).double(), **kw)
    monkeypatch.setattr(system_grams, "INDUCING_FEATURE_BYTES", 0)  # too large to keep: recomputed per use
    recomputed = SFR(net, x, y, SoftmaxLikelihood(3).double(), **kw)
    assert [e.kept_points for e in recomputed._cache.entries() if isinstance(e, FeatureSet)] == [0]
    d1, d2 = kept(xs, chunk_size=4), recomputed(xs, chunk_size=4)
    assert rel_err(d1.mean, d2.mean) < 1e-12 and rel_err(d1.covariance_matrix, d2.covariance_matrix) < 1e-12
    assert abs(kept.log_marginal_likelihood().item() - recomputed.log_marginal_likelihood().item()) < 1e-9


def test_features_are_recomputed_after_load_state_dict():
    net = small_fmnist_cnn()
    x, y, xs = data()
    sfr = SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=8)
    before = sfr(xs).mean
    other = SFR(net, x[:20], y[:20], SoftmaxLikelihood(3).double(), num_inducing=6,
                inducing=SFRInducingOptions(seed=3))
    sfr_state = other.state_dict()
    fresh = SFR(net, x, y, SoftmaxLikelihood(3).double(), inducing_points=other.inducing_points)
    fresh.load_state_dict(sfr_state)  # other Z size is not allowed; same Z: the loaded statistics are other's
    assert rel_err(fresh(xs).mean, other(xs).mean) < 1e-10
    assert rel_err(sfr(xs).mean, before) == 0


def test_default_chunk_size_follows_the_memory_budget():
    net = small_fmnist_cnn()
    x, y, _ = data()
    sfr = SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=8)
    assert sfr.chunk_size == system_grams.auto_chunk_size(sfr.engine, x[:1]) == sfr.engine.chunk_size
    with mock.patch("ntkgp.ntk.feature_pass.CHUNK_BYTES", 1):
        assert system_grams.auto_chunk_size(sfr.engine, x[:1]) == 1
    assert SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=8,
               memory=SFRMemoryOptions(chunk_size=5)).engine.chunk_size == 5


@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_features_beyond_the_budget_are_recomputed_in_windows_and_give_the_same_model(coupling, dtype, monkeypatch):
    """A budget of 6 of the 8 inducing inputs (chunks of 3): 3 kept (the first chunk), the two others recomputed (in
    float64: the same numbers) in windows of 3 points (one chunk each), each once per step of data, whose chunks pass
    through the network again for each window; a step of a single chunk recomputes them chunk by chunk. The model
    equals the one that keeps them all. The budget counts what a kept feature set holds (``FeatureSet.nbytes``), in
    float64 also for a float32 network."""
    net = small_fmnist_cnn().to(dtype)
    x, y, xs = data(dtype)
    kw = {"num_inducing": 8, "output_coupling": coupling, "memory": SFRMemoryOptions(batch_size=7, chunk_size=3)}
    kept = SFR(net, x, y, SoftmaxLikelihood(3).to(dtype), **kw)
    z = kept.inducing_points
    precise = NTKEngine(copy.deepcopy(net).double(), "network")  # the features are kept in float64
    per_point = system_grams.inducing_feature_bytes(precise, z.double())
    assert precise.feature_set(z.double()).nbytes() == 8 * per_point
    monkeypatch.setattr(system_grams, "INDUCING_FEATURE_BYTES", 6 * per_point + per_point // 2)
    sizes = []
    real = feature_pass.chunk_features

    def spy(core, plan, xc, *args, **kwargs):
        sizes.append((xc.shape[0], kwargs.get("single", True)))
        return real(core, plan, xc, *args, **kwargs)

    with mock.patch("ntkgp.ntk.feature_pass.chunk_features", spy), \
            mock.patch("ntkgp.ntk.feature_windows.chunk_features", spy), mock.patch("ntkgp.ntk.grams.chunk_features", spy):
        partial = SFR(net, x, y, SoftmaxLikelihood(3).to(dtype), **kw)
        build = list(sizes)
        d1, d2 = kept(xs, chunk_size=4), partial(xs, chunk_size=4)
    [features] = [e for e in partial._cache.entries() if isinstance(e, FeatureSet)]
    assert features.kept_points == 3 and features.window == 3 and features.dtype == torch.float64
    recomputed = [n for n, single in build if not single]
    zz = [3, 2, 3]  # K_ZZ: the window 3:6, the window 6:8 and the chunk 3:6 of the window before it, once each
    expected = list(zz)
    for step in x.split(7):  # steps of 7 points, chunks of 3
        chunks = [len(step[s : s + 3]) for s in range(0, len(step), 3)]
        # several chunks: each window recomputed once, the step's chunks passed again for it; else chunk by chunk
        expected += [3, *chunks, 2, *chunks] if len(chunks) > 1 else [3, 2] * len(chunks)
    assert sorted(recomputed) == sorted(expected)
    # the same float64 numbers (the same passes, the features of Z recomputed as they were kept) up to float64
    # rounding; a float32 model rounds each result once more to float32 (ε₃₂ relatively, entry by entry)
    tol = 1e-12 + (EPS32 if dtype == torch.float32 else 0.0)
    assert rel_err(d1.mean, d2.mean) < tol and rel_err(d1.covariance_matrix, d2.covariance_matrix) < tol


def test_the_kept_features_budget_is_an_option(monkeypatch):
    # SFRMemoryOptions(inducing_feature_bytes=...): 0 keeps none (each use recomputes them), a large budget keeps
    # all 8 even where the module's default would keep none; the predictive is the same numbers either way
    # (float64: the same products in another order, 1e-10); the option is checked and fixed after construction
    net = small_fmnist_cnn()
    x, y, xs = data()
    monkeypatch.setattr(system_grams, "INDUCING_FEATURE_BYTES", 0)
    models = {budget: SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=8,
                          memory=SFRMemoryOptions(batch_size=7, inducing_feature_bytes=budget))
              for budget in (0, 2**30, None)}
    kept = {b: [e.kept_points for e in m._cache.entries() if isinstance(e, FeatureSet)] for b, m in models.items()}
    assert kept == {0: [0], 2**30: [8], None: [0]}
    ref = models[2**30](xs)
    for budget in (0, None):
        out = models[budget](xs)
        assert torch.allclose(out.mean, ref.mean, rtol=1e-10, atol=1e-12)
        assert torch.allclose(out.variance, ref.variance, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="inducing_feature_bytes"):
        SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=8, memory=SFRMemoryOptions(inducing_feature_bytes=-1))
    with pytest.raises(AttributeError, match="inducing_feature_bytes"):
        models[0].inducing_feature_bytes = 2**30


@pytest.mark.parametrize("coupling", ["joint", "independent"])
def test_steps_are_long_against_the_window(coupling, monkeypatch):
    # with windows, a step's float64 cross-Grams (G·M·C numbers per point, ·C joint) may take a quarter of the window's
    # features, so that the recomputation of Z once per step is small against the step's passes; without, the
    # SFR_STEP_BYTES rows; batch_size overrides both
    net = small_fmnist_cnn()
    x, y, _ = data()
    sfr = SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=8, output_coupling=coupling)
    z = sfr.inducing_points
    per_feature = system_grams.inducing_feature_bytes(sfr.engine, z)  # float64 network: float64 bytes
    per_point = sfr.engine.num_groups * 8 * 3 * (3 if coupling == "joint" else 1) * 8  # G·M·C(·C) float64 numbers
    monkeypatch.setattr(system_grams, "SFR_STEP_BYTES", 3 * per_point)
    assert sfr._rows_per_step() == 3  # all 8 kept: no window
    monkeypatch.setattr(system_grams, "INDUCING_FEATURE_BYTES", 6 * per_feature)
    assert system_grams.feature_split(sfr.engine, z) == (3, 3)
    assert sfr._rows_per_step() == max(3, 3 * per_feature // (4 * per_point))
    assert SFR(net, x, y, SoftmaxLikelihood(3).double(), num_inducing=8, output_coupling=coupling,
               memory=SFRMemoryOptions(batch_size=5))._rows_per_step() == 5
