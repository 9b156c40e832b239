"""Every long pass takes ``progress=None|True|False`` through ntkgp.progress: the NTK's chunk passes (NTKKernel,
NTKGP), SFR's pass over the data, the epochs of train_fsvi and train_marglik. ``True`` shows a bar, ``None`` off a
terminal one line with the estimated time (here forced for any duration), ``False`` nothing at all (stderr and the
``"ntkgp"`` logger both checked); an option assigned after construction is honoured, a bad one refused."""

import logging

import gpytorch
import pytest
import torch

import ntkgp.progress as progress_module
from ntkgp import NTKGP, NTKKernel
from ntkgp.fsvi import train_fsvi
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models import SFRMemoryOptions
from ntkgp.models.sfr import SFR
from ntkgp.progress import Progress
from ntkgp.training import HyperparameterSchedule, train_marglik


def regression(n=12):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()
    x = torch.randn(n, 2, dtype=torch.float64)
    return net, x, torch.sin(x.sum(-1))


def classification(n=40, c=3):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, c)).double()
    return net, torch.randn(n, 2, dtype=torch.float64), torch.randint(0, c, (n,))


# ---------------------------------------------------------------------------------------------- the NTK Gram
def test_the_ntk_gram_pass_shows_a_bar_a_line_or_nothing(said, announce_every_pass):
    net, x, _ = regression()
    kernel = NTKKernel(net, chunk_size=4, progress=True)
    kernel(x).to_dense()
    assert "Gram" in said()  # a bar over the 3 chunks
    kernel.progress = None  # assigned after construction: the kernel's engine follows
    kernel(x[:8]).to_dense()
    assert "ntkgp Gram: 2 of 2 chunks" not in (err := said()) and "ntkgp Gram" not in err
    kernel(x).to_dense()  # 3 chunks: the estimate is formed after them (a 2-chunk pass needs none)
    assert "ntkgp Gram: 3 of 3 chunks" in said()
    kernel.progress = False
    kernel(x.flip(0)).to_dense()
    assert said() == ""
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        kernel.progress = 1
    assert kernel.progress is False and kernel.engine.core.progress is False


def test_the_kernel_defaults_to_auto():
    net, _, _ = regression()
    assert NTKKernel(net).progress is None


# ---------------------------------------------------------------------------------------------- NTKGP
def test_an_ntkgp_evidence_step_reports_its_training_data_pass(said, announce_every_pass):
    net, x, y = regression()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    NTKGP(net, x, y, likelihood, chunk_size=4, progress=False).log_marginal_likelihood()
    assert said() == ""
    NTKGP(net, x, y, likelihood, chunk_size=4).log_marginal_likelihood()  # auto (the kernel's default)
    assert "ntkgp Gram: 3 of 3 chunks" in said()
    model = NTKGP(net, x, y, likelihood, chunk_size=4, progress=False)
    model.progress = True  # the kernel's option, assigned on the model before its first pass
    assert model.covar_module.progress is True
    model.log_marginal_likelihood()
    assert "Gram" in said()


# ---------------------------------------------------------------------------------------------- SFR
def test_the_sfr_pass_over_the_data_estimates_its_time_in_points(said, announce_every_pass):
    net, x, y = classification()
    kwargs = {"num_inducing": 4, "memory": SFRMemoryOptions(batch_size=5)}
    SFR(net, x, y, SoftmaxLikelihood(num_classes=3), progress=False, **kwargs)
    assert said() == ""
    sfr = SFR(net, x, y, SoftmaxLikelihood(num_classes=3), **kwargs)  # auto: 3 steps of 5 of the 40 points
    assert sfr.progress is None
    assert "ntkgp SFR dual statistics: 15 of 40 points" in said()
    sfr.progress = True  # assigned after construction: read by update
    sfr.update(x[:10], y[:10], iterate=False)
    assert "SFR dual statistics" in said()
    sfr.progress = False
    sfr.update(x[10:20], y[10:20], iterate=False)
    assert said() == ""
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        sfr.progress = "yes"
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        SFR(net, x, y, SoftmaxLikelihood(num_classes=3), progress=0, **kwargs)


