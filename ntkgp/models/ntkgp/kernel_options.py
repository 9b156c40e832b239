"""The kernel's options as attributes of :class:`~ntkgp.NTKGP`: one storage, the kernel's.

``model.space = "weight"`` is ``model.covar_module.space = "weight"`` (validated by the kernel's own
:class:`~ntkgp.options.OptionAttribute`, so by the constructor's validator), after which the model drops what
depends on it; reading ``model.space`` reads the kernel's value, so the two can never disagree. An option the
kernel fixes (``prior_structure``, ``input_shape``) is fixed on the model too, with a message to build a new model.
"""

from __future__ import annotations

from ...kernels import NTKKernel
from ...options import OptionAttribute, _same_option, option_attributes

__all__ = ["KernelOption"]


class KernelOption(OptionAttribute):
    """An :class:`~ntkgp.options.OptionAttribute` of the owner that lives in ``owner.covar_module`` (an NTKKernel).

    The validator and fixedness are the kernel's attribute of the same name; a change calls the owner's
    ``_kernel_option_changed(name)`` after the kernel has taken the new value.
    """

    def __init__(self) -> None:
        super().__init__(lambda value, argument: value, on_change="_kernel_option_changed")

    def __set_name__(self, owner, name: str) -> None:
        super().__set_name__(owner, name)
        target = option_attributes(NTKKernel)[name]
        self.validate = target.validate
        self.fixed = target.fixed
        self.on_change = None if target.fixed is not None else "_kernel_option_changed"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return getattr(obj.covar_module, self.name)

    def __set__(self, obj, value) -> None:
        new = self.validate(value, self.name)
        kernel = obj.covar_module
        if _same_option(getattr(kernel, self.name), new):
            return
        self.refuse_if_fixed(obj, value)
        setattr(kernel, self.name, new)
        getattr(obj, self.on_change)(self.name)
