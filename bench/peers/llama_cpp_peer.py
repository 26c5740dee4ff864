"""llama.cpp through its Python bindings (llama-cpp-python, peer ``llama-cpp-python``) on the bundle's GGUF source
file as it is: plain decoding and its prompt-lookup drafting (``LlamaPromptLookupDecoding``, the only drafter the
Python bindings ship)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

from bench.peers.common import PeerError, locate_checkpoint, skip, timed_rows
from runtime.bundle import Manifest

PEER = "llama-cpp-python"  # llama.cpp's own tools are the peer "llama.cpp" (bench.peers.llama_cpp_tools)


def run_llama_cpp(
    manifest: Manifest,
    bundle: Path,
    workloads: dict[str, list[list[int]]],
    best_k: dict[str, int],
    max_new_tokens: int,
    threads: int,
    eos_ids: tuple[int, ...] = (),
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """llama.cpp on the GGUF file the target was built from, as it is: plain decoding and its prompt-lookup drafting.

    llama-cpp-python's speculative decoding takes a ``LlamaDraftModel`` (a Python callback that proposes tokens);
    the only one it ships is ``LlamaPromptLookupDecoding``. llama.cpp's own draft-model speculation (a second model
    in ``common/speculative``) is not exposed by the bindings, so there is no llama.cpp row with a draft model."""
    if not manifest.spec.target.endswith(".gguf"):
        return [skip(PEER, "the bundle's target is not a GGUF file")]
    if importlib.util.find_spec("llama_cpp") is None:
        return [
            skip(
                PEER,
                "llama_cpp is not installed (pip install llama-cpp-python diskcache; it builds "
                "from source, ~7 minutes on 2 cores; on a CPU with AMX see docs/benchmarks.md "
                "for CMAKE_ARGS)",
            )
        ]
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        checkpoint = locate_checkpoint(manifest.target, bundle)
        path = str(checkpoint.folder / checkpoint.gguf_file)
    except (PeerError, ImportError) as err:
        return [skip(PEER, str(err))]
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    rows = []
    for workload, prompts in workloads.items():
        k = best_k.get(workload) or manifest.default_k
        models = {"plain": None, "prompt-lookup": LlamaPromptLookupDecoding(num_pred_tokens=k)}
        for mode, draft in models.items():
            llm = Llama(
                model_path=path,
                n_threads=threads or None,
                n_threads_batch=threads or None,
                n_ctx=longest + max_new_tokens + 8,
                draft_model=draft,
                verbose=False,
            )
            rows += timed_rows(
                PEER,
                workload,
                prompts,
                {mode: _llama_generate(llm, max_new_tokens, set(eos_ids) | {llm.token_eos()})},
                k,
                progress,
            )
            del llm
        plain = rows[-2]["tokens_per_second"]
        rows[-1]["speedup"] = rows[-1]["tokens_per_second"] / plain if plain else None
    return rows


def _llama_generate(llm, max_new_tokens: int, eos: set[int]):
    """Greedy ids from ``Llama.generate`` (the loop that consults the draft model), stopping at EOS or the limit.
    ``reset()`` first: ``generate`` would otherwise reuse the cache of a previous prompt's matching prefix and skip
    that prefill (the warm-up runs the first prompt twice)."""

    def generate(ids):
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in eos or len(out) >= max_new_tokens:
                break
        return out

    return generate


def llama_cpp_perplexity(manifest: Manifest, bundle: Path, windows: list[list[int]], threads: int) -> dict:
    """llama.cpp's perplexity on the GGUF file over ``windows`` (bench.quality's, the same token ids as ours):
    ``logits_all`` keeps every position's logits; each window is evaluated from an empty cache. Returns
    {"peer", "perplexity"} or a skip row."""
    if not manifest.spec.target.endswith(".gguf") or importlib.util.find_spec("llama_cpp") is None:
        return skip(PEER, "no GGUF target, or llama_cpp is not installed")
    from bench.quality import perplexity
    from llama_cpp import Llama

    try:
        checkpoint = locate_checkpoint(manifest.target, bundle)
    except PeerError as err:
        return skip(PEER, str(err))
    width = max(len(w) for w in windows)
    llm = Llama(
        model_path=str(checkpoint.folder / checkpoint.gguf_file),
        n_ctx=width,
        n_batch=width,
        n_threads=threads or None,
        n_threads_batch=threads or None,
        logits_all=True,
        verbose=False,
    )

    def logits_of(ids):
        llm.reset()
        llm.eval(ids)
        return llm._scores[: len(ids)]  # logits of every evaluated position (logits_all)

    return {"peer": PEER, "perplexity": perplexity(logits_of, windows)}
