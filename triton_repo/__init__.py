"""Triton Inference Server model repositories for Draftsmith bundles."""
