"""Every public entry of the engine validates its inputs before any side effect, naming the argument; the
vocabulary (prior_structure=, Strategy)."""

import pytest
import torch
from torch import nn

from ntkgp.caching import ValueCache
from ntkgp.ntk import NTKEngine, resolve_groups
from tests.helpers import assert_unchanged, mlp, rel_err, snapshot


def engine_and_x():
    net = mlp(d_out=2)
    return NTKEngine(net), torch.randn(6, 3, dtype=torch.float64), net


def test_matvec_rejects_a_weight_vector_of_the_wrong_length():
    engine, x, _ = engine_and_x()
    v = torch.randn(12, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\)"):
        engine.matvec(x, v, torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="weights must have shape"):
        engine.matvec(x, v, torch.ones(3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="weights must be non-negative"):
        engine.matvec(x, v, torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="weights contains NaN"):
        engine.matvec(x, v, torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"v must have shape \(12,\) or \(12, k\)"):
        engine.matvec(x, torch.randn(10, dtype=torch.float64), torch.ones(3, dtype=torch.float64))


def test_products_validate_their_vectors():
    engine, x, _ = engine_and_x()
    bad = torch.randn(12, 2, dtype=torch.float64)
    bad[11, 1] = float("inf")
    with pytest.raises(ValueError, match="v contains NaN or Inf"):
        engine.vjp(x, bad)
    with pytest.raises(TypeError, match="v must be a floating-point"):
        engine.vjp(x, torch.ones(12, dtype=torch.long))
    u = {n: torch.randn(s, dtype=torch.float64) for n, s in zip(engine.groups.names, engine.groups.shapes)}
    missing = dict(list(u.items())[1:])
    with pytest.raises(ValueError, match="u must name every trainable parameter"):
        engine.jvp(x, missing)
    wrong = {**u, "0.weight": torch.randn(2, 2, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"u\['0.weight'\] must have shape"):
        engine.jvp(x, wrong)


@pytest.mark.parametrize("method", ["group_grams", "output_grams", "diag_blocks", "jacobian", "outputs"])
def test_nan_in_any_row_is_rejected_before_anything_is_computed(method):
    engine, x, net = engine_and_x()
    x[5, 2] = float("nan")
    before = snapshot(net)
    with pytest.raises(ValueError, match="contains NaN or Inf"):
        getattr(engine, method)(x)
    assert engine.core._plans == {} and engine.core._num_outputs is None
    assert_unchanged(net, before)


def test_inputs_that_do_not_fit_the_network_name_the_argument():
    engine, x, _ = engine_and_x()
    with pytest.raises(ValueError, match="x2 of shape \\(4, 5\\).*does not fit the network"):
        engine.group_grams(x, torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="x of shape \\(6,\\).*does not fit"):
        engine.diag_blocks(torch.randn(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="x of shape \\(6, 3\\) and dtype torch.int64 does not fit"):
        engine.outputs(torch.ones(6, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="x must be a real tensor"):
        engine.outputs(torch.ones(6, 3, dtype=torch.complex128))
    with pytest.raises(ValueError, match="at least one example"):
        engine.outputs(torch.ones(0, 3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"chunk_size": True}, "chunk_size"),
        ({"strategy": "fast"}, "strategy must be one of 'auto', 'contraction', 'structured'"),
        ({"max_jacobian_bytes": -1}, "max_jacobian_bytes"),
        ({"input_shape": (3, 0)}, "input_shape"),
        ({"prior_structure": "layers"}, "prior_structure must be one of"),
    ],
)
def test_constructor_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NTKEngine(mlp(), **kwargs)


def test_unknown_keywords_are_rejected():
    net = mlp(d_out=2)
    with pytest.raises(TypeError, match="groups"):
        NTKEngine(net, groups="network")
    with pytest.raises(TypeError, match="groups"):
        resolve_groups(net, groups="network")


def test_parameters_are_the_networks_tensors_and_key_a_value_cache():
    net = mlp(d_out=2)
    engine = NTKEngine(net)
    params = engine.parameters()
    assert [id(p) for p in params] == [id(p) for p in net.parameters()]
    x = torch.randn(4, 3, dtype=torch.float64)
    cache = ValueCache(size=2)
    first = cache.get_or_compute("grams", [x], lambda: engine.group_grams(x), state=engine.parameters())
    with torch.no_grad():
        net[0].weight.data.mul_(2.0)  # a .data write: the version-counter key would miss it
    second = cache.get_or_compute("grams", [x], lambda: engine.group_grams(x), state=engine.parameters())
    assert not torch.allclose(first, second)
    assert rel_err(second, NTKEngine(net).group_grams(x)) < 1e-15


def test_structured_strategy_rejects_layers_called_twice_with_the_argument_named():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    net = Twice().double()
    with pytest.raises(ValueError, match="strategy='structured' cannot treat layers \\['fc'\\].*more than once"):
        NTKEngine(net, strategy="structured").diag_blocks(torch.randn(3, 3, dtype=torch.float64))


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.BatchNorm2d])
def test_batchnorm_without_running_statistics_is_rejected_in_eval_mode(norm):
    """Without running statistics BatchNorm normalizes with each batch's statistics even in eval mode: one
    input's output depends on the rest of its batch, so there is no NTK."""
    from ntkgp import NTKKernel

    if norm is nn.BatchNorm1d:
        net = nn.Sequential(nn.Linear(3, 4), norm(4, track_running_stats=False), nn.Linear(4, 1)).double().eval()
    else:
        net = nn.Sequential(nn.Conv2d(1, 2, 3), norm(2, track_running_stats=False), nn.Flatten(),
                            nn.Linear(18, 1)).double().eval()
    with pytest.raises(ValueError, match="track_running_stats=False"):
        NTKKernel(net)


def test_instance_norm_tracking_running_statistics_in_training_mode_is_refused_before_any_update():
    """InstanceNorm normalizes each example by its own statistics (a function of one input), but in training mode
    with ``track_running_stats=True`` every forward pass updates its running buffers: the user's network would be
    modified, so it is refused (and accepted in eval mode, or without running statistics)."""
    from ntkgp import NTKKernel

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, track_running_stats=True), nn.Flatten(),
                        nn.Linear(18, 1)).double()
    before = net[1].running_mean.clone()
    with pytest.raises(ValueError, match="InstanceNorm2d module '1' in training mode with track_running_stats"):
        NTKKernel(net)
    assert torch.equal(net[1].running_mean, before) and net[1].num_batches_tracked.item() == 0
    NTKKernel(net.eval())
    NTKKernel(nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2), nn.Flatten(), nn.Linear(18, 1)).double())


def test_fingerprint_is_exact_and_does_not_depend_on_threads():
    """The frozen parameters' key: integer sums of the bit patterns, the same for any number of threads (a float
    sum is not), and changed by a change of one entry by one ulp."""
    from ntkgp.caching import fingerprint

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4_000_000, generator=g), torch.randn(300, 7, generator=g, dtype=torch.float64),
               torch.randn(50, generator=g).half()]
    threads = torch.get_num_threads()
    try:
        keys = []
        for n in (1, 2):
            torch.set_num_threads(n)
            keys.append(fingerprint(tensors))
    finally:
        torch.set_num_threads(threads)
    assert keys[0].dtype == torch.int64 and keys[0].shape == (6,) and torch.equal(keys[0], keys[1])
    changed = [t.clone() for t in tensors]
    changed[0][123] = torch.nextafter(changed[0][123], torch.tensor(float("inf")))
    assert not torch.equal(fingerprint(changed)[:2], keys[0][:2])
