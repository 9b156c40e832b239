r"""What the layer-wise approximations share about layers: the ``Linear`` / ``Conv2d`` layers a structured
curvature takes by their features (:mod:`~ntkgp.laplace.weight_space.layers.curvature_layers`), the exact diagonal of
normalization layers and embeddings from the same passes (:mod:`~ntkgp.laplace.weight_space.layers.norm_layers`), and the
layer Jacobians in Kronecker form at test points behind the KFAC and diagonal GLM predictives
(:mod:`~ntkgp.laplace.weight_space.layers.kronecker_form`).

It imports no approximation; the approximations (:mod:`~ntkgp.laplace.weight_space.kfac`, :mod:`~ntkgp.laplace.weight_space.diagonal`) stand on it.
"""
