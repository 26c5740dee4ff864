"""Draftsmith runtime: exact speculative decoding over a bundle's engines (numpy + onnxruntime, no torch).

The light side every other package imports; it imports none of them (``tests/test_layout.py``).
"""

from runtime.bundle import BuildSpec, BundleError, Manifest, load_manifest
from runtime.errors import RequestError

__all__ = ["BuildSpec", "BundleError", "Manifest", "RequestError", "load_manifest", "SpeculativeGenerator"]


def __getattr__(name):  # lazy: importing runtime.bundle must not load onnxruntime
    if name == "SpeculativeGenerator":
        from runtime.api import SpeculativeGenerator
        return SpeculativeGenerator
    raise AttributeError(name)
