r"""What the decode-time sparse and sampling estimators share: attention over each query's selected keys.

Top-k, StreamingLLM, Quest, MagicPIG and vAttention (ARCHITECTURE sec. 14) all return

.. math::
    \hat y_n = \frac{\sum_m w_{nm} e^{x_n^\top y_m} v_m}{\sum_m w_{nm} e^{x_n^\top y_m}},

with :math:`w_{nm} = 1` for a key computed exactly, an importance weight for a sampled key (its inverse
inclusion probability, times its multiplicity) and :math:`w_{nm} = 0` for a key left out. They differ only
in how they choose :math:`w`. The weights are carried as ``log w`` (``-inf`` = left out), so that
:math:`\log w + x^\top y` meets the exponential in one max-subtracted softmax (ARCHITECTURE sec. 4).
:mod:`.reference` is the numpy float64 form, :mod:`.batched` the torch form.
"""
