"""Workflows: the library's rooms chained end to end, capture -> sweep -> report, each one call.

``randattn.workflows.demo`` (``randattn demo``): the bundled DINOv2 on bundled images; ``randattn.workflows.demo_lm``
(``randattn demo-lm``): the bundled SmolLM2 on bundled text, under its causal mask. A workflow may use
``randattn.activations``, ``randattn.analysis`` and ``randattn.reports``; none of them uses a workflow, and the command
line is its only caller in the package. Submodules are imported on use.
"""
