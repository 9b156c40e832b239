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
   ``--epochs`` (labelled so in the table).

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
from ntkgp.training import train_marglik

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
start = time.perf_counter()
la, model, margliks, losses = marglik_training(
    net, loader, likelihood="regression", hessian_structure="full", n_epochs=epochs, n_epochs_burnin=0,
    marglik_frequency=1, n_hypersteps=1, lr_hyp=1e-3, optimizer_kwargs={"lr": 1e-3}, prior_structure="layerwise",
    prior_prec_init=1.0, sigma_noise_init=1.0)
seconds = time.perf_counter() - start
from importlib.metadata import version
print(json.dumps({"seconds": seconds, "epochs": epochs, "version": version("laplace-torch"),
                  "torch": torch.__version__, "log_evidence_per_n": margliks[-1] / len(x) if margliks else None}))
"""


def boston_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 50), nn.ReLU(), nn.Linear(50, 1)).double()


def gaussian(noise: float = 1.0) -> gpytorch.likelihoods.GaussianLikelihood:
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = noise  # σ² = 1, as laplace-torch's sigma_noise_init = 1
    return lik


def map_only(x: torch.Tensor, y: torch.Tensor, epochs: int) -> float:
    """Full-batch Adam on the MAP objective with δ = 1 and σ² = 1 fixed, a plain loop: seconds."""
    net = boston_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    n = len(x)
    start = time.perf_counter()
    for _ in range(epochs):
        opt.zero_grad()
        loss = (0.5 * (net(x).squeeze(-1) - y).square().sum() + 0.5 * sum(p.square().sum() for p in net.parameters())) / n
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def ntkgp_run(x: torch.Tensor, y: torch.Tensor, epochs: int, hyper_steps: int) -> tuple[float, object]:
    net, lik = boston_net(), gaussian()
    start = time.perf_counter()
    burn_in = 0 if hyper_steps else epochs
    result = train_marglik(net, x, y, lik, structure="full_ggn", prior_precision=1.0, epochs=epochs, lr=1e-3,
                           hyper_lr=1e-3, burn_in=burn_in, frequency=1, hyper_steps=hyper_steps, progress=False)
    return time.perf_counter() - start, result


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
    t_map1 = map_only(x, y, epochs)
    print(f"MAP only (plain loop): {t_map1:.1f} s")
    t_none, _ = ntkgp_run(x, y, epochs, hyper_steps=0)
    print(f"train_marglik, no hyperparameter learning: {t_none:.1f} s")
    t_ml, result = ntkgp_run(x, y, epochs, hyper_steps=1)
    print(f"train_marglik full GGN F=1 K=1: {t_ml:.1f} s, log evidence/N {result.log_evidence:.4f}, "
          f"δ {[round(v, 4) for v in result.prior_precision.tolist()]}, σ² {result.likelihood.noise.item():.4f}")
    t_map2 = map_only(x, y, epochs)
    print(f"MAP only (plain loop), again: {t_map2:.1f} s")
    t_map = 0.5 * (t_map1 + t_map2)
    laplace = None
    if args.laplace_python:
        laplace = laplace_run(args.laplace_python, x, y, args.laplace_epochs, args.threads)
        laplace["extrapolated"] = laplace["seconds"] * epochs / laplace["epochs"]
        print(f"laplace-torch {laplace['version']}: {laplace['seconds']:.1f} s for {laplace['epochs']} epochs, "
              f"{laplace['extrapolated']:.0f} s for {epochs} (extrapolated)")
    rows = [
        ["MAP only (plain PyTorch loop, mean of the runs before and after)", f"{t_map:.1f}",
         f"{t_map / epochs * 1e3:.2f}", "1.00"],
        ["`train_marglik`, `hyper_steps=0` (no hyperparameter learning)", f"{t_none:.1f}",
         f"{t_none / epochs * 1e3:.2f}", f"{t_none / t_map:.2f}"],
        ["`train_marglik`, full GGN, F = 1, K = 1, B = 0", f"{t_ml:.1f}", f"{t_ml / epochs * 1e3:.2f}",
         f"{t_ml / t_map:.2f}"],
    ]
    if laplace is not None:
        rows.append([f"laplace-torch {laplace['version']} `marglik_training`, FullLaplace (measured "
                     f"{laplace['epochs']} epochs, extrapolated)", f"{laplace['extrapolated']:.0f}",
                     f"{laplace['seconds'] / laplace['epochs'] * 1e3:.2f}", f"{laplace['extrapolated'] / t_map:.1f}"])
    table = markdown_table([f"{epochs} epochs, boston", "seconds", "ms per epoch", "× MAP only"], rows)
    ratios = f"train_marglik / MAP only = {t_ml / t_map:.2f}"
    if laplace is not None:
        ratios += f"; train_marglik / laplace-torch = {t_ml / laplace['extrapolated']:.3f}"
    summary = (f"{table}\n\n{ratios}. Learned: δ = {[round(v, 3) for v in result.prior_precision.tolist()]}, "
               f"σ² = {result.likelihood.noise.item():.4f}, log q(D)/N = {result.log_evidence:.4f} (ntkgp).")
    print(summary)
    if args.write_docs:
        command = f"python -m benchmarks.reproduce.marglik_speed --data-dir DATA --epochs {epochs} --threads {args.threads}"
        if laplace is not None:
            command += f" --laplace-python LAPLACE_PYTHON --laplace-epochs {args.laplace_epochs}"
        write_block(DOC, BLOCK, summary, command + " --write-docs")
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
