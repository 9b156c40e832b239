"""The networks people use, through ntkgp: which parameters take which route, and what each pass costs beside its
measured bound.

Networks (float32, eval mode, random weights: the routes and the costs do not depend on training):

* ``mlp`` — 784-128-10 MLP on flat images;
* ``cnn`` — conv 32, conv 64, FC 128, FC 10 on 28×28 images;
* ``resnet`` — a ResNet with BatchNorm: a 3×3 stem of ``W`` channels and 3 residual blocks (conv-BN-ReLU-conv-BN,
  identity skip), global average pooling, FC 10, on 28×28 images;
* ``transformer`` — a classifier of integer token sequences: ``nn.Embedding`` + learned positions, a 2-layer
  ``nn.TransformerEncoder`` (4 heads), mean pooling, FC 10;
* ``gru`` — ``nn.Embedding``, a 1-layer ``nn.GRU``, its last state through FC 10.

For each: P, the parameters per route (KFAC's Kronecker blocks, the exact diagonal of the others; the NTK's
structured layers and the generic per-example route), then CPU seconds (this process, all threads) of

* the **bound**: one forward and C = 10 backward passes by plain autograd over the same inputs (the exact GGN needs
  the C rows of every output Jacobian), and one forward and one backward (the cost of a gradient);
* the KFAC pass (``compute_curvature(structure="kfac")``), exact and with ``mc_samples=1``, as a ratio to the bound;
* the NTK Gram of ``--n-gram`` inputs (``NTKKernel``), the first evidence step of ``NTKGP`` on ``--n-gram`` points
  (its Gram and curvature) and a later one (δ changed, the Gram's pieces kept), and an ``SFR`` build with ``--m``
  inducing points on ``--n-gram`` points — each also as a ratio to the same bound measured on those ``--n-gram``
  inputs (a second table).

With ``--laplace-python``, laplace-torch's ``Laplace(..., hessian_structure="kron")`` is fitted on the same network
in that interpreter, and its outcome (its time, or the error with which it refuses) is reported beside.

    python benchmarks/architectures.py [--n 1024] [--n-gram 256] [--m 64] [--threads 2] [--laplace-python PY]
        [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

C = 10


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[ResidualBlock(width) for _ in range(3)])
        self.head = nn.Linear(width, C)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(-2, -1)))


class TokenTransformer(nn.Module):
    def __init__(self, vocab: int = 64, length: int = 16, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(0.02 * torch.randn(length, d))
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, C)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids) + self.position).mean(dim=1))


class TokenGRU(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, C)

    def forward(self, ids):
        return self.head(self.gru(self.embed(ids))[0][:, -1])


def networks(width: int) -> dict[str, tuple[nn.Module, callable]]:
    """Each network with a function ``n -> inputs``."""
    torch.manual_seed(0)
    images = lambda n: torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(n))  # noqa: E731
    tokens = lambda n: torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(n))  # noqa: E731
    nets = {
        "mlp": (nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, C)), images),
        "cnn": (nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                              nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, C)), images),
        "resnet": (ResNet(width), images),
        "transformer": (TokenTransformer(), tokens),
        "gru": (TokenGRU(), tokens),
    }
    for net, _ in nets.values():
        net.eval()
    return nets


def bound(net: nn.Module, x: torch.Tensor, backward: int, batch: int) -> float:
    """CPU seconds of one forward and ``backward`` backward passes (one per output) per batch, by autograd."""
    params = [p for p in net.parameters() if p.requires_grad]
    start = time.process_time()
    for xb in x.split(batch):
        out = net(xb)
        for c in range(backward):
            torch.autograd.grad(out[:, c].sum(), params, retain_graph=c < backward - 1)
    return time.process_time() - start


def cpu(call) -> tuple[float, object]:
    start = time.process_time()
    out = call()
    return time.process_time() - start, out


def routes(net: nn.Module, x: torch.Tensor) -> dict[str, object]:
    """The parameters per route: KFAC blocks vs its exact diagonal, NTK structured layers vs generic."""
    from ntkgp.laplace.ggn.data_pass import DataPass
    from ntkgp.laplace.weight_space.layers.curvature_layers import structured_layers, usable_layers
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.ntk.network import NetworkCore

    core = NetworkCore(net)
    sizes = dict(zip(core.names, core.numels))
    plan = core.layer_plan(core.prepare(x[:2]))
    structured = [n for layer in plan.layers for n in (layer.weight, layer.bias) if n is not None]
    structured += [n for layer in plan.elementwise for n in layer.parameter_names]  # norm layers, embeddings
    data = DataPass.on(core, SoftmaxLikelihood(num_classes=C))
    try:
        layers = usable_layers(data.core, structured_layers(net, core.groups, strict=False), core.prepare(x[:2]), False)
        kron = [n for layer in layers for n in (layer.weight, layer.bias) if n is not None]
        from ntkgp.ntk.norm_features import elementwise_layers

        rest = [n for n in core.names if n not in kron]  # normalization and embedding layers: the same passes
        elementwise = {n for layer in elementwise_layers(core, rest, core.prepare(x[:1])) for n in layer.parameter_names}
    except (ValueError, NotImplementedError) as error:
        kron, elementwise = [], set()
        print(f"  KFAC layers: {error}")
    generic = [n for n in core.names if n not in structured]
    return {
        "P": core.num_params,
        "kfac_kron": sum(sizes[n] for n in kron),
        "kfac_diag": core.num_params - sum(sizes[n] for n in kron),
        "ntk_structured": sum(sizes[n] for n in structured),
        "ntk_generic": sum(sizes[n] for n in generic),
        "generic_names": generic,
        "kfac_diag_per_example_names": [n for n in core.names if n not in kron and n not in elementwise],
        "kfac_diag_per_example": sum(sizes[n] for n in core.names if n not in kron and n not in elementwise),
    }


def ntkgp_side(name: str, net: nn.Module, make, args) -> dict[str, object]:
    import gpytorch

    import ntkgp
    from ntkgp.laplace import compute_curvature
    from ntkgp.likelihoods import SoftmaxLikelihood

    x = make(args.n)
    y = torch.randint(0, C, (args.n,), generator=torch.Generator().manual_seed(1))
    row: dict[str, object] = {"network": name, **routes(net, x)}
    bound(net, x[: args.batch], C, args.batch)  # warm-up
    row["bound_s"] = min(bound(net, x, C, args.batch) for _ in range(2))  # the better of two: a bound
    row["n_gram"] = min(args.n_gram, args.n)
    row["bound_gram_s"] = min(bound(net, x[: args.n_gram], C, args.batch) for _ in range(2))  # the NTK side's inputs
    row["gradient_s"] = min(bound(net, x, 1, args.batch) for _ in range(2))
    likelihood = SoftmaxLikelihood(num_classes=C)
    row["kfac_s"], _ = cpu(lambda: compute_curvature(net, x, y, likelihood, structure="kfac",
                                                     batch_size=args.batch, progress=False))
    row["kfac_mc1_s"], _ = cpu(lambda: compute_curvature(net, x, y, likelihood, structure="kfac", mc_samples=1,
                                                         generator=torch.Generator().manual_seed(0),
                                                         batch_size=args.batch, progress=False))
    # GPyTorch's models take (N, D) inputs: images flat, with their shape given
    shape = {"input_shape": tuple(x.shape[1:])} if x.dim() > 2 else {}
    xg, yg = x[: args.n_gram].flatten(1), y[: args.n_gram]
    kernel = ntkgp.NTKKernel(net, prior_precision=1.0, progress=False, **shape)
    row["gram_s"], _ = cpu(lambda: kernel(xg).to_dense())
    model = ntkgp.NTKGP(net, xg, yg, likelihood, prior_precision=1.0, progress=False, **shape)
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.1)

    def step():
        optimizer.zero_grad()
        loss = -mll(model(xg), yg)
        loss.backward()
        optimizer.step()

    row["evidence_first_s"], _ = cpu(step)  # the curvature, once
    row["evidence_step_s"], _ = cpu(step)
    row["sfr_s"], _ = cpu(lambda: ntkgp.SFR(net, xg, yg, likelihood, num_inducing=args.m, prior_precision=1.0,
                                            progress=False, **shape))
    del gpytorch
    return row


LAPLACE_SIDE = r"""
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from architectures import networks, C
from laplace import Laplace
args = json.loads({args!r})
out = {{}}
warm, make_warm = networks(8)["mlp"]  # warm-up: a first small fit, untimed
xw = make_warm(32)
Laplace(warm, "classification", subset_of_weights="all", hessian_structure="kron").fit(
    torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xw, torch.randint(0, C, (32,))), batch_size=16))
