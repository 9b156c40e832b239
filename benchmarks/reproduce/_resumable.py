"""MAP training with early stopping that survives being stopped: a checkpoint after every epoch (weights, Adam's
state, the early-stopping state, the RNG state, the per-epoch times), resumed by the next run of the same command;
and long passes over images in pieces, each piece's result kept (:class:`Pieces`).

Used by sfr_images.py, whose protocol (the SFR paper's: Adam 1e-4, batches of 128, early stopping on a validation
set) takes longer on a CPU than one session gives. The mini-batch order of epoch ``e`` is a permutation drawn from
a generator seeded by ``(seed, e)``, so a resumed run visits the same batches as one uninterrupted run would; the
network has no other randomness (no dropout).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn


def _save(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)  # atomic: a run killed while saving leaves the previous checkpoint


def _permutation(n: int, seed: int, epoch: int) -> Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(1_000_003 * seed + epoch))


def train_checkpointed(net: nn.Module, x: Tensor, y: Tensor, *, delta: float, max_epochs: int, lr: float,
                       batch_size: int, seed: int, validation: tuple[Tensor, Tensor], eval_every: int,
                       patience: int, checkpoint: Path, best_path: Path, budget_seconds: float | None = None,
                       log: Callable[[str], None] = print) -> dict:
    """Adam on ``mean CE + δ/(2N) ‖θ‖²`` (δ in ntkgp's sum convention), the validation loss every ``eval_every``
    epochs, stopped after ``patience`` evaluations without improvement (the public SFR code's ``EarlyStopper``
    with ``min_delta = 0``). The best weights go to ``best_path`` whenever the validation loss improves, the
    resume state to ``checkpoint`` after every epoch.

    Returns the training record (``done`` False when ``budget_seconds`` ran out first — checked after each epoch,
    so every run trains at least one: run again to resume);
    ``net`` ends at the best weights (when done) or the last epoch's (when not)."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    state = {"epoch": 0, "best": math.inf, "best_epoch": 0, "waited": 0, "epoch_seconds": [], "validation": [],
             "runs": 0, "done": False}
    if checkpoint.is_file():
        saved = torch.load(checkpoint, map_location=x.device, weights_only=False)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        state = saved["state"]
        log(f"resumed at epoch {state['epoch']} (run {state['runs'] + 1})")
    state["runs"] += 1
    n, start = len(y), time.perf_counter()
    while not state["done"] and state["epoch"] < max_epochs:
        epoch = state["epoch"] + 1
        net.train()
        t0 = time.perf_counter()
        for idx in _permutation(n, seed, epoch).to(x.device).split(batch_size):
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss = loss + delta / (2 * n) * sum(p.square().sum() for p in net.parameters())
            opt.zero_grad()
            loss.backward()
            opt.step()
        state["epoch_seconds"].append(time.perf_counter() - t0)
        state["epoch"] = epoch
        message = f"epoch {epoch}: {state['epoch_seconds'][-1]:.0f} s"
        if epoch % eval_every == 0:
            val = validation_loss(net, *validation, delta, n)
            state["validation"].append((epoch, val))
            message += f", validation loss {val:.5f}"
            if val < state["best"]:
                state["best"], state["best_epoch"], state["waited"] = val, epoch, 0
                _save(net.state_dict(), best_path)
            else:
                state["waited"] += 1
                state["done"] = state["waited"] >= patience
        state["done"] = state["done"] or epoch >= max_epochs
        _save({"model": net.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
               "state": state}, checkpoint)
        log(message)
        if budget_seconds is not None and time.perf_counter() - start >= budget_seconds:
            break  # at least one epoch per run
    if state["done"] and best_path.is_file():
        net.load_state_dict(torch.load(best_path, map_location=x.device))
    net.eval()
    return {"done": state["done"], "epochs_run": state["epoch"], "best_epoch": state["best_epoch"],
            "best_validation_loss": state["best"] if math.isfinite(state["best"]) else None,
            "epoch_seconds": list(state["epoch_seconds"]), "validation": list(state["validation"]),
            "training_runs": state["runs"]}


def progress(checkpoint: Path) -> dict | None:
    """The early-stopping state of an unfinished training (epochs so far, per-epoch seconds, validation losses,
    runs), or ``None`` without a checkpoint."""
    if not checkpoint.is_file():
        return None
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]


def validation_loss(net: nn.Module, x: Tensor, y: Tensor, delta: float, n: int) -> float:
    """``mean CE + δ/(2N) ‖θ‖²`` on ``(x, y)`` (the training objective, as the public code's ``model.loss``)."""
    net.eval()
    with torch.no_grad():
        nll = sum(nn.functional.cross_entropy(net(xb), yb, reduction="sum").item()
                  for xb, yb in zip(x.split(1000), y.split(1000))) / len(y)
        return nll + delta / (2 * n) * float(sum(p.square().sum() for p in net.parameters()))


class Pieces:
    """A long pass over images in pieces of ``size`` images, each piece's result saved under ``folder`` (one file per
    piece, named by ``prefix``, the pass's ``name`` and the piece's bounds, written atomically), so that a run
    stopped mid-pass resumes at its first missing piece. A saved piece is taken only when its tag — ``identity``
    (the model's: what every pass depends on) and the pass's ``tag`` (the values asked for) — equals the present
    one; otherwise it is computed again and replaced. ``folder=None``: one piece, nothing saved."""

    def __init__(self, folder: Path | None, prefix: str, size: int | None, identity: object = None,
                 log: Callable[[str], None] = print):
        if size is not None and size < 1:
            raise ValueError(f"size must be a positive number of images, got {size}")
        self.folder, self.prefix, self.size, self.identity, self.log = folder, prefix, size, identity, log

    def run(self, name: str, x: Tensor, tag: object, compute: Callable[[Tensor], object]) -> tuple[list, float]:
        """``([compute(piece) for each piece], seconds)``: the pieces' results in order (saved ones loaded) and the
        seconds their computation took, summed over the runs that computed them."""
        size = len(x) if self.folder is None or self.size is None else self.size
        out, seconds, tag = [], 0.0, (self.identity, tag)
        bounds = [(a, min(a + size, len(x))) for a in range(0, len(x), max(size, 1))]
        for i, (a, b) in enumerate(bounds):
            path = None if self.folder is None else self.folder / f"{self.prefix}_{name}_{a}-{b}.pt"
            saved = torch.load(path, weights_only=False) if path is not None and path.is_file() else None
            if saved is None or saved["tag"] != tag:
                t0 = time.perf_counter()
                result = compute(x[a:b])
                saved = {"tag": tag, "result": result, "seconds": time.perf_counter() - t0}
                if path is not None:
                    _save(saved, path)
                    self.log(f"{name}: images {a}-{b} of {len(x)} done in {saved['seconds']:.0f} s "
                             f"(piece {i + 1} of {len(bounds)}, kept)")
            out.append(saved["result"])
            seconds += saved["seconds"]
        return out, seconds
