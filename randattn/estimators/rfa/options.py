"""RFA's keyword options, declared once: the spec's ``params`` and the keywords of every entry point.

:class:`RfaOptions` serves the reference and batched forms (``mask=`` included); the causal
prefix-sum forms of :mod:`randattn.estimators.rfa.causal` extend :class:`FeatureOptions` there (no
``mask``: they are the causal form). No torch here: the reference form imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from randattn.estimators.base import EstimatorOptions, option
from randattn.estimators.features import FEATURE_MAPS
from randattn.estimators.rfa.masking import check_rfa_mask
from randattn.estimators.sampling import COUPLINGS

__all__ = ["FeatureOptions", "RfaOptions", "coupling_option"]


def coupling_option() -> str:
    """The ``coupling`` field of an options class whose estimator draws RFA's directions (RFA, Scatterbrain)."""
    return option("iid", "joint law of the S directions (orthogonal-plain-qr: biased, for comparison)",
                  choices=COUPLINGS)


@dataclass(frozen=True, kw_only=True)
class FeatureOptions(EstimatorOptions):
    """The parameters every RFA form takes: the feature map and the coupling of its directions."""

    feature_map: str = option("positive", "random-feature map of exp(x.y)", choices=FEATURE_MAPS)
    coupling: str = coupling_option()


@dataclass(frozen=True, kw_only=True)
class RfaOptions(FeatureOptions):
    """The options of ``rfa.reference.estimate`` and the forms of ``rfa.batched``.

    Construction runs :func:`~randattn.estimators.rfa.masking.check_rfa_mask`: an unknown mask, or
    ``mask="causal"`` with a data-dependent map, raises ``ValueError`` naming it. ``coupling`` is
    only used by ``draw``; it is accepted so that one parameter set serves both.
    """

    mask: str | None = None

    def check(self) -> None:
        check_rfa_mask(self.mask, self.feature_map)
