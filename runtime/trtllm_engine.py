"""Runtime adapter for tensorrt_llm bundles. tensorrt_llm is imported lazily: this module loads without it.

Engine flavor (bundles with target/engine and draft/engine):
    ``RunnerEngine`` implements runtime.engine.Engine over ``tensorrt_llm.runtime.ModelRunnerCpp``, so
    ``SpeculativeGenerator`` (the same Python API, statistics and CLI as ONNX bundles) drives TensorRT engines.
    ModelRunnerCpp owns its KV cache and offers no per-token rollback, so each row's token history is kept here:
    ``forward`` submits history + new tokens as a one-token request with KV-cache block reuse on
    (``ModelRunnerCpp.from_dir(..., kv_cache_enable_block_reuse=True)``: the shared prefix is not recomputed) and
    reads the logits of the new positions from ``context_logits`` (engines are built with
    ``--gather_context_logits``); ``rollback`` truncates the history. Correct by construction, not TensorRT-LLM's
    fastest path: that is the target verifying external draft tokens itself (``generate(..., draft_tokens_list=...)``
    -> executor ``ExternalDraftTokensConfig``), which the Triton ``tensorrt_llm_bls`` layout uses.

LLM-API flavor (bundles with llm_api.yaml):
    ``LlmApiGenerator`` runs ``LLM(target, speculative_config=DraftTargetDecodingConfig(max_draft_len=K,
    speculative_model=draft))``; TensorRT-LLM drafts and verifies internally. Its ``generate`` takes the same
    arguments and returns the same ``Generation`` objects as ``SpeculativeGenerator.generate`` for the subset the
    LLM API exposes (greedy or sampled with temperature/top_k/top_p/seed; no per-request k, no draft statistics).

``open_generator(bundle)`` picks the right one for any bundle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime.bundle import Manifest, load_manifest
from runtime.engine import KVCache

INSTALL_HINT = "pip install 'draftsmith[tensorrt]' on a Linux machine with an NVIDIA GPU"


class TrtllmUnavailable(RuntimeError):
    """tensorrt_llm (or a GPU) is missing; the message says what to install."""


def require_tensorrt_llm():
    """Import tensorrt_llm or raise TrtllmUnavailable with the install command."""
    try:
        import tensorrt_llm
    except ImportError as err:
        raise TrtllmUnavailable(f"this bundle needs TensorRT-LLM, which is not importable here ({err}): "
                                f"{INSTALL_HINT}") from None
    return tensorrt_llm


# --- engine flavor: the Engine protocol over ModelRunnerCpp ---------------------------------------------------------

def open_runner(engine_dir: Path, max_batch_size: int | None = None, kv_fraction: float = 0.4):
    """ModelRunnerCpp for one engine (tensorrt_llm/runtime/model_runner_cpp.py: from_dir keywords)."""
    require_tensorrt_llm()
    from tensorrt_llm.runtime import ModelRunnerCpp
    kwargs: dict[str, Any] = dict(engine_dir=str(engine_dir), kv_cache_enable_block_reuse=True,
                                  kv_cache_free_gpu_memory_fraction=kv_fraction)
    if max_batch_size:
        kwargs["max_batch_size"] = max_batch_size
    return ModelRunnerCpp.from_dir(**kwargs)


class RunnerEngine:
    """runtime.engine.Engine over a runner with ModelRunnerCpp's ``generate`` (or any object with that method).

    State lives in the KVCache: ``extra["tokens"]`` holds each row's live token ids; ``mask``/``lengths`` mirror
    them so the speculative loop sees the same cache fields as with ONNX engines (``past`` stays empty).
    """

    def __init__(self, runner, *, vocab_size: int, max_context: int, end_id: int, pad_id: int):
        self.runner, self.vocab_size, self.max_context = runner, vocab_size, max_context
        self.end_id, self.pad_id = end_id, pad_id

    def new_cache(self, batch: int) -> KVCache:
        return KVCache([], np.zeros((batch, 0), np.int64), np.zeros(batch, np.int64),
                       extra={"tokens": [[] for _ in range(batch)]})

    def forward(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
        """Append tokens [B, S] (valid [B, S]: 1 = real token) and return logits [B, S, V] of the new positions."""
        import torch
        tokens = np.asarray(tokens, dtype=np.int64)
        valid = np.ones_like(tokens) if valid is None else np.asarray(valid, dtype=np.int64)
        batch, width = tokens.shape
        histories = cache.extra["tokens"]
        new = [[int(t) for t, v in zip(tokens[b], valid[b]) if v] for b in range(batch)]
        rows = [b for b in range(batch) if new[b]]
        logits = np.zeros((batch, width, self.vocab_size), np.float32)
        if rows:
            inputs = [torch.tensor(histories[b] + new[b], dtype=torch.int32) for b in rows]
            # max_new_tokens=1: a context pass; return_dict=True gives "context_logits" (per request
            # [input_len, vocab] when the engine gathers context logits). With block reuse, only the rows after the
            # reused prefix may be returned, so the new positions are read from the end.
            out = self.runner.generate(inputs, max_new_tokens=1, end_id=self.end_id, pad_id=self.pad_id,
                                       return_dict=True)
            context = out["context_logits"]
            for i, b in enumerate(rows):
                rows_logits = _to_numpy(context[i])[-len(new[b]):, : self.vocab_size]
                logits[b, np.flatnonzero(valid[b])] = rows_logits
        for b in range(batch):
            histories[b].extend(new[b])
        cache.mask = np.concatenate([cache.mask, valid], axis=1)
        cache.lengths = cache.lengths + valid.sum(axis=1)
        cache.calls += 1
        return logits

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        for b, history in enumerate(cache.extra["tokens"]):
            del history[int(keep[b]):]
        cache.lengths = np.minimum(cache.lengths, keep)
        cache.mask = (np.arange(cache.slots)[None, :] < cache.lengths[:, None]).astype(np.int64)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        tokens = [list(cache.extra["tokens"][int(r)]) for r in rows]
        lengths = cache.lengths[rows]
        width = int(lengths.max()) if len(rows) else 0
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return KVCache([], mask, lengths.copy(), cache.calls, extra={"tokens": tokens})


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


# --- LLM-API flavor -------------------------------------------------------------------------------------------------

def llm_api_kwargs(root: Path, manifest: Manifest) -> dict[str, Any]:
    """The bundle's llm_api.yaml with paths made absolute."""
    import yaml
    kwargs = yaml.safe_load((root / "llm_api.yaml").read_text(encoding="utf-8"))
    kwargs["model"] = str(root / kwargs["model"])
    kwargs["tokenizer"] = str(root / kwargs["tokenizer"])
    kwargs["speculative_config"] = dict(kwargs["speculative_config"],
                                        speculative_model=str(root / kwargs["speculative_config"]["speculative_model"]))
    return kwargs


