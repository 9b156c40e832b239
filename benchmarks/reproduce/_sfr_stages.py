"""The evaluation stages of sfr_images.py: the trained network (NN MAP), ntkgp's KFAC Laplace GLM and SFR / SFR-NN
at each M, each at three prior precisions — the training δ ("not tuned"), δ from the evidence, δ from the
validation NLPD (the paper's tuning) — scored on the test half by NLPD, accuracy, ECE and OOD AUROC against MNIST.

Each stage is one JSON file (``_common.Store``), so an interrupted reproduction resumes at the first missing one.
"""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path

import torch
from gpytorch.distributions import MultitaskMultivariateNormal
from torch import Tensor

import _common
import _images
import _resumable
import ntkgp
from ntkgp.metrics import expected_calibration_error, ood_auroc, predictive_entropy
from ntkgp.models import SFRMemoryOptions
from ntkgp.models.sfr import nested_marginals

#: δ modes: the training δ, the evidence's, the validation NLPD's (the paper's "δ tuned")
MODES = ("train", "evidence", "validation")
ECE_BINS = 15  # the public SFR experiments' ECE: netcal's ECE(bins=15)


def peak_memory_mb() -> float:
    """The process's peak resident memory so far (MB; Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scores(probs: Tensor, y: Tensor, probs_ood: Tensor | None) -> dict:
    """NLPD, accuracy %, ECE (15 bins) on ``(probs, y)``; OOD AUROC by predictive entropy against ``probs_ood``."""
    out = _images.classification(probs, y)
    out["ece"] = expected_calibration_error(probs.double().cpu(), y.cpu(), num_bins=ECE_BINS)
    if probs_ood is not None:
        out["ood_auroc"] = ood_auroc(predictive_entropy(probs.double().cpu()), predictive_entropy(probs_ood.double().cpu()))
        out["mean_entropy_ood"] = float(predictive_entropy(probs_ood.double().cpu()).mean())
    out["mean_entropy_test"] = float(predictive_entropy(probs.double().cpu()).mean())
    return out


def nlpd(probs: Tensor, y: Tensor) -> float:
    return _images.classification(probs, y)["nll"]


# ---------------------------------------------------------------------------------------------------- NN MAP
def network_stage(net, data: dict) -> dict:
    probs = {k: _images.in_chunks(lambda b: net(b).softmax(-1), data[k][0]) for k in ("test", "validation")}
    ood = _images.in_chunks(lambda b: net(b).softmax(-1), data["ood"])
    return {**scores(probs["test"], data["test"][1], ood), "validation_nll": nlpd(probs["validation"],
                                                                                  data["validation"][1])}


# ------------------------------------------------------------------------------------------------------- SFR
def sfr_probs_at(sfr, net, x: Tensor, deltas: list[float], chunk: int) -> list[tuple[Tensor, Tensor]]:
    """Class probabilities (probit) of SFR (the GP mean) and SFR-NN (the network's output as the mean, SFR's
    covariance) at each δ of ``deltas``, from one pass over ``x`` (:func:`nested_probs_at` of one model)."""
    return nested_probs_at([sfr], net, x, [deltas], chunk)[0]


#: the sampled-logits predictive of the public SFR experiments (their ``CategoricalLh``: the mean softmax of 100
#: Gaussian draws of the logits per image); the draws seeded alike for every model, δ and mean (common random numbers:
#: their differences are not sampling noise; a kept piece and a recomputed one agree)
MC_SAMPLES, MC_SEED = 100, 0


def nested_probs_at(models: list, net, x: Tensor, deltas: list[list[float]], chunk: int
                    ) -> list[list[tuple[Tensor, Tensor, Tensor, Tensor]]]:
    """Per model, the class probabilities of SFR (the GP mean) and SFR-NN (the network's output as the mean, SFR's
    covariance) at each of its δ, from one pass over ``x`` for all of them (``nested_marginals``: the
    cross-covariances at the largest M computed once, each model reading its inducing inputs' rows, weighted by
    each 1/δ; in the largest model's own prediction chunks, long ones where inducing inputs are recomputed in
    windows; only each image's marginal, so that no δ's factorization outlives the pass); the covariance is the
    same for both means (docs/sfr.md). Each δ gives ``(gp, nn, gp_mc, nn_mc)``: by the probit link, then by
    ``MC_SAMPLES`` sampled logits (each image's ``C × C`` block; the public experiments' predictive).
    ``chunk``: images per chunk of the network's outputs."""
    def mc(lik, dist) -> Tensor:
        generator = torch.Generator(device=x.device).manual_seed(MC_SEED)
        return lik.marginal(dist, link_approx="mc", num_samples=MC_SAMPLES, generator=generator).probs

    with torch.no_grad():
        outputs = _images.in_chunks(net, x, chunk)
        out, lik = [], models[0].likelihood
        for dists in nested_marginals(models, x, deltas):
            probs = []
            for dist in dists:
                as_nn = MultitaskMultivariateNormal(outputs.to(dist.mean.dtype), dist.lazy_covariance_matrix)
                probs.append((lik(dist).probs, lik(as_nn).probs, mc(lik, dist), mc(lik, as_nn)))
            out.append(probs)
        return out


