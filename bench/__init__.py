"""Measurement: speed against target-only decoding and peers, report statistics, machine probes, per-operator
profiles, and load on a Triton server.

The last stage of the data flow: it may import every other package (runtime, builder, triton_repo) and none imports
it, except the ``draftsmith`` command table in ``runtime/cli.py`` that registers its commands.
"""
