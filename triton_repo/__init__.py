"""Triton Inference Server model repositories for Draftsmith bundles: generated from a bundle, served by the runtime.

Imports the runtime only; the bench drives it from outside (``bench/load.py``, ``bench/serving.py``).
"""