def _grid(delta: float, exponents) -> list[float]:
    return [delta * 10 ** e for e in exponents]


def sfr_stages(models: dict, net, data: dict, modes: dict, delta_train: float, args,
               pieces: _resumable.Pieces | None = None) -> dict[int, dict[str, dict]]:
    """The δ modes ``modes[m]`` of each built SFR ``models[m]`` (nested inducing inputs: ``Z[:m]`` of the largest,
    ``derive_sfr``): each mode's δ (the training δ; the evidence's by a grid and Adam steps; the validation NLPD's on
    the tuning images, every model's grid from one prediction pass), then test and OOD scores of SFR and SFR-NN at
    every δ found, from one prediction pass over the test and one over the OOD images for all models. ``pieces``
    (``_resumable.Pieces``, its identity the build's): each pass in pieces of images, each piece's probabilities
    kept, so that a stopped evaluation resumes at its next piece; the times are the pieces' own, summed over runs."""
    ms = [m for m in models if modes.get(m)]
    if not ms:
        return {}
    results, deltas = {m: {} for m in ms}, {m: {} for m in ms}
    largest = max(models)
    pieces = pieces or _resumable.Pieces(None, "", None)

    def probs(name: str, x: Tensor, wanted: dict[int, list[float]]
              ) -> tuple[dict[int, list[tuple[Tensor, Tensor]]], float]:
        """Each wanted model's probabilities at its δ from one pass, always at the largest M (whose features are
        held: a smaller model never computes its own), and the pass's seconds."""
        ks = ([] if largest in wanted else [largest]) + list(wanted)
        spec = [wanted.get(k, [delta_train]) for k in ks]
        found, seconds = pieces.run(name, x, (ks, spec, ("probit", "mc", MC_SAMPLES, MC_SEED)),
                                    lambda xp: nested_probs_at([models[k] for k in ks], net, xp, spec, args.chunk_size))
        joined = [[tuple(torch.cat([f[i][j][w] for f in found]) for w in range(4)) for j in range(len(spec[i]))]
                  for i in range(len(ks))]
        return {k: p for k, p in zip(ks, joined) if k in wanted}, seconds

    tuning = {m: "validation" in modes[m] for m in ms}
    for m in ms:
        for mode in modes[m]:
            if mode == "train":
                deltas[m][mode] = {"gp": delta_train, "nn": delta_train}
            elif mode == "evidence":
                t0 = time.perf_counter()
                d = _common.evidence_delta(models[m], _grid(delta_train, args.evidence_exponents), args.evidence_steps)
                _common.set_delta(models[m], delta_train)
                deltas[m][mode] = {"gp": d, "nn": d}
                results[m][mode] = {"mode": mode, "tune_seconds": time.perf_counter() - t0}
    grid = _grid(delta_train, args.tune_exponents)
    if any(tuning.values()):
        xv, yv = data["tune"]
        tuned = [m for m in ms if tuning[m]]
        found, seconds = probs("tune", xv, {m: grid for m in tuned})
        for m in tuned:
            # each δ's validation NLPD: SFR, SFR-NN (probit: the choice), then both by sampled logits
            table = [(d, *(nlpd(p, yv) for p in ps)) for d, ps in zip(grid, found[m])]
            deltas[m]["validation"] = {"gp": min(table, key=lambda r: r[1])[0], "nn": min(table, key=lambda r: r[2])[0]}
            results[m]["validation"] = {"mode": "validation", "tuning": table, "tune_seconds": seconds,
                                        "tuning_models_in_pass": len(tuned)}
    for m in ms:
        for mode in modes[m]:
            results[m].setdefault(mode, {"mode": mode, "tune_seconds": 0.0})
    needed = {m: sorted({d for mode in modes[m] for d in deltas[m][mode].values()}) for m in ms}
    (test, test_seconds), (ood, ood_seconds) = probs("test", data["test"][0], needed), probs("ood", data["ood"], needed)
    seconds = test_seconds + ood_seconds
    for m in ms:
        by_delta = {d: (t, o) for d, t, o in zip(needed[m], test[m], ood[m])}
        for mode in modes[m]:
            for which, i in (("gp", 0), ("nn", 1)):
                d = deltas[m][mode][which]
                (t, o), mc = by_delta[d], i + 2  # the probit's, then the sampled logits' at the same δ
                results[m][mode][which] = {**scores(t[i], data["test"][1], o[i]), "delta": d,
                                           "mc": scores(t[mc], data["test"][1], o[mc]),
                                           "predict_seconds": seconds, "deltas_in_pass": len(needed[m]),
                                           "models_in_pass": len(ms),
                                           "images_predicted": len(data["test"][0]) + len(data["ood"])}
            results[m][mode]["peak_memory_mb"] = peak_memory_mb()
    return results


