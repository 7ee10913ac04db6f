"""A family's ``draw`` written on its options, as :func:`~randattn.estimators.base.keyword_entry` writes its forms.

``draw(q_shape, k_shape, *, num_samples, replicates, rng, **params)`` restated every parameter of a family with its
default; :func:`draw_entry` gives it the keywords of the family's :class:`~randattn.estimators.base.EstimatorOptions`
instead (every field but ``scale``, which ``draw`` never takes), so that they are declared once, in the options.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

from randattn.estimators.base import Draws, EstimatorOptions

__all__ = ["draw_entry"]


def draw_entry(options_type: type[EstimatorOptions]) -> Callable[[Callable[..., Draws]], Callable[..., Draws]]:
    """Decorate ``impl(q_shape, k_shape, *, num_samples, ..., options)`` into ``draw(q_shape, k_shape, *,
    num_samples, ..., **params)``.

    The public ``draw`` lists the arguments of ``impl`` before ``options`` and, keyword-only, every field of
    ``options_type`` but ``scale`` with its default (``mask`` among them where the family has one), so
    ``inspect.signature`` and a wrong keyword read as for a hand-written function; a call builds one
    ``options_type`` (which checks the parameters) and hands it to ``impl`` by keyword. ``impl`` stays reachable
    as ``draw.on_options``.
    """
    keywords = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(options_type) if f.name != "scale"
    ]

    def decorate(impl: Callable[..., Draws]) -> Callable[..., Draws]:
        impl_parameters = list(inspect.signature(impl).parameters.values())
        protocol, options_name = impl_parameters[:-1], impl_parameters[-1].name
        signature = inspect.signature(impl).replace(parameters=[*protocol, *keywords])
        protocol_names = [p.name for p in protocol]

        @functools.wraps(impl)
        def draw(*args: Any, **kwargs: Any) -> Draws:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{impl.__name__}(): {exc}") from None
            bound.apply_defaults()
            given = bound.arguments
            options = options_type(**{name: value for name, value in given.items() if name not in protocol_names})
            return impl(**{name: given[name] for name in protocol_names}, **{options_name: options})

        del draw.__wrapped__  # inspect.signature must give the keyword signature, not impl's
        draw.__signature__ = signature
        draw.on_options = impl
        return draw

    return decorate
