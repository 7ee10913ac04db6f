"""Measurement: replicates, bias/variance/MSE, sweeps over activation sets, importance-sampling diagnostics.

Submodules are imported on use (``randattn.analysis.metrics``, ``.diagnostics``, ``.sweep``;
``.masking`` and ``.positions`` for runs under an attention mask; ``.queries`` for measuring some query rows,
``.relative_error`` for the per-query relative error and promise checks). The propositions checked by
``randattn verify`` are :mod:`randattn.theory`'s.
"""
