"""Run a function in several ``gloo`` processes on this machine and collect what each returns.

``run(target, world)`` starts ``world`` processes with ``torch.multiprocessing`` (``fork`` where the platform
has it, so the children need not import torch and ntkgp again; ``spawn`` elsewhere). Each joins a ``gloo``
process group through a file store (no port to pick), calls ``target(rank, world)`` (a ``"module:function"``
string) and saves the result. Everything is bounded by a timeout: a hung rank is killed and the call fails
with every rank's error output.
"""

from __future__ import annotations

import datetime
import importlib
import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store: str, target: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(rank, world)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(target: str, world: int = 2, timeout: float = 240.0, start_method: str | None = None) -> list:
    """``[target(0, world), ..., target(world - 1, world)]``, each computed in its own process."""
    if start_method is None:
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    context = mp.get_context(start_method)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        processes = [
            context.Process(target=_worker, args=(r, world, store, target, tmp), daemon=True) for r in range(world)
        ]
        for p in processes:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in processes:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [p for p in processes if p.is_alive()]
        for p in hung:
            p.kill()
            p.join(5)
        logs = {r: Path(tmp) / f"rank{r}.err" for r in range(world)}
        errors = {r: log.read_text() for r, log in logs.items() if log.exists()}
        if hung or errors or any(p.exitcode != 0 for p in processes):
            raise AssertionError(
                f"distributed run of {target} failed (hung ranks: {[processes.index(p) for p in hung]}, exit codes "
                f"{[p.exitcode for p in processes]}):\n" + "\n".join(f"--- rank {r}\n{e}" for r, e in errors.items())
            )
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
