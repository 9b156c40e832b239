"""Immer et al.'s Algorithm 1 run by laplace-torch (the paper's own library) beside ntkgp's runs of the same cells.

For the cells of the Immer table that ntkgp reproduces outside ±2 standard errors, this runs laplace-torch's
``marglik_training`` with the paper's protocol on the same splits, from the same initial network (the 1x50 ReLU
network of ``immer_table1.py`` under the split's seed) and the same standardized data: 10,000 full-batch epochs,
Adam at 1e-3 for the weights and the hyperparameters, ``marglik_frequency=1``, ``n_hypersteps=1``,
``n_epochs_burnin=0``, prior precisions initialised to 1 (``prior_structure="layerwise"``, laplace-torch's one
precision per parameter tensor), ``sigma_noise_init=1``, GGN curvature (``AsdlGGN``). ``--structures`` maps
``full_ggn``, ``kfac``, ``diag_ggn`` to ``hessian_structure`` ``full``, ``kron``, ``diag``. Test NLL in the original
units of the MAP predictive N(f(x*), σ²) and of laplace-torch's GLM predictive (``pred_type="glm"``) plus σ²,
both computed with ``ntkgp.metrics.gaussian_nlpd``; and the learned σ² (standardized targets).

The question it answers: is a cell outside ±2 SE a property of the method on that split (laplace-torch lands
there too) or of ntkgp?

    python benchmarks/reproduce/immer_laplace_torch.py --data-dir DATA --laplace-python PATH \
        --datasets energy --splits 1 --structures diag_ggn kfac [--write-docs]

laplace-torch runs in its own interpreter (``--laplace-python``: laplace-torch is not a dependency of ntkgp). One
JSON file per run in ``benchmarks/reproduce/results/immer_laplace_torch/`` (resumable, ``--table-only``);
``--write-docs`` writes the region ``immer-laplace-torch`` of docs/reproductions.md.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

import _common
import immer_table1
from ntkgp import metrics
from ntkgp.datasets import load_uci_regression

REGION = "immer-laplace-torch"
HESSIAN = {"full_ggn": "full", "kfac": "kron", "diag_ggn": "diag"}

LAPLACE_SCRIPT = r"""
import json, sys, time, torch
from laplace.marglik_training import marglik_training
torch.set_num_threads(int(sys.argv[4]))
data = torch.load(sys.argv[1])
net = torch.nn.Sequential(torch.nn.Linear(data["x"].shape[1], 50), torch.nn.ReLU(), torch.nn.Linear(50, 1)).double()
net.load_state_dict(data["state"])
x, y = data["x"], data["y"]
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
start = time.perf_counter()
la, model, margliks, losses = marglik_training(
    net, loader, likelihood="regression", hessian_structure=sys.argv[2], n_epochs=int(sys.argv[3]),
    n_epochs_burnin=0, marglik_frequency=1, n_hypersteps=1, lr_hyp=1e-3, optimizer_kwargs={"lr": 1e-3},
    prior_structure="layerwise", prior_prec_init=1.0, sigma_noise_init=1.0)
seconds = time.perf_counter() - start
with torch.no_grad():
    f_map = model(data["x_test"]).reshape(-1)
    f_mu, f_var = la(data["x_test"], pred_type="glm")
print(json.dumps({"f_map": f_map.tolist(), "f_mu": f_mu.reshape(-1).tolist(), "f_var": f_var.reshape(-1).tolist(),
                  "sigma2": float(la.sigma_noise.detach() ** 2), "prior_precision": la.prior_precision.tolist(),
                  "best_marglik": float(min(margliks)), "train_seconds": seconds}))
