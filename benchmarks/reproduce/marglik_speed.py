"""Algorithm 1 at the paper's protocol: cost of learning the hyperparameters on top of MAP training.

Immer et al. (2021), Table 1 protocol on boston (split 0, N = 455, D = 13), a 13-50-1 ReLU network,
Gaussian likelihood, full batch, Adam 1e-3 on the weights and on the hyperparameters, F = 1, K = 1, B = 0,
δ initialised to 1, layer-wise prior precisions, full GGN, float64. Measured side by side in one run:

1. **MAP only**: the same full-batch Adam training of the same objective with fixed hyperparameters, as a
   plain PyTorch loop (measured before and after the others, on a shared machine);
2. **train_marglik without hyperparameter learning** (``hyper_steps=0``, one evidence at the end);
3. **train_marglik**, full GGN, F = 1, K = 1, B = 0: the curvature built once per epoch at the current θ
   (function-space Grams, N < P), one factorization per step;
4. **laplace-torch** ``marglik_training`` (FullLaplace, the same protocol: ``marglik_frequency=1``,
   ``n_hypersteps=1``, ``n_epochs_burnin=0``, ``lr_hyp=1e-3``, ``prior_structure="layerwise"``), run in a
   separate interpreter (``--laplace-python``) for ``--laplace-epochs`` epochs and extrapolated linearly to
   ``--epochs`` (labelled so in the table);
5. **a lower bound** (not a training run): the MAP loop plus one ``N × N`` Cholesky factorization per epoch,
   what an exact evidence at a θ that changes every epoch cannot avoid (:func:`floor_run`).

    python -m benchmarks.reproduce.marglik_speed --data-dir DATA [--epochs 10000] \\
        [--laplace-python PATH --laplace-epochs 500] [--threads 1] [--write-docs]

DATA is the benchmark data folder (``uci_regression/boston`` inside; default ``$NTKGP_DATA_DIR``).
``--write-docs`` writes the table into ``docs/training.md`` (generated region ``marglik_speed``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpytorch
import torch
from torch import nn

from ntkgp._doctable import REPO_ROOT, markdown_table, write_block
from ntkgp.datasets import load_uci_regression
from ntkgp.training import HyperparameterSchedule, train_marglik

DOC = REPO_ROOT / "docs" / "training.md"
BLOCK = "marglik_speed"

LAPLACE_SCRIPT = r"""
import json, sys, time, torch
from laplace.marglik_training import marglik_training
torch.set_num_threads(int(sys.argv[3]))
data = torch.load(sys.argv[1])
net = torch.nn.Sequential(torch.nn.Linear(13, 50), torch.nn.ReLU(), torch.nn.Linear(50, 1)).double()
net.load_state_dict(data["state"])
x, y = data["x"], data["y"]
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
epochs = int(sys.argv[2])
start, cpu = time.perf_counter(), time.process_time()
la, model, margliks, losses = marglik_training(
    net, loader, likelihood="regression", hessian_structure="full", n_epochs=epochs, n_epochs_burnin=0,
    marglik_frequency=1, n_hypersteps=1, lr_hyp=1e-3, optimizer_kwargs={"lr": 1e-3}, prior_structure="layerwise",
    prior_prec_init=1.0, sigma_noise_init=1.0)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
from importlib.metadata import version
print(json.dumps({"wall": seconds, "seconds": cpu, "epochs": epochs, "version": version("laplace-torch"),
                  "torch": torch.__version__, "log_evidence_per_n": margliks[-1] / len(x) if margliks else None}))