def draft_target_config(options: dict[str, Any]):
    """DraftTargetDecodingConfig(max_draft_len=K, speculative_model=draft) for the installed tensorrt_llm.

    tensorrt_llm/llmapi/llm_args.py: current releases name the field ``speculative_model`` (alias
    ``speculative_model_dir``); 1.0-1.2 name it ``speculative_model_dir``.
    """
    require_tensorrt_llm()
    from tensorrt_llm.llmapi import DraftTargetDecodingConfig
    fields = getattr(DraftTargetDecodingConfig, "model_fields", {})
    key = "speculative_model" if "speculative_model" in fields else "speculative_model_dir"
    return DraftTargetDecodingConfig(max_draft_len=options["max_draft_len"], **{key: options["speculative_model"]})


class LlmApiGenerator:
    """Draft-target speculative generation inside TensorRT-LLM's LLM API (PyTorch backend)."""

    def __init__(self, manifest: Manifest, llm, eos_ids: tuple[int, ...] = ()):
        self.manifest, self.llm, self.eos_ids = manifest, llm, tuple(eos_ids)
        self.default_k = manifest.default_k

    @classmethod
    def from_bundle(cls, path: str | os.PathLike, verify: bool = True) -> "LlmApiGenerator":
        root = Path(path)
        manifest = load_manifest(root, verify=verify)
        kwargs = llm_api_kwargs(root, manifest)
        require_tensorrt_llm()
        from tensorrt_llm import LLM
        speculative = draft_target_config(kwargs.pop("speculative_config"))
        return cls(manifest, LLM(**kwargs, speculative_config=speculative), manifest.eos_token_ids)

    def generate(self, prompts: str | list[str], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None, **unsupported):
        """Same call and result types as SpeculativeGenerator.generate for what the LLM API exposes."""
        from runtime.api import Generation
        from runtime.errors import RequestError
        given = {k: v for k, v in unsupported.items() if v not in (None, False, "speculative")}
        if given:
            raise RequestError(f"LLM-API bundles do not support {sorted(given)} (TensorRT-LLM drafts internally)")
        from tensorrt_llm import SamplingParams
        params = {"max_tokens": max_new_tokens, "temperature": temperature}
        params.update({k: v for k, v in (("top_k", top_k), ("top_p", top_p), ("seed", seed)) if v is not None})
        single = isinstance(prompts, str)
        outputs = self.llm.generate([prompts] if single else list(prompts), SamplingParams(**params))
        results = []
        for output in outputs:  # RequestOutput: prompt_token_ids, outputs[0] (CompletionOutput: text, token_ids)
            completion = output.outputs[0]
            reason = {"length": "length"}.get(str(completion.finish_reason), "stop")
            results.append(Generation(completion.text, list(completion.token_ids), len(output.prompt_token_ids),
                                      reason))
        return results[0] if single else results


# --- any bundle -----------------------------------------------------------------------------------------------------

def open_generator(path: str | os.PathLike, threads: int = 0, verify: bool = True):
    """SpeculativeGenerator for onnxruntime and engine-flavor bundles, LlmApiGenerator for llmapi bundles."""
    from runtime.api import SpeculativeGenerator
    from runtime.text import Tokenizer
    root = Path(path)
    manifest = load_manifest(root, verify=verify)
    if manifest.spec.backend == "onnxruntime":
        return SpeculativeGenerator.from_bundle(root, threads=threads, verify=False)
    if manifest.spec.trtllm_flavor == "llmapi":
        return LlmApiGenerator.from_bundle(root, verify=False)
    tokenizer = Tokenizer(root / "tokenizer")
    eos = manifest.eos_token_ids[0] if manifest.eos_token_ids else 0
    vocab = min(manifest.target.vocab_size, tokenizer.vocab_size)
    engines = {entry.role: RunnerEngine(open_runner(root / entry.engine, manifest.spec.max_batch_size),
                                        vocab_size=vocab, max_context=manifest.max_context, end_id=eos, pad_id=eos)
               for entry in (manifest.target, manifest.draft)}
    return SpeculativeGenerator(manifest, engines["target"], engines["draft"], tokenizer, manifest.eos_token_ids)