"""


def run_one(data_dir: Path, dataset: str, split: int, structure: str, args) -> dict:
    data = load_uci_regression(data_dir, dataset, split=split)
    net: nn.Module = _common.mlp(data.x_train.shape[1], 1, 50, 1, nn.ReLU, seed=split)  # immer_table1's start
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.pt"
        torch.save({"x": data.x_train, "y": data.y_train.reshape(-1, 1), "x_test": data.x_test,
                    "state": net.state_dict()}, path)
        out = subprocess.run([args.laplace_python, "-c", LAPLACE_SCRIPT, str(path), HESSIAN[structure],
                              str(args.epochs), str(args.threads)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    y = data.y_test.reshape(-1, 1)
    f_map, f_mu, f_var = (torch.tensor(r[k], dtype=torch.float64).reshape(-1, 1) for k in ("f_map", "f_mu", "f_var"))
    noise = r["sigma2"]
    return {
        "dataset": dataset, "split": split, "structure": structure, "epochs": args.epochs,
        "nll_map": metrics.gaussian_nlpd(f_map, torch.full_like(f_map, noise), y, y_scale=data.y_std),
        "nll_glm": metrics.gaussian_nlpd(f_mu, f_var + noise, y, y_scale=data.y_std),
        "rmse": metrics.rmse(f_map, y) * data.y_std, "noise": noise, "prior_precision": r["prior_precision"],
        "train_seconds": r["train_seconds"],
    }


def main() -> None:
    p = immer_table1.protocol_parser(__doc__.split("\n\n")[0], "immer_laplace_torch")
    p.add_argument("--structures", nargs="+", default=None, choices=sorted(HESSIAN))
    p.add_argument("--laplace-python", default=None, help="an interpreter with laplace-torch (needed to run)")
    p.add_argument("--ntkgp-results", default=str(_common.RESULTS_ROOT / "immer_table1"),
                   help="ntkgp's runs of immer_table1.py to compare with")
    args = p.parse_args()
    if args.quick:
        args.datasets = args.datasets or ["yacht"]
        args.splits = args.splits or 1
        args.epochs = args.epochs or 200
    args.datasets = args.datasets or ["energy"]
    args.structures = args.structures or ["diag_ggn", "kfac"]
    args.splits = args.splits or 1
    args.epochs = args.epochs or 10_000
    data_dir = _common.setup(args)
    if data_dir is not None and args.laplace_python is None:
        p.error("--laplace-python is needed to run (or --table-only)")
    store, ours = _common.Store(args.out), _common.Store(args.ntkgp_results)
    rows = []
    for dataset in args.datasets:
        for structure in args.structures:
            key = lambda d, split, s=structure: f"{d}_split{split}_{s}_e{args.epochs}_F{args.frequency}_K{args.hyper_steps}"
            runs = _common.run_grid(store, data_dir, [dataset], args.splits, key,
                                    lambda folder, d, split, s=structure: run_one(folder, d, split, s, args))
            theirs = runs.get(dataset, [])
            if not theirs:
                continue
            splits = [r["split"] for r in theirs]
            mine = [r for r in (ours.load(key(dataset, s)) for s in splits) if r is not None]
            row = [dataset, immer_table1.LABEL[structure], ", ".join(map(str, splits))]
            for predictive in ("map", "glm"):
                published = immer_table1.PUBLISHED.get((dataset, structure, predictive))
                for runs_of in (theirs, mine):
                    ms = _common.mean_se(r[f"nll_{predictive}"] for r in runs_of)
                    row.append(_common.cell(ms, published, immer_table1.PAPER_SPLITS)[0] if runs_of else "not run")
            for runs_of in (theirs, mine):
                row.append(f"{_common.mean_se(r['noise'] for r in runs_of)[0]:.3g}" if runs_of else "—")
            rows.append(row)
    header = ["data set", "structure", "splits", "MAP NLL: laplace-torch / paper", "MAP NLL: ntkgp / paper",
              "GLM NLL: laplace-torch / paper", "GLM NLL: ntkgp / paper", "σ² laplace-torch", "σ² ntkgp"]
    note = (f"\n\nBoth trained with the paper's protocol ({args.epochs} epochs, F = {args.frequency}, "
            f"K = {args.hyper_steps}, B = {args.burn_in}, lr {args.lr:g}, hyper lr {args.hyper_lr:g}) from the same "
            "initial network on the same splits; σ² on the standardized targets.")
    _common.publish(args, REGION, _common.table(header, rows) + note, "laplace-torch beside ntkgp")


if __name__ == "__main__":
    main()