def test_a_loader_gives_the_sfr_pass_its_number_of_points(said, announce_every_pass):
    net, x, y = classification()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)
    SFR(net, loader, None, SoftmaxLikelihood(num_classes=3), num_inducing=4,
        memory=SFRMemoryOptions(batch_size=5))
    assert "ntkgp SFR dual statistics: 15 of 40 points" in said()


# ---------------------------------------------------------------------------------------------- training loops
def test_train_fsvi_reports_its_epochs(said, announce_every_pass):
    net, x, y = regression()
    args = (net, x, y, gpytorch.likelihoods.GaussianLikelihood().double())
    kwargs = {"prior_precision": 1.0, "epochs": 4, "batch_size": None, "num_context": 4}
    train_fsvi(*args, progress=False, **kwargs)
    assert said() == ""
    train_fsvi(*args, **kwargs)
    assert "ntkgp FSVI: 3 of 4 epochs" in said()
    train_fsvi(*args, progress=True, **kwargs)
    assert "FSVI" in said()
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        train_fsvi(*args, progress="no", **kwargs)


def test_train_marglik_reports_its_epochs(said, announce_every_pass):
    net, x, y = regression()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    kwargs = {"structure": "full_ggn", "epochs": 4,
                  "schedule": HyperparameterSchedule(burn_in=1, frequency=2, hyper_steps=2), "lr": 1e-2}
    train_marglik(net, x, y, likelihood, progress=False, **kwargs)
    assert said() == ""
    train_marglik(net, x, y, likelihood, **kwargs)
    assert "ntkgp marglik training: 3 of 4 epochs" in said()
    train_marglik(net, x, y, likelihood, progress=True, **kwargs)
    assert "marglik training" in said()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        train_marglik(net, x, y, likelihood, progress=1, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # refused before any step


# ---------------------------------------------------------------------------------------------- the helper
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_uneven_updates_estimate_per_unit(monkeypatch, said, announce_every_pass):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    with Progress(total=1000, desc="points", progress=None, unit="point") as bar:
        for n in (100, 50, 50):  # 1 s per update: the first (100 points) is excluded from the rate
            clock.now += 1.0
            bar.update(n)
    # 3 s for 200 points; the rate is 2 s per 100 points (the last two updates), 800 left: 3 + 16 = 19 s
    assert "points: 200 of 1000 points in 3 s; the pass will take about 19 s in all" in said()


def test_the_estimate_goes_to_the_logger_when_it_is_configured(monkeypatch, caplog, capsys, announce_every_pass):
    caplog.set_level(logging.INFO, logger="ntkgp")
    with Progress(total=10, desc="KFAC", progress=None) as bar:
        for _ in range(3):
            bar.update()
    assert any("KFAC: 3 of 10 batches" in r.getMessage() for r in caplog.records)
    assert "KFAC" not in capsys.readouterr().err


def test_auto_on_a_terminal_is_a_delayed_bar_and_true_an_immediate_one(monkeypatch):
    made = []

    class Recorder:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def update(self, n):
            pass

        def close(self):
            pass

    monkeypatch.setattr(progress_module, "tqdm", Recorder)
    monkeypatch.setattr(progress_module, "_terminal", lambda: True)
    Progress(5, "a", None).close()
    Progress(5, "b", True).close()
    Progress(5, "c", False).close()
    assert [(m["desc"], m["delay"]) for m in made] == [("a", progress_module.BAR_DELAY_SECONDS), ("b", 0.0)]
    monkeypatch.setattr(progress_module, "_terminal", lambda: False)
    Progress(5, "d", None).close()  # off a terminal: no bar, the one-line estimate instead
    assert len(made) == 2
