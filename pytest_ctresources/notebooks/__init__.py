"""Notebooks through nbmake: items, injected parameters, kernels and the run."""
