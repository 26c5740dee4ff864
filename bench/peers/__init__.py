"""Peers measured in the same bench run, on the same prompt token ids, greedy, one sequence at a time (``pip install
draftsmith[peers]``; each peer is skipped, with the reason, when it is not installed or cannot run):

- **transformers**: plain ``generate`` and assisted generation with the bundle's draft (torch, fp32);
- **llama.cpp** (llama-cpp-python) on the bundle's GGUF source file as it is: plain decoding, and its prompt-lookup
  drafting (``LlamaPromptLookupDecoding``, the only drafter the Python bindings ship);
- **OpenVINO GenAI** on the bundle's GGUF source file, read directly: plain decoding and its prompt lookup;
- **ONNX Runtime GenAI**: its own model-builder graphs of the same weights (fp32 and int4), plain, and its
  speculative decoding (``GeneratorParams.set_speculative_options``) with the bundle's draft built by the same
  builder. Graphs are cached under ``~/.cache/draftsmith/peers/<sha256 of the source weights>/`` (or
  ``$DRAFTSMITH_PEERS_CACHE``).

One module a peer (``transformers_peer``, ``llama_cpp_peer``, ``genai_peer``, ``openvino_peer``; llama.cpp's own
tools: ``llama_cpp_tools``) over what they share (``common``: the sources, our reference, the timed rows). Import each
name from its module (``from bench.peers.llama_cpp_peer import run_llama_cpp``): this package file imports nothing,
so loading one peer never loads the others (tests/test_layout.py: no import circle through a package's
``__init__``). A new peer: a ``run_<peer>(manifest, bundle, workloads, best_k, max_new_tokens, threads,
eos_ids, progress)`` returning rows, made with ``common.timed_rows``, and its call in ``run.py``'s ``_run_peers``.

Every peer returns rows {"peer", "workload", "mode", "k", "prompts", "tokens", "wall_seconds", "tokens_per_second",
"speedup" (over that peer's own plain decoding), "token_ids" (one list per prompt)}, or a {"peer", "skipped"} row.
``compare_with_ours`` then adds the speedup over our target-only decoding and whether the greedy ids equal ours.
Times include each prompt's prefill, as the bench's own tokens/s do; the first prompt runs once untimed (warm-up).

Sources: a bundle names its checkpoints as the user typed them (``drafts/smollm2-135m-l4``); ``locate_checkpoint``
finds them from any working directory and checks their sha256 against the manifest, so a peer never measures other
weights than the bundle's. Reloading a pickled or remote-code checkpoint takes the bench's own flags, never the
manifest's record of the build's.
"""
