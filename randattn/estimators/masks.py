r"""Attention masks: the one rule of what a query may see (ARCHITECTURE sec. 12).

Under ``mask="causal"`` key m is visible to query n iff

.. math::
    m \le n + (M - N),

for N queries and M keys. With M == N this is the lower triangle with the diagonal (self-attention
of a decoder); with M > N the queries are the last N of M tokens, so each also sees the M - N keys
before them (decoding after a prompt). Every query sees at least key 0 when M >= N, so no row of
the mask is empty; M < N (queries before the first key) has no causal meaning and is refused.

A layer's mask is one value, :class:`Mask`: its kind (none, causal, or a sliding window of W keys),
the label tables and run metadata write (``"none"``, ``"causal"``, ``"sliding:W"``), the keyword
arguments an estimator receives, and which keys each query sees. :data:`MASKS` lists the masks every
estimator names alike (None and ``"causal"``); :data:`DECLARABLE_MASKS` adds ``"sliding"``, which a spec
declares to compute every sliding window, and then receives as ``mask="sliding:W"``
(:func:`check_mask_argument`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DECLARABLE_MASKS", "MASKS", "MASK_KINDS", "NO_MASK", "Mask", "causal_visible", "check_causal_shapes",
           "check_mask_argument", "last_visible_key"]

#: the masks an estimator receives as ``mask=`` by these very names: None (bidirectional) and ``"causal"``
MASKS = (None, "causal")
#: what a spec's ``masks`` may hold: :data:`MASKS` and ``"sliding"``, every sliding window; an estimator that declares
#: it receives ``mask="sliding:W"`` (W a positive integer, :meth:`Mask.parse`)
DECLARABLE_MASKS = (*MASKS, "sliding")
#: the kinds of :class:`Mask`: every key visible, the causal rule, the causal rule cut to the last W keys
MASK_KINDS = ("none", "causal", "sliding")
_SLIDING = re.compile(r"^sliding:([1-9]\d*)$")


def check_causal_shapes(num_queries: int, num_keys: int) -> None:
    """Raise ValueError when N queries cannot be causal over M keys (M < N leaves rows with no key)."""
    if num_keys < num_queries:
        raise ValueError(
            f"a causal or sliding-window mask needs at least as many keys as queries (the queries are the last N "
            f"of M tokens); "
            f"got N={num_queries} queries and M={num_keys} keys"
        )


def last_visible_key(num_queries: int, num_keys: int) -> np.ndarray:
    """``(N,)`` the last key index each query sees under the causal mask: ``n + (M - N)``."""
    check_causal_shapes(num_queries, num_keys)
    return np.arange(num_queries) + (num_keys - num_queries)


def causal_visible(num_queries: int, num_keys: int) -> np.ndarray:
    """``(N, M)`` boolean: True where key m is visible to query n (``m <= n + M - N``)."""
    last = last_visible_key(num_queries, num_keys)
    return np.arange(num_keys)[None, :] <= last[:, None]


@dataclass(frozen=True)
class Mask:
    r"""One attention mask: which keys each query sees, and how tables, run metadata and estimators name it.

    - ``Mask()`` (``"none"``): every key is visible to every query (bidirectional, a ViT); label ``"none"``,
      no estimator keyword;
    - ``Mask("causal")``: key m is visible to query n iff :math:`m \le n + (M - N)`; label and ``mask=``
      ``"causal"``;
    - ``Mask("sliding", W)``: :math:`n + (M - N) - W < m \le n + (M - N)`; label and ``mask=`` ``"sliding:W"``.

    The sliding window is the causal rule cut to the last W keys: each query sees itself and the
    W - 1 keys before it, as transformers' sliding-window layers do. Build one with :meth:`parse`
    from the string a command line or an activation file's metadata holds.

    Parameters
    ----------
    name : {"none", "causal", "sliding"}
    window : int, optional
        W, the keys a query sees under ``"sliding"`` (a positive integer); None for the other kinds.

    Examples
    --------
    >>> mask = Mask.parse("sliding:2")
    >>> mask.label, mask.estimator_kwargs
    ('sliding:2', {'mask': 'sliding:2'})
    >>> mask.visible_counts(3, 3).tolist()
    [1, 2, 2]
    """

    name: str = "none"
    window: int | None = None

    def __post_init__(self) -> None:
        if self.name not in MASK_KINDS:
            raise ValueError(f"Mask name {self.name!r} is not a mask kind; choose one of "
                             + ", ".join(repr(k) for k in MASK_KINDS))
        if self.name != "sliding":
            if self.window is not None:
                raise ValueError(f"Mask {self.name!r} takes no window, got window={self.window!r}")
            return
        if isinstance(self.window, bool) or not isinstance(self.window, (int, np.integer)):
            raise TypeError(f"Mask 'sliding' needs window W, a positive integer, got {self.window!r}")
        if self.window < 1:
            raise ValueError(f"Mask 'sliding' needs window W >= 1, got window={self.window}")
        object.__setattr__(self, "window", int(self.window))

    @classmethod
    def parse(cls, value: Any, where: str = "mask") -> "Mask":
        """The mask a string names: None or ``"none"``, ``"causal"``, ``"sliding:W"`` (W a positive integer).

        Parameters
        ----------
        value : None, str or Mask
            A mask as a command line, run metadata or an estimator's ``mask=`` gives it; a Mask is returned as is.
        where : str
            What ``value`` is, for the message (e.g. ``"mask of layer 3"``).

        Raises
        ------
        ValueError
            ``value`` names no mask; the message lists the forms that do.
        """
        if isinstance(value, cls):
            return value
        if value is None or value == "none":
            return cls()
        if isinstance(value, str):
            if value == "causal":
                return cls("causal")
            match = _SLIDING.match(value)
            if match is not None:
                return cls("sliding", int(match.group(1)))
            if value.startswith("sliding:"):  # the kind, with a window that is none
                raise ValueError(f"{where} {value!r}: the window W of 'sliding:W' must be a positive integer written "
                                 "without sign or leading zeros, as sliding:4096")
        raise ValueError(f"{where} {value!r} is not a mask kind; use 'none' (bidirectional), 'causal' or 'sliding:W' "
                         "(W a positive integer)")

    @property
    def masked(self) -> bool:
        """Whether some query does not see some key (every kind but ``none``)."""
        return self.name != "none"

    @property
    def label(self) -> str:
        """The name tables (the ``mask`` column), messages and the command line use: ``"none"``, ``"causal"``,
        ``"sliding:W"``; :meth:`parse` reads it back."""
        return f"sliding:{self.window}" if self.name == "sliding" else self.name

    @property
    def kind(self) -> str | None:
        """The mask as run metadata and an estimator's ``mask=`` hold it: None when nothing is masked, else
        :attr:`label`."""
        return self.label if self.masked else None

    @property
    def declared(self) -> str | None:
        """The entry of :data:`DECLARABLE_MASKS` that covers this mask, as a spec's ``masks`` declares it: None,
        ``"causal"`` or ``"sliding"`` (every window W)."""
        return self.name if self.masked else None

    @property
    def estimator_kwargs(self) -> dict[str, Any]:
        """``{"mask": kind}`` under a mask, ``{}`` otherwise: an estimator's callables get ``mask=`` only when set
        (so that one that takes no mask still runs bidirectionally). A new dict each time."""
        return {"mask": self.kind} if self.masked else {}

    def visible(self, num_queries: int, num_keys: int) -> np.ndarray | None:
        r"""``(N, M)`` boolean, True where key m is visible to query n; None when every key is.

        ``causal`` is :func:`causal_visible`; ``sliding`` adds the lower edge :math:`m > n + (M - N) - W`.

        Raises
        ------
        ValueError
            Under a mask, M < N (:func:`check_causal_shapes`).
        """
        if not self.masked:
            return None
        visible = causal_visible(num_queries, num_keys)
        if self.window is not None:
            last = last_visible_key(num_queries, num_keys)
            visible &= np.arange(num_keys)[None, :] > (last - self.window)[:, None]
        return visible

    def visible_tensor(self, num_queries: int, num_keys: int, device: Any = None) -> Any:
        r""":meth:`visible` as a torch boolean tensor on ``device``, made there as a band of ones (a host array
        uploaded would move N x M bytes per call); None when every key is visible.

        ``causal`` keeps :math:`m - n \le M - N` (``tril_``); ``sliding`` also :math:`m - n \ge M - N - W + 1`
        (``triu_``).
        """
        if not self.masked:
            return None
        import torch

        check_causal_shapes(num_queries, num_keys)
        offset = num_keys - num_queries
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril_(offset)
        return visible if self.window is None else visible.triu_(offset - self.window + 1)

    def first_visible_key(self, num_queries: int, num_keys: int) -> int:
        r"""The first key that some query sees: :math:`\max(0, M - N - W + 1)` under a window of W (the first
        query's window starts there and every later one's after it), else 0 (key 0 is every query's under
        ``causal``, and every key is visible without a mask).

        Raises
        ------
        ValueError
            Under a mask, M < N (:func:`check_causal_shapes`).
        """
        if not self.masked:
            return 0
        check_causal_shapes(num_queries, num_keys)
        return 0 if self.window is None else max(0, num_keys - num_queries - self.window + 1)

    def visible_counts(self, num_queries: int, num_keys: int) -> np.ndarray:
        r"""``(N,)`` int64: how many keys each query sees, without forming the ``(N, M)`` mask.

        M with no mask; :math:`p_n = n + (M - N) + 1` under ``causal``; :math:`\min(W, p_n)` under ``sliding``
        (the row sums of :meth:`visible`).

        Raises
        ------
        ValueError
            Under a mask, M < N (:func:`check_causal_shapes`).
        """
        if not self.masked:
            return np.full(num_queries, num_keys, dtype=np.int64)
        counts = (last_visible_key(num_queries, num_keys) + 1).astype(np.int64)
        return counts if self.window is None else np.minimum(counts, self.window)


def check_mask_argument(mask: Any, declared: tuple[str | None, ...] = MASKS) -> str | None:
    """An estimator's ``mask=`` keyword, checked against the masks it ``declared`` (entries of
    :data:`DECLARABLE_MASKS`): None, ``"causal"``, or ``"sliding:W"`` where ``"sliding"`` is declared. Returns it.

    Raises
    ------
    ValueError
        Naming the value and the masks allowed (``'sliding:W'`` written out as the form it takes).
    """
    allowed = ", ".join("'sliding:W' (W a positive integer)" if m == "sliding" else repr(m) for m in declared)
    try:
        parsed = Mask.parse(mask) if mask is None or isinstance(mask, str) else None
    except ValueError:
        parsed = None
    # "none" is a table label, not an estimator's keyword: the estimators take None for no mask
    if parsed is None or mask == "none" or parsed.declared not in declared:
        raise ValueError(f"mask={mask!r} is not allowed; choose one of {allowed}")
    return mask


#: the mask of a bidirectional layer (every key visible to every query); the default where a mask is optional
NO_MASK = Mask()
