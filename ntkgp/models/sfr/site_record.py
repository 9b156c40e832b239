"""Whether SFR's dual statistics hold sites placed by an iterated update, kept with them (pickled, copied and in
the ``state_dict``): such sites sit at the mode of the sparse model on all of its inducing inputs, so the
statistics' sub-blocks are not the SFR on fewer inducing inputs (:meth:`SFR.select_inducing` refuses them).

The record is the module's extra state (``_extra_state``: ``1`` iterated, ``0`` plain sums, ``-1`` unknown); a
state dict saved before it was kept loads, with the kind of its sites unknown
(:func:`ntkgp.persistence.load_problems` lets ``EXTRA_STATE_OPTIONAL`` modules miss it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["SiteRecord", "merged_record"]


class SiteRecord(nn.Module):
    """Mixin for the statistics module: :attr:`iterated_sites` (``True``, ``False`` or ``None``: unknown)."""

    EXTRA_STATE_OPTIONAL = True
    iterated_sites: bool | None = False

    def get_extra_state(self) -> Tensor:
        return torch.tensor(-1 if self.iterated_sites is None else int(self.iterated_sites), dtype=torch.int8)

    def set_extra_state(self, state: Tensor) -> None:
        self.iterated_sites = None if int(state) < 0 else bool(int(state))

    def _load_from_state_dict(self, state_dict, prefix, metadata, strict, missing_keys, *args) -> None:
        super()._load_from_state_dict(state_dict, prefix, metadata, strict, missing_keys, *args)
        if prefix + "_extra_state" not in state_dict:  # saved before the record was kept: its sites unknown
            self.iterated_sites = None
            missing_keys[:] = [k for k in missing_keys if k != prefix + "_extra_state"]


def merged_record(a: bool | None, b: bool | None) -> bool | None:
    """The record of the sum of two statistics: iterated if either is, unknown if either is, else plain sums."""
    return True if True in (a, b) else (None if None in (a, b) else False)
