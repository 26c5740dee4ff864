"""build-engines: checkpoint -> export -> quantize -> evaluate -> bundle; ``distill/`` trains a draft first.

The heavy side (torch): it writes bundles in the runtime's schema (``runtime.bundle``) and never imports the bench;
only its CLI reaches into ``triton_repo`` (``--triton-repo``).
"""
