"""Draftsmith runtime: exact speculative decoding over a bundle's engines (numpy + onnxruntime, no torch).

The light side every other package imports; it imports none of them (``tests/test_layout.py``).

Import each name from its module: ``runtime.api.SpeculativeGenerator`` (the Python API, docs/running.md),
``runtime.bundle`` (``BuildSpec``, ``Manifest``, ``BundleError``, ``load_manifest``), ``runtime.errors.RequestError``.
This package file imports nothing, so loading one module never loads the others (tests/test_layout.py: no import
circle through a package's ``__init__``).
"""