def feature_bytes(args) -> int | None:
    """``--inducing-feature-gib`` in bytes (``None``: the library's default budget)."""
    gib = getattr(args, "inducing_feature_gib", None)
    return None if gib is None else int(gib * 2**30)


def build_sfr(net, data: dict, m: int, delta_train: float, seed: int, args, checkpoint: Path | None = None):
    """SFR on all training images, resumable: ``Z`` a seeded uniform subset of them, the statistics of the first
    of ``args.build_shards`` shards by the constructor and the others added by ``SFR.update(iterate=False)`` (the
    same sums: equal to one build on the union to rounding, docs/sfr.md "Updates"), the model's ``state_dict``
    saved to ``checkpoint`` after each shard. A run that finds the checkpoint builds on two images, loads the
    saved statistics and goes on at the next shard (``build_seconds`` sums the runs)."""
    start = time.perf_counter()
    x, y = data["train"]
    z = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:m]]
    bounds = torch.linspace(0, len(x), args.build_shards + 1).round().long().tolist()

    def model(xs, ys):
        return ntkgp.SFR(net, xs, ys, ntkgp.likelihoods.SoftmaxLikelihood(num_classes=10).to(x.device),
                         inducing_points=z, prior_precision=delta_train, prior_structure="network",
                         memory=SFRMemoryOptions(chunk_size=args.chunk_size, inducing_feature_bytes=feature_bytes(args)), **args.sfr_configuration)

    saved = torch.load(checkpoint, map_location=x.device) if checkpoint is not None and checkpoint.is_file() else None
    if saved is None or saved["shards"] != args.build_shards:
        done, earlier = 1, 0.0
        sfr = model(x[: bounds[1]], y[: bounds[1]])
    else:
        done, earlier = saved["done"], saved["seconds"]
        sfr = model(x[:2], y[:2])
        sfr.load_state_dict(saved["state"])
        print(f"SFR M = {m}: " + ("complete" if done == args.build_shards else
                                  f"resumed at shard {done + 1} of {args.build_shards}")
              + f" ({earlier:.0f} s before)", flush=True)
    for k in range(done, args.build_shards):
        if checkpoint is not None:  # atomically: a run stopped while saving keeps the previous checkpoint
            _resumable._save({"done": k, "shards": args.build_shards, "seconds": earlier + time.perf_counter() - start,
                              "state": sfr.state_dict()}, checkpoint)
        sfr.update(x[bounds[k] : bounds[k + 1]], y[bounds[k] : bounds[k + 1]], iterate=False)
        print(f"SFR M = {m}: shard {k + 1} of {args.build_shards} done, "
              f"{earlier + time.perf_counter() - start:.0f} s", flush=True)
    # a build found complete took its saved seconds (this run only loaded it); the total is saved and returned alike,
    # so that it names the build (the evaluation's kept pieces are tagged with it)
    complete = saved is not None and saved["shards"] == saved["done"] == args.build_shards
    total = earlier if complete else earlier + time.perf_counter() - start
    if checkpoint is not None and not complete:
        _resumable._save({"done": args.build_shards, "shards": args.build_shards, "seconds": total,
                          "state": sfr.state_dict()}, checkpoint)
    sfr.eval()
    rank = sfr.inducing_rank.reshape(-1)
    return sfr, {"build_seconds": total, "build_runs_resumed": saved is not None,
                 "build_shards": args.build_shards, "inducing_rank": [int(rank.min()), int(rank.max())],
                 "peak_memory_mb_after_build": peak_memory_mb()}


