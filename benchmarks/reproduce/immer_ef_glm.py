"""Why the empirical Fisher's GLM predictive is worse than its own MAP predictive in the Immer table.

For each data set and split: Algorithm 1 with the full empirical Fisher (EF) and the paper's protocol (the same
training as ``immer_table1.py``'s ``full_ef`` runs), then, at the trained network and learned hyperparameters
(δ, σ²), three predictives on the test set, test NLL in the original units:

* MAP: N(f(x*), σ²);
* GLM with the EF posterior (what the table's EF-GLM cell reports): (EF + P0)⁻¹;
* GLM with the GGN posterior at the same network and hyperparameters: (GGN + P0)⁻¹.

and the quantities that separate the two curvatures. For a Gaussian likelihood the EF of one point is
``r_n² / σ⁴ · J_nᵀ J_n`` and the GGN's ``1 / σ² · J_nᵀ J_n``, so their ratio on point n is ``r_n² / σ²`` (the
squared training residual over the learned noise): where the network fits its training points more closely than
σ, the EF sees less curvature than the GGN, and the posterior falls back on the prior in those directions. The
table gives the mean of ``r_n² / σ²`` over the training points and the mean variance of f at the test inputs
under both posteriors.

A second difference is one of definitions. With ``--laplace-python PATH`` (an interpreter with laplace-torch) the
script also measures, on a small regression network, the EF that laplace-torch's ``FullLaplace`` puts into the
posterior precision for ``likelihood="regression"`` (every EF backend that runs) against the EF of
``log N(y | f, σ²)``, ``Σ_n r_n² / σ⁴ · J_nᵀ J_n`` (what ntkgp computes), and prints the ratio beside ``2σ²``.

    python benchmarks/reproduce/immer_ef_glm.py --data-dir DATA --datasets yacht boston --splits 1 \
        [--laplace-python PATH] [--write-docs]

One JSON file per run in ``benchmarks/reproduce/results/immer_ef_glm/`` (resumable, ``--table-only``);
``--write-docs`` writes the region ``immer-ef-glm`` of docs/reproductions.md.
"""

from __future__ import annotations

import json
import subprocess

import torch

import _common
import immer_table1
from ntkgp import metrics
from ntkgp.datasets import load_uci_regression

REGION = "immer-ef-glm"


def run_one(data_dir, dataset: str, split: int, args) -> dict:
    data = load_uci_regression(data_dir, dataset, split=split)
    result, seconds = immer_table1.train_run(data, "full_ef", split, args)
    _, noise, nll_map = immer_table1.map_prediction(result, data)
    with torch.no_grad():
        residuals = result.net(data.x_train).reshape(-1) - data.y_train.reshape(-1)
    out = {"dataset": dataset, "split": split, "epochs": args.epochs, "train_seconds": seconds, "noise": noise,
           "prior_precision": result.prior_precision.tolist(), "nll_map": nll_map,
           "mean_r2_over_sigma2": float((residuals.square() / noise).mean())}
    for structure in ("full_ef", "full_ggn"):
        mean, var = immer_table1.glm_prediction(result, data, structure, args)
        out[f"nll_glm_{structure}"] = metrics.gaussian_nlpd(mean, var + noise, data.y_test, y_scale=data.y_std)
        out[f"mean_var_f_{structure}"] = float(var.mean())
    return out


LAPLACE_EF_SCRIPT = r"""
import json, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import laplace.curvature as curvature
from laplace import Laplace
torch.manual_seed(0)
x, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, 1, dtype=torch.float64)
net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
params = dict(net.named_parameters())
def f(p, xi):
    return torch.func.functional_call(net, p, (xi[None],))[0, 0]
jac = torch.func.vmap(torch.func.jacrev(f), in_dims=(None, 0))(params, x)
J = torch.cat([jac[n].reshape(len(x), -1) for n in params], 1)
r = (net(x) - y).detach()[:, 0]
out = {}
for sigma in (0.3, 1.0):
    ef = (J * (r**2 / sigma**4)[:, None]).T @ J  # EF of log N(y | f, sigma^2)
    for name in ("AsdlEF", "BackPackEF", "CurvlinopsEF"):
        try:
            la = Laplace(net, "regression", subset_of_weights="all", hessian_structure="full",
                         backend=getattr(curvature, name), sigma_noise=sigma)
            la.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))
        except Exception:
            continue
        ratio = (la._H_factor * la.H / ef)
        out[f"{name}, sigma={sigma:g}"] = [float(ratio.min()), float(ratio.max()), 2 * sigma**2]
print(json.dumps(out))
"""


def laplace_ef_ratio(python: str) -> dict:
    """{backend, σ: [min, max] of laplace-torch's EF / the EF of log N(y|f,σ²) over the entries, and 2σ²}."""
    out = subprocess.run([python, "-c", LAPLACE_EF_SCRIPT], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = immer_table1.protocol_parser(__doc__.split("\n\n")[0], "immer_ef_glm")
    p.add_argument("--laplace-python", default=None, help="an interpreter with laplace-torch (EF convention check)")
    args = p.parse_args()
    if args.quick:
        args.datasets = args.datasets or ["yacht"]
        args.splits = args.splits or 1
        args.epochs = args.epochs or 200
    args.datasets = args.datasets or ["yacht", "boston"]
    args.splits = args.splits or 1
    args.epochs = args.epochs or 10_000
    data_dir = _common.setup(args)
    runs = _common.run_grid(
        _common.Store(args.out), data_dir, args.datasets, args.splits,
        lambda d, split: f"{d}_split{split}_e{args.epochs}_F{args.frequency}_K{args.hyper_steps}",
        lambda folder, d, split: run_one(folder, d, split, args))
    rows = []
    for dataset in args.datasets:
        for r in runs.get(dataset, []):
            split = r["split"]
            rows.append([dataset, str(split), f"{r['nll_map']:.2f}", f"{r['nll_glm_full_ef']:.2f}",
                         f"{r['nll_glm_full_ggn']:.2f}", f"{r['mean_r2_over_sigma2']:.3f}",
                         f"{r['mean_var_f_full_ef']:.4g}", f"{r['mean_var_f_full_ggn']:.4g}", f"{r['noise']:.4g}"])
    header = ["data set", "split", "MAP NLL", "GLM NLL, EF posterior", "GLM NLL, GGN posterior",
              "mean r²/σ² (train)", "mean var f, EF", "mean var f, GGN", "σ² (standardized)"]
    note = f"\n\nNetworks trained with the full EF: {args.epochs} epochs, F = {args.frequency}, K = {args.hyper_steps}, " \
           f"B = {args.burn_in}, lr {args.lr:g}, hyper lr {args.hyper_lr:g}."
    if args.laplace_python:
        ratios = laplace_ef_ratio(args.laplace_python)
        note += "\n\nlaplace-torch's regression EF against the EF of log N(y | f, σ²), entrywise ratio (min, max) " \
                "on a 3-4-1 tanh network, 20 points: " + "; ".join(
                    f"{k}: {lo:.4g} to {hi:.4g} (2σ² = {two:.4g})" for k, (lo, hi, two) in ratios.items()) + "."
    _common.publish(args, REGION, _common.table(header, rows) + note, "the EF's GLM predictive")


if __name__ == "__main__":
    main()
