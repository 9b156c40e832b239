"""The float32 predictive mean of NTKGP against the same model on a float64 copy of the network.

For each case the largest error at the test points of the mean as NTKGP computes it (the network output plus
the Newton step's correction, ``ntkgp.models.ntkgp.newton_step``) and of the GP form ``m(x*) + K*X w`` with the
linearized prior mean ``m = f − Jθ*`` (the formula before, evaluated from the same float32 site posterior:
``SitePosterior.mean_correction``), whether the model warned (``NumericalWarning``), and the float64 posterior
standard deviation (its smallest value at the test points), for scale. Cases: a 1-16-1 tanh MLP fit to N = 100
targets in [-1, 1] (300 Adam steps on the mean squared error; the problem of
``tests/models/test_ntkgp_float32_mean.py``) at Gaussian noise 1e-4 and 1e-3, in the space ``"auto"`` takes
(weight) and in function space; a conv-tanh-linear network on 64 random 8x8 images (P = 185, function space)
after 100 and 1000 Adam steps toward the MAP at noise 1e-4.

    python benchmarks/float32_mean.py [--write-docs]

``--write-docs`` writes the table into docs/ntkgp.md (generated region ``ntkgp-float32-mean``).
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import gpytorch
import torch
from linear_operator.utils.warnings import NumericalWarning

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block

DOC = "docs/ntkgp.md"
F32, F64 = torch.float32, torch.float64


def mlp_problem():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 100).unsqueeze(-1)
    y = torch.sin(2 * x).squeeze(-1) + 0.05 * torch.randn(100)
    net = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(300):
        optimizer.zero_grad()
        ((net(x).squeeze(-1) - y) ** 2).mean().backward()
        optimizer.step()
    return net, x, y, torch.linspace(-3, 3, 50).unsqueeze(-1)


def cnn_problem(steps: int, noise: float):
    torch.manual_seed(0)
    x = torch.randn(64, 1, 8, 8)
    y = torch.tanh(4 * x.mean((1, 2, 3)))
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(144, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for i in range(steps):
        if i == int(0.7 * steps):
            optimizer.param_groups[0]["lr"] = 1e-3
        optimizer.zero_grad()
        loss = ((net(x).squeeze(-1) - y) ** 2).sum() / (2 * noise) + 0.5 * sum((p**2).sum() for p in net.parameters())
        loss.backward()
        optimizer.step()
    return net, x, y, torch.randn(30, 1, 8, 8)


def gaussian(noise: float, dtype: torch.dtype):
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    likelihood.noise = noise
    return likelihood


def gp_form(model, x_test) -> torch.Tensor:
    """``m(x*) + K*X w``, the linearized prior mean plus the site posterior's weights (the formula before)."""
    post = model.site_posterior()
    x = model._flat_inputs(x_test, "x")
    cross = model.covar_module(x, model.train_x).to_dense().to(post.dtype)
    prior = model.mean_module.values(x).to(post.dtype).reshape(-1)
    return (prior + post.mean_correction(cross)).reshape(x.shape[0], -1).squeeze(-1)


def measure(net, x, y, x_test, noise: float, space: str) -> list:
    model = ntkgp.NTKGP(net, x, y, gaussian(noise, F32), space=space).eval()
    reference = ntkgp.NTKGP(copy.deepcopy(net).double(), x.double(), y.double(), gaussian(noise, F64), space=space)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mean = model(x_test).mean.double()
        before = gp_form(model, x_test).double()
        pred = reference.eval()(x_test.double())
    warned = any(issubclass(w.category, NumericalWarning) and "predictive mean" in str(w.message) for w in caught)
    return [
        model.site_posterior().space.value,
        f"{(before - pred.mean).abs().max():.2g}",
        f"{(mean - pred.mean).abs().max():.2g}",
        "yes" if warned else "no",
        f"{pred.variance.sqrt().min():.2g}",
    ]


def table() -> str:
    rows = []
    net, x, y, x_test = mlp_problem()
    for noise in (1e-4, 1e-3):
        for space in ("auto", "function"):
            rows.append([f"1-16-1 tanh MLP, N = 100, noise {noise:g}", space, *measure(net, x, y, x_test, noise, space)])
    for steps in (100, 1000):
        net, x, y, x_test = cnn_problem(steps, 1e-4)
        rows.append([f"conv-tanh-linear, 64 8x8 images, noise 1e-4, {steps} Adam steps", "auto",
                     *measure(net, x, y, x_test, 1e-4, "auto")])
    header = ["case", "space=", "space used", "GP form m + K*X w", "f + J s (NTKGP)", "warned", "float64 posterior sd (min)"]
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOC}")
    args = parser.parse_args()
    start = time.perf_counter()
    text = table()
    text += f"\n\nLargest error of the float32 mean against float64; {time.perf_counter() - start:.0f} s in all."
    print(text)
    if args.write_docs:
        write_block(DOC, "ntkgp-float32-mean", text, command_line())


if __name__ == "__main__":
    main()