def derive_sfr(source, m: int, source_info: dict, delta_train: float):
    """SFR at M = ``m`` from a built SFR at a larger M whose ``Z`` starts with the same ``m`` inducing images (the first
    ``m`` of the same seeded permutation, ``build_sfr``): ``SFR.select_inducing(m)``, the sub-blocks of its statistics,
    equal to a build at ``m`` on the same images (docs/sfr.md, "Fewer inducing points without the data") without a
    pass over them. Its build time is the shared build's, and the record says so."""
    start = time.perf_counter()
    sfr = source.select_inducing(m)
    _common.set_delta(sfr, delta_train)  # as a fresh build: at the training δ, whatever the source's stages did
    sfr.eval()
    rank = sfr.inducing_rank.reshape(-1)
    return sfr, {**source_info, "inducing_rank": [int(rank.min()), int(rank.max())],
                 "derived_from_m": source.num_inducing, "derive_seconds": time.perf_counter() - start,
                 "build_note": f"derived from the M = {source.num_inducing} build (SFR.select_inducing: sub-blocks of its "
                               "statistics, no pass over the data); build_seconds, build_shards and "
                               "peak_memory_mb_after_build are that shared build's"}


# ------------------------------------------------------------------------------------------- KFAC Laplace GLM
#: The GLM's width sweep: δ_train · these factors; the first is δ_train / N, the training loss's per-image δ_mean
#: (0.0013) taken as a sum-convention prior precision.
WIDTH_FACTORS = ("1/N", 1e-3, 1e-2, 1e-1)


