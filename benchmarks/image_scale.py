r"""Image scale: SFR, the KFAC Laplace GLM and their predictives on the Fashion-MNIST CNN, with time and peak memory.

The network is the FSVI paper's CNN (conv 32 and conv 64, 3×3 'same', ReLU and 2×2 max-pool after each, FC 128,
FC 10; P = 421,642), float32, trained for ``--epochs`` epochs of Adam on the ``--n`` training images (not timed;
saved once and loaded by every row). Each row runs in a fresh interpreter (its peak resident memory is its own;
``VmHWM`` of /proc) with the public code's settings unless it says otherwise: one prior precision δ, independent
outputs, probit predictive.

Rows (``--rows`` selects some; default all):

* ``sfr_build:M`` — ``SFR(net, x, y, lik, num_inducing=M, output_coupling="independent")`` on all ``--n``
  images: the dual statistics' pass over the data and the factorization;
* ``sfr_predict:M`` — its predictive mean and marginal variances of the ``--n-test`` test images (the build is
  not counted);
* ``sfr_joint:M`` — the same build and predict with the full C × C coupling (ntkgp's default): one ``(M·C)²``
  system instead of C systems of ``M²``: per image ``C²·M·P_c`` multiply-adds for the cross-Grams (C times the
  independent outputs' ``C·M·P_c``) and ``(M C)²·C/2`` for the statistics, ``O((M C)³)`` for the factorization,
  memory ``O((M C)²)`` (8 bytes each: 210 MB per copy at M = 512);
* ``kfac_fit`` / ``kfac_predict`` — ``laplace_posterior(..., structure="kfac")`` and its closed-form GLM
  predictive of the test images;
* ``vs_public:N:M`` — side by side at ``N`` images: ntkgp's SFR build and predict of 1,000 test images against
  the public SFR code (``--sfr-code SFR_CODE``, the folder of its five modules; skipped without it), both in
  float64 with zero prior mean (the public code's only setting), one δ, independent outputs;
* ``vs_laplace_torch:N[:T]`` — ntkgp's KFAC-GLM fit on ``N`` images and GLM predictive of ``T`` test images
  (default 1,000) against laplace-torch's ``KronLaplace`` (its predictive in chunks of 25 images: it forms the
  chunk's ``C × P`` Jacobians; skipped where laplace-torch is not installed); both fits sum the Kronecker factors
  and both decompose them at their first prediction, so the row also reports fit plus predictive on both sides and
  ntkgp's eigendecompositions (timed around ``KroneckerFactors.decompose``: ``ntkgp_fit_decompose_s`` within the
  fit, ``ntkgp_decompose_s`` in all); torch's first-backward imports are done before either side is timed;
* ``kfac_bound`` — a measured lower bound of the KFAC-GLM fit and predictive per image, float32: the forward
  pass and the backward passes to the layers' outputs on 500 images (batches of 64, ntkgp's default, faster on
  this CPU than 250; C - 1 for the fit, as the softmax's Hessian has rank C - 1, C for the predictive), the factors'
  products on the features of 250 images
  (per layer :math:`\sum_t \bar a_t \bar a_t^\top`, one symmetric product for the fully connected layers, and
  :math:`\sum_{m,t} \Gamma_{mt} \Gamma_{mt}^\top` over C - 1 columns) and the predictive's products in the eigenbases
  (:math:`U_A^\top \bar a`, :math:`(\Gamma_c (U_A^\top \bar a)^\top) \odot W^{1/2}` per class, and their
  ``C × C`` Gram; outer products for the fully connected layers); data preparation, the float64 sums and the
  eigendecompositions (a fixed cost) are not counted;
* ``bound:M`` — a measured lower bound of SFR's pass per image at ``M`` inducing points, float32: the products no
  exact structured pass can avoid, timed bare on 250 images: the forward pass and the C backward passes to the
  layers' outputs, the convolutions' per-example blocks :math:`\sum_t \Gamma_{ct} \bar a_t^\top` (one batched
  product per layer), their contraction with the M inducing inputs' blocks (``C·M·P_conv`` multiply-adds per
  image) and the fully connected layers' factored products ``M·(d_in + C·d_out)``; copies, the statistics'
  updates, K_ZZ and the factorization are not counted. The row also times the contraction and the fully connected
  products bare in float64 (``bound_contraction64_s``, ``bound_fc64_s``, ``bound64_per_image_s``), as SFR forms
  them for a float32 network (its data's float32 features against float64 features of Z: docs/sfr.md,
  "float32"), and the float64 contraction's time over the float32 one's (``contraction_f64_over_f32``): what the
  float64 products cost on this machine, whatever the code around them.

Peak memory of an SFR build and its first prediction (float32 network, independent outputs, one δ), with
``w = C·P_c + Σ d_in + C·Σ d_out`` numbers of layer features per inducing input (192,804 on this CNN:
P_c = 18,816): ``max(8·M·w + 8·C·M² + chunk_64, 4·M·w + 5·8·C·M²)`` bytes plus one chunk of the data's features
(1 GiB): the float64 features of Z and K_ZZ while K_ZZ is formed (``chunk_64``: the float64 pass of one chunk of
Z), then the float32 features, K_ZZ, the statistics and the factorization's ``L_Z``, ``R`` and two temporaries;
at M = 3,200 about 7 GB (4.9 GB of float64 features, 0.82 GB per ``C·M²`` matrix).

Targets at 60,000 images are extrapolated linearly from the measured rows (``--write-docs``): the SFR rows time their
pass over the data (``pass_s``) within the build, so that one run gives both the intercept (the inducing inputs'
pass and K_ZZ) and the rate, ``t(60000) = (t - pass_s) + pass_s · 60000 / N`` (the pass is linear in ``N``; the
machine's load changes between runs more than between the parts of one); without it, from builds at two
sizes ``N1 < N2``, :math:`t(60000) = t(N_2) + (t(N_2) - t(N_1))\,(60000 - N_2)/(N_2 - N_1)`; predictions scale with the number of test images,
:math:`t(10000) = t(n)\cdot 10000/n`; the bounds as ``60000 ×`` their time per image (``10000 ×`` for the KFAC
predictive's); a KFAC fit measured at ``n < 60000`` images as :math:`t(60000) = t(n) \cdot 60000/n`.

    python benchmarks/image_scale.py [--data-dir /usr/share/datasets/fashion-mnist] [--n 60000] [--n-test 10000]
        [--rows ...] [--sfr-code SFR_CODE] [--device cuda] [--json out.json] [--threads T]
    python benchmarks/image_scale.py --write-docs run1.json run2.json ...   # the table in docs/scaling.md

Targets on the 2-core CPU (issue "image scale"): SFR build M = 512 ≤ 5 min, M = 3,200 ≤ 30 min and ≤ 16 GiB;
predict 10,000 ≤ 2 min; KFAC fit ≤ 3 min, predict 10,000 ≤ 1 min; ≤ 0.2× the public SFR code and ≤ 0.5×
laplace-torch at N = 5,000, M = 512.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROWS = ["sfr_build:512", "sfr_predict:512", "kfac_fit", "kfac_predict", "kfac_bound", "sfr_joint:512",
                "vs_public:5000:512", "vs_laplace_torch:5000", "sfr_build:3200"]


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def high_water_mib() -> float:
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+)", status.read())[1]) / 1024


def load(args):
    from ntkgp.datasets import load_fashion_mnist

    x, y, x_test, y_test = load_fashion_mnist(args.data_dir)
    return x[: args.n], y[: args.n], x_test[: args.n_test], y_test[: args.n_test]


def train(args, path: Path) -> dict:
    x, y, x_test, y_test = load(args)
    net = cnn().to(args.device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(args.epochs):
        for idx in torch.randperm(len(y), generator=g).split(128):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx].to(args.device)), y[idx].to(args.device))
            (loss + 0.5 * args.delta * sum(p.square().sum() for p in net.parameters()) / len(y)).backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        acc = sum((net(c.to(args.device)).argmax(-1).cpu() == t).sum().item()
                  for c, t in zip(x_test.split(1000), y_test.split(1000))) / len(y_test)
    torch.save(net.state_dict(), path)
    return {"train_s": time.perf_counter() - start, "map_accuracy": acc, "epochs": args.epochs, "train_images": len(y)}


def metrics(probs: torch.Tensor, y: torch.Tensor) -> dict:
    from ntkgp.metrics import accuracy, categorical_nlpd

    return {"accuracy": accuracy(probs.double(), y), "nlpd": categorical_nlpd(probs.double(), y)}


def row(args, name: str, weights: Path) -> dict:
    """One row, in this interpreter."""
    import ntkgp
    from ntkgp.likelihoods import SoftmaxLikelihood

    kind, *params = name.split(":")
    net = cnn()
    net.load_state_dict(torch.load(weights))
    net = net.to(args.device).eval()
    x, y, x_test, y_test = load(args)
    x, x_test = x.to(args.device), x_test.to(args.device)
    lik = SoftmaxLikelihood(10).to(args.device)
    out: dict = {"row": name}
    base = high_water_mib()
    if kind in ("sfr_build", "sfr_predict", "sfr_joint"):
        m = int(params[0])
        coupling = "joint" if kind == "sfr_joint" else "independent"
        start = time.perf_counter()
        # SFR's pass over the data, within the build: the rest (the inducing inputs' float64 pass, K_ZZ) is the
        # intercept, measured in the same run
        with timed(importlib.import_module("ntkgp.models.sfr.model"), "stream_statistics", out, "pass_s"):
            sfr = ntkgp.SFR(net, x, y, lik, num_inducing=m, prior_precision=args.delta, prior_structure="network",
                            output_coupling=coupling, progress=args.progress)
        sfr.eval()
        out["build_s"] = time.perf_counter() - start
        if kind != "sfr_build":
            start = time.perf_counter()
            with torch.no_grad():
                probs = torch.cat([sfr.likelihood(sfr(c)).probs.cpu() for c in x_test.split(1000)])
            out["predict_s"] = time.perf_counter() - start
            out |= metrics(probs, y_test)
        out["inducing_rank"] = [int(r) for r in torch.as_tensor(sfr.inducing_rank).flatten().tolist()]
    elif kind in ("kfac_fit", "kfac_predict"):
        start = time.perf_counter()
        post = ntkgp.laplace.laplace_posterior(net, x, y, lik, structure="kfac", prior_precision=args.delta,
                                               prior_structure="network")
        out["fit_s"] = time.perf_counter() - start
        if kind == "kfac_predict":
            start = time.perf_counter()
            probs = torch.cat([ntkgp.laplace.predict(post, c, link="probit").probs.cpu() for c in x_test.split(1000)])
            out["predict_s"] = time.perf_counter() - start
            out |= metrics(probs, y_test)
    elif kind == "vs_public":
        out |= vs_public(args, net, x, y, x_test, y_test, int(params[0]), int(params[1]))
    elif kind == "vs_laplace_torch":
        out |= vs_laplace_torch(args, net, x, y, x_test, y_test, int(params[0]), int(params[1]) if params[1:] else 1000)
    elif kind == "bound":
        out |= bound(net, x[:250], int(params[0]))
    elif kind == "kfac_bound":
        out |= kfac_bound(net, x[:500])
    else:
        raise SystemExit(f"unknown row {name!r}")
    out["peak_mib"] = high_water_mib() - base
    return out


@contextlib.contextmanager
def timed(owner: object, name: str, out: dict, key: str):
    """Add the seconds spent in ``owner.name`` (a function of a module or a method of a class) while the block runs
    to ``out[key]``; the attribute is restored afterwards."""
    real = getattr(owner, name)
    out[key] = 0.0

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            out[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


def warm_torch(net: nn.Module, x: torch.Tensor) -> None:
    """One backward pass of ``net`` on ``x``, untimed, before either side of a comparison is timed: torch's first
    ``autograd.grad`` imports ``torch.fx``'s symbolic shapes (sympy, ~0.5 s), which would otherwise land on whichever
    side runs first."""
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        out = net(x)
        torch.autograd.grad(out, x, torch.ones_like(out))  # a given cotangent: the import happens only then


def best_of(call, repeats: int = 3) -> float:
    """The shortest of ``repeats`` wall-clock times of ``call()`` (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def bound(net: nn.Sequential, x: torch.Tensor, m: int) -> dict:
    """The ``bound:M`` row (module doc): seconds per image of each unavoidable product, bare."""
    from torch.nn.functional import unfold

    b, c = x.shape[0], 10
    convs = [layer for layer in net if isinstance(layer, nn.Conv2d)]
    linears = [layer for layer in net if isinstance(layer, nn.Linear)]

    def passes():  # the forward pass, keeping each layer's output, and C backward passes to those outputs
        outs, h = [], x
        with torch.enable_grad():
            for layer in net:
                h = layer(h)
                if isinstance(layer, nn.Conv2d | nn.Linear):
                    outs.append(h)
            for k in range(c):
                cot = torch.zeros_like(h)
                cot[:, k] = 1
                torch.autograd.grad(h, outs, cot, retain_graph=k < c - 1)

    shapes, h = [], x
    with torch.no_grad():
        for layer in net:
            if isinstance(layer, nn.Conv2d):
                patches = unfold(h, layer.kernel_size, padding=layer.padding)
                shapes.append((layer.out_channels, patches.shape[-1], patches.shape[1] + 1))
            h = layer(h)
    generator = torch.Generator().manual_seed(0)
    blocks = [(torch.randn(b, c * d, t, generator=generator), torch.randn(b, t, a, generator=generator))
              for d, t, a in shapes]
    p_conv = sum(sum(p.numel() for p in layer.parameters()) for layer in convs)
    columns = torch.randn(c, b, p_conv, generator=generator)
    inducing = torch.randn(c, p_conv, m, generator=generator)
    d_in, d_out = linears[0].in_features, linears[0].out_features
    fc = [(torch.randn(b, d_in, generator=generator), torch.randn(d_in, m, generator=generator)),
          (torch.randn(c, b, d_out, generator=generator), torch.randn(c, d_out, m, generator=generator))]
    # the same products in float64 (SFR's for a float32 network: the data's features promoted and contracted
    # against the float64 features of Z), the promotion's copy not counted
    columns64, inducing64, fc64 = columns.double(), inducing.double(), [(p.double(), q.double()) for p, q in fc]
    times = {
        "bound_passes_s": best_of(passes),
        "bound_blocks_s": best_of(lambda: [torch.bmm(g, a) for g, a in blocks]),
        "bound_contraction_s": best_of(lambda: torch.bmm(columns, inducing)),
        "bound_fc_s": best_of(lambda: [p @ q for p, q in fc]),
    }
    precise = {
        "bound_contraction64_s": best_of(lambda: torch.bmm(columns64, inducing64)),
        "bound_fc64_s": best_of(lambda: [p @ q for p, q in fc64]),
    }
    out = {k: v / b for k, v in times.items()}  # per image
    out["bound_per_image_s"] = sum(out.values())
    out |= {k: v / b for k, v in precise.items()}
    out["bound64_per_image_s"] = (out["bound_passes_s"] + out["bound_blocks_s"] + out["bound_contraction64_s"]
                                  + out["bound_fc64_s"])
    out["contraction_f64_over_f32"] = precise["bound_contraction64_s"] / times["bound_contraction_s"]
    out["contraction_macs_per_image"] = c * m * p_conv
    return out


def kfac_bound(net: nn.Sequential, x: torch.Tensor, c: int = 10, batch: int = 250, pass_batch: int = 64) -> dict:
    """The ``kfac_bound`` row (module doc): seconds per image of the fit's and the predictive's unavoidable
    products, bare, on ``x`` in batches of ``batch``."""
    from torch.nn.functional import unfold

    from ntkgp.laplace.weight_space.kfac.factor_sums import location_gram, symmetric_gram

    layers = [layer for layer in net if isinstance(layer, nn.Conv2d | nn.Linear)]

    def passes(xb, columns=c):  # forward (each layer's input and output kept), backward passes to the outputs
        ins, outs, h = [], [], xb
        with torch.enable_grad():
            for layer in net:
                if isinstance(layer, nn.Conv2d | nn.Linear):
                    ins.append(h.detach())
                h = layer(h)
                if isinstance(layer, nn.Conv2d | nn.Linear):
                    outs.append(h)
            grads = []
            for k in range(columns):
                cot = torch.zeros_like(h)
                cot[:, k] = 1
                grads.append(torch.autograd.grad(h, outs, cot, retain_graph=k < columns - 1))
        return ins, grads

    def features(inp, layer):  # (n, d_a, T) inputs of the layer
        if isinstance(layer, nn.Conv2d):
            return unfold(inp, layer.kernel_size, padding=layer.padding)
        return inp.flatten(1)[..., None]

    generator = torch.Generator().manual_seed(0)
    ins, grads = passes(x[:batch])
    a = [features(i, layer) for i, layer in zip(ins, layers)]
    n = min(batch, x.shape[0])
    g = [torch.stack([gs[j] for gs in grads], 1).reshape(n, c, gs_j.shape[1], -1)
         for j, (ai, gs_j) in enumerate(zip(a, grads[0]))]  # (n, C, d_out, T)
    bases = [(torch.linalg.qr(torch.randn(ai.shape[1], ai.shape[1], generator=generator))[0],
              torch.linalg.qr(torch.randn(gi.shape[2], gi.shape[2], generator=generator))[0],
              torch.rand(gi.shape[2], ai.shape[1], generator=generator)) for ai, gi in zip(a, g)]

    def fit_products():  # the G factors from the C - 1 columns of the softmax's root
        for ai, gi in zip(a, g):
            symmetric_gram(ai[..., 0]) if ai.shape[-1] == 1 else location_gram(ai)
            for k in range(c - 1):  # one column's gradients at a time (views: no copy of the C columns)
                location_gram(gi[:, k])

    def predict_products():
        for ai, gi, (u_a, u_g, w) in zip(a, g, bases):
            if ai.shape[-1] == 1:
                s = ((ai[..., 0] @ u_a).square() @ w.T).sqrt()
                r = (gi[..., 0] @ u_g) * s[:, None]
            else:
                b = u_a.T @ ai
                r = torch.stack([(torch.bmm(gi[:, k], b.mT) * w).flatten(1) for k in range(c)], 1)
            r @ r.mT

    times = {"kfac_bound_passes_s": best_of(lambda: [passes(xb) for xb in x.split(pass_batch)]) / x.shape[0],
             "kfac_bound_fit_passes_s": best_of(lambda: [passes(xb, c - 1) for xb in x.split(pass_batch)])
             / x.shape[0],
             "kfac_bound_factors_s": best_of(fit_products) / n,
             "kfac_bound_predict_products_s": best_of(predict_products) / n}
    times["kfac_bound_fit_per_image_s"] = times["kfac_bound_fit_passes_s"] + times["kfac_bound_factors_s"]
    times["kfac_bound_predict_per_image_s"] = times["kfac_bound_passes_s"] + times["kfac_bound_predict_products_s"]
    return times


def vs_public(args, net, x, y, x_test, y_test, n: int, m: int) -> dict:
    import copy

    import ntkgp
    from ntkgp.likelihoods import SoftmaxLikelihood

    x, y, x_test = x[:n].double(), y[:n], x_test[:1000].double()
    net64 = copy.deepcopy(net).double()
    out = {}
    start = time.perf_counter()
    sfr = ntkgp.SFR(net64, x, y, SoftmaxLikelihood(10).double(), num_inducing=m, prior_precision=args.delta,
                    prior_structure="network", prior_mean="zero", output_coupling="independent")
    sfr.eval()
    out["ntkgp_build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        f = sfr(x_test)
        _ = f.mean, f.variance
    out["ntkgp_predict_s"] = time.perf_counter() - start
    if args.sfr_code is None:
        out["public"] = "skipped: no --sfr-code"
        return out
    sys.path.insert(0, str(args.sfr_code))
    import likelihoods as public_likelihoods
    import priors as public_priors
    import sfr as public_sfr

    torch.manual_seed(0)
    public_net = copy.deepcopy(net)  # the public code casts its network to float64 in place
    model = public_sfr.SFR(public_net, prior=public_priors.Gaussian(params=public_net.parameters,
                                                                    prior_precision=args.delta),
                           likelihood=public_likelihoods.CategoricalLh(), output_dim=10, num_inducing=m,
                           dual_batch_size=1000, jitter=1e-6)
    start = time.perf_counter()
    model.set_data((x, y))
    out["public_build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        model.predict_f(x_test, full_cov=False)
    out["public_predict_s"] = time.perf_counter() - start
    out["build_ratio"] = out["ntkgp_build_s"] / out["public_build_s"]
    out["predict_ratio"] = out["ntkgp_predict_s"] / out["public_predict_s"]
    return out


def vs_laplace_torch(args, net, x, y, x_test, y_test, n: int, n_test: int = 1000) -> dict:
    import copy

    import ntkgp
    from ntkgp.likelihoods import SoftmaxLikelihood

    x, y, x_test = x[:n], y[:n], x_test[:n_test]
    out = {"train_images": x.shape[0], "test_images": x_test.shape[0]}
    from ntkgp.laplace.weight_space.kfac.blocks import KroneckerFactors

    warm_torch(net, x[:2])
    # the factors' eigendecompositions, wherever they fall (ntkgp: at the first use, the predictive's)
    with timed(KroneckerFactors, "decompose", out, "ntkgp_decompose_s"):
        start = time.perf_counter()
        post = ntkgp.laplace.laplace_posterior(net, x, y, SoftmaxLikelihood(10), structure="kfac",
                                               prior_precision=args.delta, prior_structure="network")
        out["ntkgp_fit_s"] = time.perf_counter() - start
        out["ntkgp_fit_decompose_s"] = out["ntkgp_decompose_s"]
        start = time.perf_counter()
        ntkgp.laplace.predict(post, x_test, link="probit")
        out["ntkgp_predict_s"] = time.perf_counter() - start
    try:
        from laplace import KronLaplace
    except ImportError:
        out["laplace_torch"] = "skipped: laplace-torch is not installed"
        return out
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=128)
    la = KronLaplace(copy.deepcopy(net), "classification", prior_precision=args.delta)
    start = time.perf_counter()
    la.fit(loader)
    out["laplace_torch_fit_s"] = time.perf_counter() - start
    start = time.perf_counter()
    for chunk in x_test.split(25):  # its GLM predictive forms the chunk's C·P Jacobians (1,000 images: ~17 GB)
        la(chunk, pred_type="glm", link_approx="probit")
    out["laplace_torch_predict_s"] = time.perf_counter() - start
    out["fit_ratio"] = out["ntkgp_fit_s"] / out["laplace_torch_fit_s"]
    out["factors_ratio"] = (out["ntkgp_fit_s"] - out["ntkgp_fit_decompose_s"]) / out["laplace_torch_fit_s"]
    out["predict_ratio"] = out["ntkgp_predict_s"] / out["laplace_torch_predict_s"]
    # both decompose their Kronecker factors at their first prediction: the sum compares all the work
    out["total_ratio"] = ((out["ntkgp_fit_s"] + out["ntkgp_predict_s"])
                          / (out["laplace_torch_fit_s"] + out["laplace_torch_predict_s"]))
    return out


def _fmt(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2f} s"


#: The build targets of the independent-output rows at 60,000 images, by M.
BUILD_TARGETS = {512: "≤ 5 min", 3200: "≤ 30 min"}


def sfr_lines(results: list[dict], load) -> list[list[str]]:
    """The table's SFR lines: per row kind and M, each run's build (and predict, where measured) by N; the build at
    60,000 images measured where a run had all of them, else extrapolated from the smallest and largest N (module
    doc); the joint rows carry no target (issue: state and measure)."""
    lines, kinds = [], ("sfr_build", "sfr_predict", "sfr_joint")
    groups: dict[tuple[bool, int], list[dict]] = {}
    for r in results:
        kind, *params = r["row"].split(":")
        if kind in kinds:
            groups.setdefault((kind == "sfr_joint", int(params[0])), []).append(r)
    for (joint, m), rows in sorted(groups.items()):
        rows.sort(key=lambda r: r["n"])
        name = f"SFR build, M = {m:,}" + (", joint C × C" if joint else "")
        for r in rows:
            lines.append([name, f"{r['n']:,}", _fmt(r["build_s"]), "", "", f"{r['peak_mib']:.0f}", load(r)])
            last = lines[-1]
            if "predict_s" in r:
                target = "≤ 2 min" if (m, joint) == (512, False) else ""
                lines.append([f"SFR predict {r['n_test']:,} test images" + (" (joint)" if joint else ""), f"{r['n']:,}",
                              _fmt(r["predict_s"]), _fmt(r["predict_s"] * 10_000 / r["n_test"]) + " (10,000)", target,
                              "", load(r)])
        target = "" if joint else BUILD_TARGETS.get(m, "")
        (n1, t1), (n2, t2) = [(r["n"], r["build_s"]) for r in (rows[0], rows[-1])]
        if n2 >= 60_000:
            last[3:5] = ["measured (60,000)", target]
        elif "pass_s" in rows[-1]:  # the intercept and the pass's rate from the same run
            t = t2 - rows[-1]["pass_s"] + rows[-1]["pass_s"] * 60_000 / n2
            last[3:5] = [_fmt(t) + " (60,000)", target]
        elif n2 > n1:
            last[3:5] = [_fmt(t2 + (t2 - t1) * (60_000 - n2) / (n2 - n1)) + " (60,000)", target]
    return lines


def write_docs(paths: list[Path]) -> None:
    """The generated region ``image-scale`` of docs/scaling.md from the JSON results of runs (module doc: the
    extrapolation formulas)."""
    from ntkgp._doctable import markdown_table, write_block

    loaded = [(p.name, r) for p in paths for r in json.loads(p.read_text())]  # each file read once
    results = [r | {"command": r.get("command", "").replace("RUN.json", name)}
               for name, r in loaded if "error" not in r and r["row"] != "train"]
    table, load = [], lambda r: f"{r['load_average']:.1f}"
    table.extend(sfr_lines(results, load))
    for r in (r for r in results if r["row"].startswith("bound")):
        m = int(r["row"].split(":")[1])
        table.append([f"lower bound of the pass, M = {m:,} (bare products, per image "
                      f"{1e3 * r['bound_per_image_s']:.1f} ms)", "—", "", _fmt(60_000 * r["bound_per_image_s"])
                      + " (60,000)", BUILD_TARGETS.get(m, ""), "", load(r)])
        if "bound64_per_image_s" in r:  # SFR's products for a float32 network: float64
            table.append([(f"lower bound of the pass with float64 products, M = {m:,} (per image "
                           f"{1e3 * r['bound64_per_image_s']:.1f} ms; the contraction "
                           f"{r['contraction_f64_over_f32']:.2f}× its float32 time)"), "—", "",
                          _fmt(60_000 * r["bound64_per_image_s"]) + " (60,000)", BUILD_TARGETS.get(m, ""), "",
                          load(r)])
    for r in (r for r in results if r["row"] == "kfac_bound"):
        table.append([f"lower bound of the KFAC fit (bare passes and products, per image "
                      f"{1e3 * r['kfac_bound_fit_per_image_s']:.1f} ms)", "—", "",
                      _fmt(60_000 * r["kfac_bound_fit_per_image_s"]) + " (60,000)", "≤ 3 min", "", load(r)])
        table.append([f"lower bound of the KFAC predictive (per image {1e3 * r['kfac_bound_predict_per_image_s']:.1f} "
                      "ms)", "—", "", _fmt(10_000 * r["kfac_bound_predict_per_image_s"]) + " (10,000)", "≤ 1 min", "",
                      load(r)])
    for r in (r for r in results if r["row"] in ("kfac_fit", "kfac_predict")):
        table.append([f"KFAC-GLM fit", f"{r['n']:,}", _fmt(r["fit_s"]), _fmt(r["fit_s"] * 60_000 / r["n"])
                      + " (60,000)", "≤ 3 min", f"{r['peak_mib']:.0f}", load(r)])
        if "predict_s" in r:
            table.append([f"KFAC-GLM predict {r['n_test']:,}", f"{r['n']:,}", _fmt(r["predict_s"]),
                          _fmt(r["predict_s"] * 10_000 / r["n_test"]) + " (10,000)", "≤ 1 min", "", load(r)])
    for r in (r for r in results if r["row"].startswith("vs_")):
        public = r["row"].startswith("vs_public")
        ours, theirs, target = ("build", "public_build", "≤ 0.2×") if public else ("fit", "laplace_torch_fit", "≤ 0.5×")
        name = "public SFR" if public else "laplace-torch KronLaplace"
        for part, other in ((ours, theirs), ("predict", theirs.replace(ours, "predict"))):
            if f"{other}_s" in r:
                table.append([f"ntkgp / {name}, {part} ({_fmt(r[f'ntkgp_{part}_s'])} / {_fmt(r[f'{other}_s'])})",
                              f"{int(r['row'].split(':')[1]):,}", f"{r[f'ntkgp_{part}_s'] / r[f'{other}_s']:.2f}×",
                              "", target, f"{r['peak_mib']:.0f}", load(r)])
        if "factors_ratio" in r:
            ntkgp_s = r["ntkgp_fit_s"] - r.get("ntkgp_fit_decompose_s", r["ntkgp_decompose_s"])
            table.append([f"ntkgp / {name}, fit without ntkgp's eigendecompositions ({_fmt(ntkgp_s)} / "
                          f"{_fmt(r['laplace_torch_fit_s'])})", f"{int(r['row'].split(':')[1]):,}",
                          f"{r['factors_ratio']:.2f}×", "", target, f"{r['peak_mib']:.0f}", load(r)])
        if "total_ratio" in r:
            ntkgp_s = r["ntkgp_fit_s"] + r["ntkgp_predict_s"]
            other_s = r["laplace_torch_fit_s"] + r["laplace_torch_predict_s"]
            table.append([f"ntkgp / {name}, fit + predict {r['test_images']:,} ({_fmt(ntkgp_s)} / {_fmt(other_s)})",
                          f"{int(r['row'].split(':')[1]):,}", f"{r['total_ratio']:.2f}×", "", target,
                          f"{r['peak_mib']:.0f}", load(r)])
    header = ["row", "N", "measured", "extrapolated", "target", "peak MiB", "load"]
    runs = sorted({r["command"] for r in results})
    trainers = [(name, r) for name, r in loaded if r["row"] == "train"]
    trained = "; ".join(f"{name}: {r.get('epochs', '`--epochs`')} epochs of Adam on {r.get('train_images', '`--n`')} "
                        f"images, test accuracy {r['map_accuracy']:.3f}" for name, r in trainers)
    note = ("\n\nFloat32 network (the rows against the public SFR code: float64, zero prior mean), one δ, independent "
            "outputs; `load`: the load average when the row ended (the "
            "machine's 2 cores were shared with other jobs, so times are inflated by up to that factor over 2). "
            "Each run locked the machine against other timed runs: " + "; ".join(f"`{c}`" for c in runs) + "; "
            "`WEIGHTS.pt` is the CNN trained and kept by the run that found no such file (" + trained + ").")
    names = " ".join(p.name for p in paths)  # the runs' --json files
    write_block("docs/scaling.md", "image-scale", markdown_table(header, table) + note,
                f"python benchmarks/image_scale.py --write-docs {names}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--n-test", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--delta", type=float, default=1.0, help="prior precision (MAP and every model)")
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS)
    parser.add_argument("--sfr-code", type=Path, default=None, help="folder of the public SFR code (SFR_CODE)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights", type=Path, default=None, help="a trained CNN's state_dict (skip training)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of every row")
    parser.add_argument("--write-docs", nargs="+", type=Path, default=None, metavar="JSON",
                        help="write the table of these runs' results into docs/scaling.md (no run)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: run one row, print JSON
    args = parser.parse_args()
    if args.write_docs is not None:
        write_docs(args.write_docs)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.row is not None:
        print("RESULT " + json.dumps(row(args, args.row, args.weights)))
        return
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights
        if weights is None or not weights.exists():  # train (and keep at --weights, when given)
            weights = weights or Path(tmp) / "cnn.pt"
            results.append({"row": "train"} | train(args, weights))
            print(json.dumps(results[-1]), flush=True)
        base = [a for a in sys.argv[1:]]
        from ntkgp._doctable import command_line

        command = command_line({"--sfr-code": "SFR_CODE", "--json": "RUN.json"})  # the machine's paths as placeholders
        for name in args.rows:
            cmd = [sys.executable, __file__, *base, "--weights", str(weights), "--row", name]
            done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"row": name, "error": done.stderr[-2000:]}
            result |= {"n": args.n, "n_test": args.n_test, "threads": torch.get_num_threads(),
                       "load_average": os.getloadavg()[0], "command": command}
            results.append(result)
            print(json.dumps(result), flush=True)
            if args.json is not None:  # after every row: a run stopped for time keeps what it measured
                args.json.write_text(json.dumps(results, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