"""


def boston_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 50), nn.ReLU(), nn.Linear(50, 1)).double()


def gaussian(noise: float = 1.0) -> gpytorch.likelihoods.GaussianLikelihood:
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = noise  # σ² = 1, as laplace-torch's sigma_noise_init = 1
    return lik


class Clock:
    """CPU seconds of this process (``time.process_time``: robust to other processes' load on a shared
    machine, with one thread the compute time) and wall-clock seconds."""

    def __enter__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cpu, self.wall = time.process_time() - self.cpu, time.perf_counter() - self.wall


def map_only(x: torch.Tensor, y: torch.Tensor, epochs: int, per_epoch=None) -> Clock:
    """Full-batch Adam on the MAP objective with δ = 1 and σ² = 1 fixed, a plain loop; ``per_epoch()``, when
    given, is called after every step (timed with it)."""
    net = boston_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    n = len(x)
    with Clock() as clock:
        for _ in range(epochs):
            opt.zero_grad()
            loss = (0.5 * (net(x).squeeze(-1) - y).square().sum()
                    + 0.5 * sum(p.square().sum() for p in net.parameters())) / n
            loss.backward()
            opt.step()
            if per_epoch is not None:
                per_epoch()
    return clock


def floor_run(x: torch.Tensor, y: torch.Tensor, epochs: int) -> Clock:
    """A lower bound of any exact evidence at F = 1 (not a training run): the MAP loop of :func:`map_only` plus,
    every epoch, one Cholesky factorization of an ``N × N`` positive definite matrix, the size of the evidence's
    matrix in function space (``N < P`` here). With the weights changing every epoch, an exact log-determinant
    at the new θ cannot avoid one factorization of a ``min(N·C, P)``-sized matrix; its gradient needs more (the
    route of ``train_marglik`` adds the inverse from the factor)."""
    n = len(x)
    features = torch.randn(n, 64, dtype=x.dtype, generator=torch.Generator().manual_seed(0))
    matrix = features @ features.T / 64 + torch.eye(n, dtype=x.dtype)
    return map_only(x, y, epochs, per_epoch=lambda: torch.linalg.cholesky_ex(matrix))


def ntkgp_run(x: torch.Tensor, y: torch.Tensor, epochs: int, hyper_steps: int) -> tuple[Clock, object]:
    net, lik = boston_net(), gaussian()
    burn_in = 0 if hyper_steps else epochs
    with Clock() as clock:
        result = train_marglik(net, x, y, lik, structure="full_ggn", prior_precision=1.0, epochs=epochs, lr=1e-3,
                               schedule=HyperparameterSchedule(hyper_lr=1e-3, burn_in=burn_in, frequency=1,
                                                               hyper_steps=hyper_steps),
                               progress=False)
    return clock, result


def laplace_run(python: str, x: torch.Tensor, y: torch.Tensor, epochs: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.pt"
        torch.save({"x": x, "y": y.unsqueeze(-1), "state": boston_net().state_dict()}, path)
        out = subprocess.run([python, "-c", LAPLACE_SCRIPT, str(path), str(epochs), str(threads)],
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("NTKGP_DATA_DIR"))
    parser.add_argument("--epochs", type=int, default=10_000)
    parser.add_argument("--laplace-python", default=None, help="an interpreter with laplace-torch (skipped if none)")
    parser.add_argument("--laplace-epochs", type=int, default=500, help="laplace-torch epochs measured (extrapolated)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.data_dir is None:
        parser.error("--data-dir (or $NTKGP_DATA_DIR) is required: the benchmark data folder")
    torch.set_num_threads(args.threads)
    split = load_uci_regression(args.data_dir, "boston", split=0)
    x, y = split.x_train, split.y_train.reshape(-1)
    epochs = args.epochs
    print(f"boston split 0: N = {len(x)}, D = {x.shape[1]}, P = 751, float64, {epochs} epochs, {args.threads} thread(s)")
    map_only(x, y, 20)  # warm-up (imports, allocator)
    ntkgp_run(x, y, 3, hyper_steps=1)
    c_map1 = map_only(x, y, epochs)
    print(f"MAP only (plain loop): {c_map1.cpu:.1f} s CPU ({c_map1.wall:.1f} s wall)", flush=True)
    c_none, _ = ntkgp_run(x, y, epochs, hyper_steps=0)
    print(f"train_marglik, no hyperparameter learning: {c_none.cpu:.1f} s CPU ({c_none.wall:.1f} s wall)", flush=True)
    c_ml, result = ntkgp_run(x, y, epochs, hyper_steps=1)
    print(f"train_marglik full GGN F=1 K=1: {c_ml.cpu:.1f} s CPU ({c_ml.wall:.1f} s wall), log evidence/N "
          f"{result.log_evidence:.4f}, δ {[round(v, 4) for v in result.prior_precision.tolist()]}, "
          f"σ² {result.likelihood.noise.item():.4f}", flush=True)
    c_floor = floor_run(x, y, epochs)
    print(f"lower bound (MAP loop + one N x N Cholesky per epoch): {c_floor.cpu:.1f} s CPU ({c_floor.wall:.1f} s wall)",
          flush=True)
    c_map2 = map_only(x, y, epochs)
    print(f"MAP only (plain loop), again: {c_map2.cpu:.1f} s CPU ({c_map2.wall:.1f} s wall)", flush=True)
    t_map, t_none, t_ml = 0.5 * (c_map1.cpu + c_map2.cpu), c_none.cpu, c_ml.cpu
    w_map, w_none, w_ml = 0.5 * (c_map1.wall + c_map2.wall), c_none.wall, c_ml.wall
    laplace = None
    if args.laplace_python:
        laplace = laplace_run(args.laplace_python, x, y, args.laplace_epochs, args.threads)
        laplace["extrapolated"] = laplace["seconds"] * epochs / laplace["epochs"]
        laplace["wall_extrapolated"] = laplace["wall"] * epochs / laplace["epochs"]
        print(f"laplace-torch {laplace['version']}: {laplace['seconds']:.1f} s CPU ({laplace['wall']:.1f} s wall) for "
              f"{laplace['epochs']} epochs, {laplace['extrapolated']:.0f} s CPU for {epochs} (extrapolated)", flush=True)

    def row(label, cpu, wall, per_epoch):
        return [label, f"{cpu:.1f}", f"{wall:.1f}", f"{per_epoch * 1e3:.2f}", f"{cpu / t_map:.2f}"]

    rows = [
        row("MAP only (plain PyTorch loop, mean of the runs before and after)", t_map, w_map, t_map / epochs),
        row("`train_marglik`, `hyper_steps=0` (no hyperparameter learning)", t_none, w_none, t_none / epochs),
        row("`train_marglik`, full GGN, F = 1, K = 1, B = 0", t_ml, w_ml, t_ml / epochs),
        row(f"lower bound of any exact evidence at F = 1 (not a training run): the MAP loop plus one {len(x)} × "
            f"{len(x)} Cholesky factorization per epoch", c_floor.cpu, c_floor.wall, c_floor.cpu / epochs),
    ]
    if laplace is not None:
        rows.append(row(f"laplace-torch {laplace['version']} `marglik_training`, FullLaplace (measured "
                        f"{laplace['epochs']} epochs, extrapolated)", laplace["extrapolated"],
                        laplace["wall_extrapolated"], laplace["seconds"] / laplace["epochs"]))
    table = markdown_table([f"{epochs} epochs, boston", "CPU seconds", "wall seconds", "CPU ms per epoch",
                            "× MAP only (CPU)"], rows)
    ratios = f"train_marglik / MAP only = {t_ml / t_map:.2f}; lower bound / MAP only = {c_floor.cpu / t_map:.2f}"
    if laplace is not None:
        ratios += f"; train_marglik / laplace-torch = {t_ml / laplace['extrapolated']:.3f}"
    summary = (f"{table}\n\n{ratios} (CPU time of the process, {args.threads} thread(s)). Learned by ntkgp: "
               f"δ = {[round(v, 3) for v in result.prior_precision.tolist()]}, "
               f"σ² = {result.likelihood.noise.item():.4f}, log q(D)/N = {result.log_evidence:.4f}.")
    print(summary)
    if args.write_docs:
        command = f"python -m benchmarks.reproduce.marglik_speed --data-dir DATA --epochs {epochs} --threads {args.threads}"
        if laplace is not None:
            command += f" --laplace-python LAPLACE_PYTHON --laplace-epochs {args.laplace_epochs}"
        write_block(DOC, BLOCK, summary, command + " --write-docs")
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