def glm_width(posterior, data: dict, delta_train: float, args) -> dict:
    """The KFAC Laplace GLM's scores (NLPD, accuracy, ECE, OOD AUROC, mean entropies) at smaller δ — wider
    predictives — than the training δ (``WIDTH_FACTORS``), with the probit link and with sampled logits (``"mc"``):
    how its test and OOD scores move with the predictive's width and link, the measured reason for a published cell
    that such a GLM meets."""
    n = len(data["train"][1])
    out, t0 = [], time.perf_counter()
    for factor in WIDTH_FACTORS:
        delta = delta_train / n if factor == "1/N" else delta_train * factor
        posterior.prior_precision = delta
        found = {}
        for link in ("probit", "mc"):
            test, ood = (glm_probs(posterior, data[k] if k == "ood" else data[k][0], args.chunk_size, link)
                         for k in ("test", "ood"))
            found[link] = scores(test, data["test"][1], ood)
        out.append({"factor": factor, "delta": delta, **found["probit"], "mc": found["mc"]})
    posterior.prior_precision = delta_train
    return {"mode": "width", "sweep": out, "predict_seconds": time.perf_counter() - t0, "peak_memory_mb": peak_memory_mb()}


def glm_probs(posterior, x: Tensor, chunk: int, link: str = "probit") -> Tensor:
    """The GLM predictive's class probabilities by ``link``: ``"probit"``, or ``"mc"`` (the average softmax of 100
    draws of the logits per image, as the public experiments' sampled predictive; seeded)."""
    generator = torch.Generator(device=x.device).manual_seed(0)
    with torch.no_grad():
        return torch.cat([ntkgp.laplace.predict(posterior, b, link=link, generator=generator).probs
                          for b in x.split(chunk)])


def glm_evidence_delta(curvature, likelihood, delta_train: float, exponents, steps: int) -> float:
    """The δ maximising the KFAC Laplace evidence (``Curvature.log_marginal_likelihood``): the best of the grid,
    then ``steps`` Adam steps (0.05) on log δ."""
    with torch.no_grad():
        best = max(_grid(delta_train, exponents), key=lambda d: float(curvature.log_marginal_likelihood(d, likelihood)))
    log_delta = torch.tensor(math.log(best), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([log_delta], lr=0.05)
    for _ in range(steps):
        loss = -curvature.log_marginal_likelihood(log_delta.exp(), likelihood) / curvature.num_data
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(log_delta.exp())


def glm_stage(posterior, curvature, likelihood, data: dict, mode: str, delta_train: float, args) -> dict:
    start, out = time.perf_counter(), {"mode": mode}
    if mode == "train":
        delta = delta_train
    elif mode == "evidence":
        delta = glm_evidence_delta(curvature, likelihood, delta_train, args.evidence_exponents, args.evidence_steps)
    else:
        xv, yv = data["tune"]
        table = []
        for d in _grid(delta_train, args.tune_exponents):
            posterior.prior_precision = d
            table.append((d, nlpd(glm_probs(posterior, xv, args.chunk_size), yv)))
        out["tuning"] = table
        delta = min(table, key=lambda r: r[1])[0]
    out["tune_seconds"] = time.perf_counter() - start
    posterior.prior_precision = delta
    t0 = time.perf_counter()
    test, ood = (glm_probs(posterior, data[k] if k == "ood" else data[k][0], args.chunk_size) for k in ("test", "ood"))
    out["gp"] = {**scores(test, data["test"][1], ood), "delta": delta, "predict_seconds": time.perf_counter() - t0}
    posterior.prior_precision = delta_train
    out["peak_memory_mb"] = peak_memory_mb()
    return out


def build_glm(net, data: dict, delta_train: float, args):
    """ntkgp's KFAC curvature (one pass over the training images) and its posterior at the training δ."""
    start = time.perf_counter()
    x, y = data["train"]
    likelihood = ntkgp.likelihoods.SoftmaxLikelihood(num_classes=10).to(x.device)
    curvature = ntkgp.laplace.compute_curvature(net, x, y, likelihood, structure="kfac", prior_structure="network",
                                                progress=False)
    posterior = ntkgp.laplace.KFACLaplace.from_curvature(curvature, net, likelihood, prior_precision=delta_train,
                                                         chunk_size=args.chunk_size)
    return posterior, curvature, likelihood, {"build_seconds": time.perf_counter() - start,
                                              "peak_memory_mb_after_build": peak_memory_mb()}
