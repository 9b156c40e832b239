r"""What every weight-space Laplace posterior shares: the interface
(:class:`~ntkgp.laplace.weight_space.posterior.weight_posterior.WeightPosterior`, with the checks run before a pass
over the data), its evidence and the choice of :math:`\delta`
(:mod:`~ntkgp.laplace.weight_space.posterior.prior_tuning`), its predictive by every estimator
(:mod:`~ntkgp.laplace.weight_space.posterior.predictive_estimators`), its samples and state dict
(:mod:`~ntkgp.laplace.weight_space.posterior.posterior_state`) and the option group of its constructor
(:mod:`~ntkgp.laplace.weight_space.posterior.pass_options`).

The posteriors themselves, one per approximation, are the modules of :mod:`ntkgp.laplace.weight_space`; the public
names are documented there.
"""
