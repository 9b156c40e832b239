"""The cache of :class:`~ntkgp.kernels.NTKKernel`, shared by the copies GPyTorch makes of a kernel."""

from __future__ import annotations

from ..caching import ValueCache


class SharedValueCache(ValueCache):
    """A :class:`~ntkgp.caching.ValueCache` shared by the copies GPyTorch makes (``kernel[i]``, ``expand_batch``,
    fantasy models), since its entries depend only on the inputs and the (shared) network; pickled empty."""

    def __deepcopy__(self, memo: dict) -> SharedValueCache:
        return self

    def __reduce__(self):
        return (type(self), (self.size,))
