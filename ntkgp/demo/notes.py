"""The lines printed under the demo's table: what each column measures, and the reason for each number a
first reader would question, written from the numbers of the run (a line appears only when its case holds)."""

from __future__ import annotations

from collections.abc import Sequence

from .report import DemoRow

__all__ = ["COLUMNS", "REFIT", "explain"]

REFIT = "NTKGP, δ refit"
"""Name of the row of the NTKGP whose prior precisions were refit by the evidence at the final θ*."""

COLUMNS = (
    "N: training points the model conditions on. evidence/N: log marginal likelihood per point, higher is "
    "better (NTKGP: the Laplace-GGN evidence at the network's weights θ*; SFR: its collapsed bound on the "
    "Gaussian-site evidence of the linearized GP; the network alone has none). test NLPD: negative log "
    "predictive density per test point, lower is better (negative for a sharp density of a continuous y). "
    "ECE: expected calibration error (10 bins), lower is better. NLPD and RMSE in the units of the data.",
    "train s: training the network (Algorithm 1: weights, one prior precision δ per layer and the noise, "
    "learned together). build s: turning the trained network into the model (NTKGP's solve is lazy: it runs "
    "in its first predict s). predict s: the test set. update s: conditioning on the new batch, no "
    "retraining. Times vary with the machine's load.",
)


def _by_model(rows: Sequence[DemoRow]) -> dict[str, DemoRow]:
    return {("SFR" if row.model.startswith("SFR (") else row.model): row for row in rows}


def explain(rows: Sequence[DemoRow]) -> list[str]:
    """The "why" lines for the rows of one run (all tasks), each prefixed with its task."""
    lines = []
    for task in dict.fromkeys(row.task for row in rows):
        lines += _task_notes(task, _by_model([row for row in rows if row.task == task]))
    return lines


def _task_notes(task: str, rows: dict[str, DemoRow]) -> list[str]:
    lines = []
    ntkgp, updated = rows.get("NTKGP"), rows.get("NTKGP + new batch")
    sfr, sfr_updated = rows.get("SFR"), rows.get("SFR + new batch")
    if ntkgp and updated and ntkgp.evidence is not None and updated.evidence < ntkgp.evidence:
        rises = sfr and sfr_updated and sfr_updated.evidence > sfr.evidence
        although = " although its test NLPD improves" if updated.nlpd < ntkgp.nlpd else ""
        lines.append(
            f"[{task}] NTKGP's evidence/N falls after the update ({ntkgp.evidence:.3f} → {updated.evidence:.3f})"
            f"{although}: the Laplace evidence assumes θ* is a MAP of the data, and the network never saw the new "
            "batch, so the evidence charges its misfit there. "
            + ("SFR's column rises: the linearized GP's evidence lets the GP mean move to the new points "
               "(it exceeds the Laplace evidence by ½vᵀH⁻¹v, v = ∇θ log p(D, θ*))." if rises else
               "SFR's column is the linearized GP's evidence, which exceeds it by ½vᵀH⁻¹v, v = ∇θ log p(D, θ*)."))
    network = rows.get("network (MAP)")
    classification = network is not None and network.accuracy is not None
    if classification and ntkgp and ntkgp.nlpd < network.nlpd:
        lines.append(
            f"[{task}] NTKGP's test NLPD ({ntkgp.nlpd:.3f}) is below the network's ({network.nlpd:.3f}) with the "
            "same weights: where the network is confidently wrong (typically away from its training data), the "
            "GLM predictive's variance of f tempers the error.")
    if (classification and ntkgp and updated and sfr and sfr_updated and updated.nlpd < ntkgp.nlpd
            and sfr_updated.nlpd > sfr.nlpd):
        lines.append(
            f"[{task}] SFR's test NLPD rises after the update ({sfr.nlpd:.3f} → {sfr_updated.nlpd:.3f}) while "
            f"NTKGP's falls ({ntkgp.nlpd:.3f} → {updated.nlpd:.3f}): SFR keeps no old data, so it iterates "
            "only the new points' sites, with the old ones fixed where the network put them; NTKGP's "
            "condition_on iterates every site on the union (docs/math.md, 'Site posterior'). Where the network "
            "is confidently wrong on the new points, that difference shows; there, retrain the network or use "
            "NTKGP's condition_on.")
    if network and ntkgp and network.ece is not None and ntkgp.ece > network.ece:
        lines.append(_calibration_note(task, network, ntkgp, rows.get(REFIT)))
    return lines


def _calibration_note(task: str, network: DemoRow, ntkgp: DemoRow, refit: DemoRow | None) -> str:
    text = (f"[{task}] NTKGP's ECE ({ntkgp.ece:.3f}) is above the network's ({network.ece:.3f}): the GLM "
            "predictive is under-confident here, its probabilities pulled toward 1/2 by a posterior variance of "
            "f that is larger than the test errors call for (at the δ learned in training).")
    if refit is None:
        return text
    if refit.ece <= network.ece:
        return text + (f" Refitting δ by the evidence at the final θ* (row '{REFIT}') fixes it: ECE "
                       f"{refit.ece:.3f}.")
    if refit.ece < ntkgp.ece - 0.002:
        effect = "lowers it only"
    elif refit.ece > ntkgp.ece + 0.002:
        effect = "raises it"
    else:
        effect = "leaves it as it is"
    return text + (f" Refitting δ by the evidence at the final θ* (row '{REFIT}') {effect} (ECE {refit.ece:.3f}): "
                   "the evidence picks the δ that best explains the training data; it is no calibration "
                   "criterion. To calibrate, choose δ on validation data, with predictive_mean=\"nn\" "
                   "(docs/predictive.md, 'Calibration').")
