"""The drafter names a bundle may record (``spec.drafter``) and a request or a CLI may pick, as plain data.

Why a module of its own that imports nothing: the bundle schema (runtime/bundle.py) checks a name at the bottom of the
runtime, below the engines and the decoding the drafters build on. Importing the registry there would load every
drafter with the schema and tie the folders into a circle (bundle -> drafters -> engines -> bundle). What each name
makes is runtime/drafters/registry.py's; tests/test_drafter_contract.py holds the two to the same names in the same
order (the order help texts list them in).
"""

DRAFTERS = ("model", "prompt_lookup", "hybrid", "suffix", "hybrid_suffix", "tli", "string")
