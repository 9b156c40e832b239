r"""The last-layer approximation: a Laplace posterior over the parameters of one layer (default the last), the
others fixed at :math:`\theta^*`, from the layer's features :math:`\tilde\phi(x)`
(:mod:`~ntkgp.laplace.weight_space.last_layer.features`): its full, KFAC or diagonal curvature from one forward
pass over the data (:mod:`~ntkgp.laplace.weight_space.last_layer.curvature`), the full posterior
(:mod:`~ntkgp.laplace.weight_space.last_layer.laplace`) and the KFAC and diagonal ones
(:mod:`~ntkgp.laplace.weight_space.last_layer.structured`).

The public names are documented under :mod:`ntkgp.laplace.weight_space`.
"""
