"""The log-space SNIS skeleton shared by every random-feature estimator (ARCHITECTURE sec. 4).

``reference`` (numpy float64) and ``batched`` (torch) compute, for each query n,

    y_n = sum_j a_nj * sum_m b_mj v_m  /  sum_j a_nj * sum_m b_mj

with query-side features ``a_nj = sign * exp(log_a)`` and key-side features
``b_mj = sign * exp(log_b)`` over a shared feature index j = (sample s, component l).
RFA is this with random features; LARA adds ``log|alpha'_nc|`` and its sign to the query
side (LARA eq. 28). It costs O((N + M) J Dv) and never builds an N x M matrix.
"""
