"""RFA's keyword options, declared once: the spec's ``params`` and the keywords of every entry point.

:class:`RfaOptions` serves the reference and batched forms (``mask=`` included); the causal
prefix-sum forms of :mod:`randattn.estimators.rfa.causal` take :class:`CausalRfaOptions` (no
``mask``: they are the causal form) and, for :func:`~randattn.estimators.rfa.causal.causal_estimate`,
:class:`ChunkedCausalRfaOptions` (its ``chunk_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

from randattn.estimators.base import EstimatorOptions, option
from randattn.estimators.features import FEATURE_MAPS
from randattn.estimators.rfa.masking import check_rfa_mask
from randattn.estimators.sampling import COUPLINGS
from randattn.estimators.snis.prefix import DEFAULT_CHUNK_SIZE

__all__ = ["RfaOptions", "CausalRfaOptions", "ChunkedCausalRfaOptions"]


@dataclass(frozen=True, kw_only=True)
class _FeatureOptions(EstimatorOptions):
    """The parameters every RFA form takes: the feature map and the coupling of its directions."""

    feature_map: str = option("positive", "random-feature map of exp(x.y)", choices=FEATURE_MAPS)
    coupling: str = option(
        "iid", "joint law of the S directions (orthogonal-plain-qr: biased, for comparison)", choices=COUPLINGS
    )


@dataclass(frozen=True, kw_only=True)
class RfaOptions(_FeatureOptions):
    """The options of ``rfa.reference.estimate`` and the forms of ``rfa.batched``.

    Construction runs :func:`~randattn.estimators.rfa.masking.check_rfa_mask`: an unknown mask, or
    ``mask="causal"`` with a data-dependent map, raises ``ValueError`` naming it. ``coupling`` is
    only used by ``draw``; it is accepted so that one parameter set serves both.
    """

    mask: str | None = None

    def check(self) -> None:
        check_rfa_mask(self.mask, self.feature_map)


@dataclass(frozen=True, kw_only=True)
class CausalRfaOptions(_FeatureOptions):
    """The options of the causal prefix-sum forms: a map with a causal form (:func:`check_rfa_mask`)."""

    def check(self) -> None:
        check_rfa_mask("causal", self.feature_map)


@dataclass(frozen=True, kw_only=True)
class ChunkedCausalRfaOptions(CausalRfaOptions):
    """:class:`CausalRfaOptions` and the tokens per chunk of the prefix sums (a power of two, checked where used)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