for name, (net, make) in networks(args["width"]).items():
    if name not in args["networks"]:
        continue
    x = make(args["n"]); y = torch.randint(0, C, (args["n"],), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args["batch"])
    start = time.process_time()
    try:
        la = Laplace(net, "classification", subset_of_weights="all", hessian_structure="kron")
        la.fit(loader)
        out[name] = {{"kron_s": time.process_time() - start}}
    except Exception as error:
        out[name] = {{"error": f"{{type(error).__name__}}: {{str(error).splitlines()[0][:120]}}"}}
print("JSON" + json.dumps(out))
"""


def laplace_side(python: str, args) -> dict[str, dict]:
    code = LAPLACE_SIDE.format(bench=str(Path(__file__).resolve().parent), args=json.dumps(
        {"width": args.width, "networks": args.networks, "n": args.n, "batch": args.batch}))
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env={"OMP_NUM_THREADS":
                          str(args.threads or torch.get_num_threads()), "PATH": "/usr/bin:/bin"})
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("JSON")]
    if not line:
        raise RuntimeError(f"laplace-torch side failed:\n{done.stderr[-2000:]}")
    return json.loads(line[0][4:])


def table(rows: list[dict], laplace: dict[str, dict] | None) -> str:
    """The KFAC table (over ``--n`` inputs) and the NTK table (over ``--n-gram`` inputs), each beside its bound."""
    from ntkgp._doctable import markdown_table

    header = ["network", "P", "KFAC blocks / exact diagonal (per-example pass)", "NTK structured / generic",
              "bound: fwd + 10 bwd", "KFAC exact (× bound)", "KFAC S = 1 (× bound)"]
    if laplace is not None:
        header.append("laplace-torch KFAC")
    body = []
    for r in rows:
        cells = [r["network"], f"{r['P']:,}",
                 f"{r['kfac_kron']:,} / {r['kfac_diag']:,} ({r.get('kfac_diag_per_example', r['kfac_diag']):,})",
                 f"{r['ntk_structured']:,} / {r['ntk_generic']:,}", f"{r['bound_s']:.2f} s",
                 _timed(r["kfac_s"], r["bound_s"]), _timed(r["kfac_mc1_s"], r["bound_s"])]
        if laplace is not None:
            side = laplace.get(r["network"], {})
            cells.append(f"{side['kron_s']:.2f} s ({side['kron_s'] / r['kfac_s']:.1f}× ntkgp's)" if "kron_s" in side
                         else f"refuses: {side.get('error', 'not run')}")
        body.append(cells)
    ntk_header = ["network", "inputs", "bound: fwd + 10 bwd", "NTK Gram (× bound)",
                  "NTKGP evidence, first step (× bound)", "NTKGP evidence, later step (× bound)",
                  "SFR build (× bound)"]
    ntk_body = [[r["network"], f"{r['n_gram']:,}", f"{r['bound_gram_s']:.2f} s",
                 _timed(r["gram_s"], r["bound_gram_s"]), _timed(r["evidence_first_s"], r["bound_gram_s"]),
                 _timed(r["evidence_step_s"], r["bound_gram_s"]), _timed(r["sfr_s"], r["bound_gram_s"])] for r in rows]
    return markdown_table(header, body) + "\n\n" + markdown_table(ntk_header, ntk_body)


def _timed(seconds: float, bound_seconds: float) -> str:
    """``seconds`` and its ratio to ``bound_seconds``."""
    shown = f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds:.2f} s"
    return f"{shown} ({seconds / bound_seconds:.2f}×)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024, help="inputs of the KFAC pass and its bound")
    parser.add_argument("--n-gram", type=int, default=256, help="inputs of the NTK Gram, NTKGP and SFR")
    parser.add_argument("--m", type=int, default=64, help="SFR's inducing points")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=32, help="the ResNet's channels")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--networks", nargs="+", default=["mlp", "cnn", "resnet", "transformer", "gru"])
    parser.add_argument("--laplace-python", default=None, help="an interpreter where `import laplace` works")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # warm-up: one small pass of every kind, so that no row carries the process's first-call costs
    warm = argparse.Namespace(**{**vars(args), "n": 32, "n_gram": 8, "m": 4, "batch": 16})
    ntkgp_side("warm-up", *networks(8)["mlp"], warm)
    rows = []
    for name, (net, make) in networks(args.width).items():
        if name not in args.networks:
            continue
        row = ntkgp_side(name, net, make, args)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        rows.append(row)
    laplace = laplace_side(args.laplace_python, args) if args.laplace_python else None
    text = table(rows, laplace)
    print(text)
    if args.write_docs:
        from ntkgp._doctable import command_line, write_block

        note = "  # laplace-torch in LAPLACE_PYTHON" if laplace is not None else ""
        write_block("docs/networks.md", "architectures", text, command_line() + note)


if __name__ == "__main__":
    sys.exit(main())
