"""The table of sfr_images.py: its rows and columns as the SFR paper's vision table (Fashion-MNIST, the CNN), each
cell beside the published value and a verdict.

Published values: the SFR paper's vision table, 5 seeds, mean ± std over the seeds (the public experiments' table
files). δ not tuned: NN MAP, the Laplace GLM (KFAC), SFR and SFR-NN at M = 3,200 with NLPD, accuracy and OOD
AUROC (their errors); SFR's NLPD at M = 512 and 2,048 without an error. δ tuned (on the validation set by NLPD),
M = 3,200: SFR-NN and the GLM, NLPD, accuracy, ECE and AUROC, without errors.

Verdict: our one seed against the published mean and spread ``std`` of 5 seeds, by the rule of
docs/reproductions.md (``_common.compare`` with ``paper_runs = 5``): within when ``|ours − mean| ≤ 2 √(std² +
std²/5)`` (one seed spreads by ``std``, the published mean by ``std/√5``); else better or worse. A published value
without an error is judged with the spread of the same method and metric at δ not tuned, M = 3,200 (marked †);
where there is none (ECE), no verdict.
"""

from __future__ import annotations

import math

import _common

PAPER_SEEDS = 5
# (mean, std) over 5 seeds; std None where the table gives none
PUBLISHED = {
    ("map", None, "train"): {"nll": (0.23, 0.01), "accuracy": (91.98, 0.44), "ood_auroc": (0.83, 0.05)},
    ("glm", None, "train"): {"nll": (1.09, 0.04), "accuracy": (84.79, 1.96), "ood_auroc": (0.96, 0.01)},
    ("sfr", 3200, "train"): {"nll": (0.29, 0.02), "accuracy": (91.74, 0.47), "ood_auroc": (0.96, 0.01)},
    ("sfr_nn", 3200, "train"): {"nll": (0.31, 0.03), "accuracy": (91.86, 0.40), "ood_auroc": (0.97, 0.01)},
    ("sfr", 2048, "train"): {"nll": (0.30, None)},
    ("sfr", 512, "train"): {"nll": (0.38, None)},
    ("sfr_nn", 3200, "tuned"): {"nll": (0.23, None), "accuracy": (92.14, None), "ece": (0.01, None),
                                "ood_auroc": (0.86, None)},
    ("glm", None, "tuned"): {"nll": (0.25, None), "accuracy": (91.78, None), "ece": (0.05, None),
                             "ood_auroc": (0.91, None)},
}
METRICS = {"nll": ("NLPD", False, 2), "accuracy": ("accuracy %", True, 2), "ece": ("ECE", False, 3),
           "ood_auroc": ("OOD AUROC", True, 2)}
LABEL = {"map": "NN MAP", "glm": "Laplace GLM (KFAC)", "sfr": "SFR", "sfr_nn": "SFR-NN"}
TUNING = {"train": "not tuned (training δ)", "evidence": "tuned: evidence", "validation": "tuned: validation NLPD"}


def published(method: str, m: int | None, mode: str, metric: str) -> tuple[float, float | None, bool] | None:
    """``(mean, spread, borrowed)`` of the paper for a cell, or ``None``."""
    found = PUBLISHED.get((method, m, "train" if mode == "train" else "tuned"), {}).get(metric)
    if found is None:
        return None
    mean, std = found
    if std is not None:
        return mean, std, False
    reference = PUBLISHED.get((method, 3200 if m is not None else None, "train"), {}).get(metric)
    return mean, (reference[1] if reference else None), True


def verdict(ours: float, paper: tuple[float, float | None, bool] | None, higher_is_better: bool) -> str:
    if paper is None or paper[1] is None or not math.isfinite(ours):
        return "n/a"
    sign = -1 if higher_is_better else 1
    return _common.compare((sign * ours, math.nan, 1), (sign * paper[0], paper[1] / math.sqrt(PAPER_SEEDS)),
                           PAPER_SEEDS)


def cell(ours: float | None, paper, metric: str) -> tuple[str, str]:
    _, higher, digits = METRICS[metric]
    if ours is None or not math.isfinite(ours):
        return "not run", "n/a"
    text = f"{ours:.{digits}f}"
    if paper is not None:
        text += f" / {paper[0]:.{digits}f}" + (f" ± {paper[1]:.{digits}f}" if paper[1] is not None else "")
        text += "†" if paper[2] and paper[1] is not None else ""
    v = verdict(ours, paper, higher)
    return text + ("" if v == "n/a" else f" {v}"), v


def rows(results: list[dict]) -> tuple[list[list[str]], list[tuple[str, str, str]]]:
    """Table rows from the stage results (each ``{"method", "m", "mode", "delta", metrics...}``) and the missed
    cells ``(row label, metric label, verdict, the row's record, metric)``."""
    out, misses = [], []
    for r in results:
        label = LABEL[r["method"]] + (f", M = {r['m']:,}" if r["m"] is not None else "")
        row = [label, TUNING[r["mode"]] if r["method"] != "map" else "—",
               "—" if r.get("delta") is None else f"{r['delta']:.3g}" + (" (grid end)" if r.get("edge") else "")]
        for metric in METRICS:
            text, v = cell(r.get(metric), published(r["method"], r["m"], r["mode"], metric), metric)
            row.append(text)
            if v in ("worse", "better"):
                misses.append((label if r["method"] == "map" else f"{label}, {TUNING[r['mode']]}", METRICS[metric][0],
                               v, r, metric))
        out.append(row)
    return out, misses


HEADER = ["method", "δ", "δ value (sum convention)"] + [f"{METRICS[m][0]} / paper" for m in METRICS]
