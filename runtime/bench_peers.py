"""Peers measured in the same bench run, on the same prompt token ids: Hugging Face transformers (plain generate and
assisted generation) and llama.cpp (llama-cpp-python), when installed (``pip install draftsmith[peers]``).

Each peer returns rows shaped like the bench's own: {"peer", "workload", "mode", "k", "tokens", "wall_seconds",
"tokens_per_second", "speedup"} where speedup is over *that peer's own* plain decoding, or a {"peer", "skipped"}
row saying why it did not run.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from typing import Callable

from runtime.bundle import Manifest


def _skip(peer: str, reason: str) -> dict:
    return {"peer": peer, "skipped": reason}


def _source_path(source: str):
    from builder.checkpoint import _locate
    return _locate(source)


def transformers_assistant(manifest: Manifest, target, allow_pickle: bool = False, trust_remote_code: bool = False):
    """The assistant model for transformers' assisted generation, and a sentence saying what it is.

    Consent to unpickle or to run a checkpoint's code comes from the person running the bench (its flags), never from
    the manifest: a bundle is data, and one that says ``trust_remote_code: true`` must not grant it.

    - a checkpoint draft: that checkpoint, loaded the same way;
    - ``self:layers=N``: the target's first N layers (shared weights), what the bundle's draft was built from;
    - ``self`` (the target re-quantized for the bundle): the target with its Linear layers dynamically quantized to
      int8 by torch (``quantize_dynamic``): the same weights at lower precision and lower cost, the nearest thing
      transformers runs on CPU to the bundle's int4 MatMulNBits self-draft (a plain fp32 copy would agree on every
      token but cost as much as the target, so it could never speed anything up).
    """
    from builder import build
    from builder.checkpoint import resolve
    spec = manifest.spec
    if spec.draft == "self" or spec.draft.startswith("self:"):
        option = spec.draft.partition(":")[2]
        if option.startswith("layers="):
            layers = int(option[7:])
            return build._truncate(target, layers), f"the target's first {layers} layers (as the bundle's draft)"
        import torch
        from torch.ao.quantization import quantize_dynamic
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assistant = quantize_dynamic(copy.deepcopy(target), {torch.nn.Linear}, dtype=torch.qint8)
        return assistant, ("the target with torch dynamic int8 Linear layers (stands in for the bundle's int4 "
                           "self-draft, which transformers cannot run)")
    checkpoint = resolve(spec.draft, allow_pickle, trust_remote_code)
    return checkpoint.load_model(), f"the draft checkpoint {spec.draft}"


def run_transformers(manifest: Manifest, workloads: dict[str, list[list[int]]], best_k: dict[str, int],
                     max_new_tokens: int, threads: int, eos_ids: tuple[int, ...],
                     progress: Callable[[str], None] | None = None, allow_pickle: bool = False,
                     trust_remote_code: bool = False) -> list[dict]:
    """Plain ``generate`` and ``generate(assistant_model=...)``, greedy, one sequence at a time, per workload.

    ``allow_pickle`` / ``trust_remote_code``: the caller's consent for reloading the source checkpoints (the
    manifest's record of the build's flags is never taken as consent)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return [_skip("transformers", "transformers/torch not installed (pip install draftsmith[peers])")]
    try:
        from builder.checkpoint import resolve
    except ImportError as err:
        return [_skip("transformers", f"cannot load the source checkpoints ({err})")]
    import torch
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # GGUF dequantization bars would tear through the bench's own output
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    if threads:
        torch.set_num_threads(threads)
    spec = manifest.spec
    try:
        import contextlib
        import io
        with contextlib.redirect_stderr(io.StringIO()):  # GGUF dequantization draws its own tqdm bars
            target = resolve(spec.target, allow_pickle, trust_remote_code).load_model()
            assistant, what = transformers_assistant(manifest, target, allow_pickle, trust_remote_code)
    except Exception as err:  # a peer failing must not sink the bench
        return [_skip("transformers", f"could not load {spec.target}: {type(err).__name__}: {err}")]
    assistant.eval()
    rows = []
    eos = list(eos_ids) or None
    for workload, prompts in workloads.items():
        k = best_k.get(workload) or manifest.default_k
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        results = {}
        for mode in ("target", "assisted"):
            tokens, wall = 0, 0.0
            for i, ids in enumerate([prompts[0]] + prompts):  # the first run warms up and is not counted
                input_ids = torch.tensor([ids])
                options = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                               pad_token_id=eos[0] if eos else None,
                               attention_mask=torch.ones_like(input_ids))
                if mode == "assisted":
                    options["assistant_model"] = assistant
                start = time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(input_ids, **options)
                elapsed = time.perf_counter() - start
                if i == 0:
                    continue
                tokens += int(out.shape[1]) - len(ids)
                wall += elapsed
                if progress:
                    progress(f"transformers {mode} {workload}")
            results[mode] = {"tokens": tokens, "wall_seconds": wall,
                             "tokens_per_second": tokens / wall if wall else 0.0}
        base = results["target"]["tokens_per_second"]
        for mode in ("target", "assisted"):
            r = results[mode]
            rows.append({"peer": "transformers", "workload": workload, "mode": mode,
                         "k": k if mode == "assisted" else None, **r,
                         "speedup": r["tokens_per_second"] / base if base else 0.0,
                         "assistant": what if mode == "assisted" else None})
    return rows


def run_llama_cpp(manifest: Manifest, workloads: dict[str, list[list[int]]], best_k: dict[str, int],
                  max_new_tokens: int, threads: int, progress: Callable[[str], None] | None = None) -> list[dict]:
    """llama.cpp on the same GGUF the pair comes from: plain decoding and its prompt-lookup speculative decoding
    (llama-cpp-python's only drafting option in Python). Skipped unless ``llama_cpp`` imports and the source is GGUF."""
    if not manifest.spec.target.endswith(".gguf"):
        return [_skip("llama.cpp", "the bundle's target is not a GGUF file")]
    if importlib.util.find_spec("llama_cpp") is None:
        return [_skip("llama.cpp", "llama_cpp is not installed (pip install llama-cpp-python; builds from source)")]
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        path = str(_source_path(manifest.spec.target))
    except Exception as err:
        return [_skip("llama.cpp", f"{type(err).__name__}: {err}")]
    rows = []
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    for workload, prompts in workloads.items():
        k = best_k.get(workload) or manifest.default_k
        results = {}
        for mode in ("target", "prompt-lookup"):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if mode == "prompt-lookup" else None
            llm = Llama(model_path=path, n_threads=threads or None, n_ctx=longest + max_new_tokens + 8,
                        draft_model=draft, verbose=False)
            tokens, wall = 0, 0.0
            for i, ids in enumerate([prompts[0]] + prompts):
                llm.reset()
                start = time.perf_counter()
                out = llm.create_completion(ids, max_tokens=max_new_tokens, temperature=0.0)
                elapsed = time.perf_counter() - start
                if i == 0:
                    continue
                tokens += int(out["usage"]["completion_tokens"])
                wall += elapsed
                if progress:
                    progress(f"llama.cpp {mode} {workload}")
            results[mode] = {"tokens": tokens, "wall_seconds": wall,
                             "tokens_per_second": tokens / wall if wall else 0.0}
            del llm
        base = results["target"]["tokens_per_second"]
        for mode, r in results.items():
            rows.append({"peer": "llama.cpp", "workload": workload, "mode": mode,
                         "k": k if mode != "target" else None, **r,
                         "speedup": r["tokens_per_second"] / base if base else 0.0})
    return rows
