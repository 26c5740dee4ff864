"""Runtime adapter for tensorrt_llm bundles. tensorrt_llm is imported lazily: this module loads without it.

Engine flavor (bundles with target/engine and draft/engine):
    ``ExternalDraftGenerator`` runs draft-target speculative decoding the way TensorRT-LLM supports it for
    ``draft_tokens_external`` engines: the draft engine proposes k tokens (greedy), and the target engine verifies
    them itself in one request carrying them as ``ExternalDraftTokensConfig`` (what Triton's ``tensorrt_llm_bls``
    sends as ``draft_input_ids``). The target returns the accepted draft tokens plus its own next token, so the
    output is the target's greedy output by construction. Both engines open as upstream's draft-target runner opens
    them (examples/ngram/run_dtm_ngram.py): ModelRunnerCpp in orchestrator mode with ``device_ids``, so a TP/PP > 1
    engine runs from one process, and with KV-cache block reuse on (the target refuses to load without it).
    It cannot return per-position logits: ``trtllm-build`` refuses ``--gather_context_logits`` with
    ``--max_draft_len > 0`` (tests/fixtures/trtllm/trtllm_build.json). Greedy only; sampled requests are refused.
    ``RunnerEngine`` remains the runtime's Engine protocol over a ModelRunnerCpp-like runner, for engines built
    without a draft length and with ``--gather_context_logits`` (tests/test_engine_contract.py checks it).

LLM-API flavor (bundles with llm_api.yaml): runtime/trtllm/llmapi.py (``LlmApiGenerator``, the yaml allow-list).

``open_generator(bundle)`` picks the right one for any bundle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime.bundle import BundleError, Manifest, load_manifest, verify_files
from runtime.engines.base import Engine, KVCache
from runtime.trtllm.common import require_tensorrt_llm
from runtime.trtllm.llmapi import LlmApiGenerator

# --- engine flavor: the Engine protocol over ModelRunnerCpp ---------------------------------------------------------


def open_runner(
    engine_dir: Path,
    max_batch_size: int | None = None,
    kv_fraction: float = 0.5,
    block_reuse: bool = True,
    devices: list[int] | None = None,
    orchestrator: bool = True,
):
    """ModelRunnerCpp for one engine, as upstream's draft-target runner opens it.

    tensorrt_llm/runtime/model_runner_cpp.py ``from_dir`` keywords; examples/ngram/run_dtm_ngram.py opens the draft
    and the target with ``is_orchestrator_mode=True`` and ``device_ids=[...]`` (one id per GPU of the engine's
    tp x pp), which is how a TP>1 engine runs from one Python process: the executor spawns its worker ranks.
    Block reuse stays on: a draft_tokens_external target refuses to load without it
    (cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp: "KV cache block reuse must be enabled for
    speculative decoding target model"; tests/fixtures/trtllm/batch_manager.json). kv_fraction 0.5: the draft-target
    guide's kv_cache_free_gpu_memory_fraction when draft and target share a GPU.
    """
    require_tensorrt_llm()
    from tensorrt_llm.runtime import ModelRunnerCpp

    kwargs: dict[str, Any] = dict(
        engine_dir=str(engine_dir),
        kv_cache_enable_block_reuse=block_reuse,
        kv_cache_free_gpu_memory_fraction=kv_fraction,
        is_orchestrator_mode=orchestrator,
    )
    if devices is not None:
        kwargs["device_ids"] = [int(d) for d in devices]
    if max_batch_size:
        kwargs["max_batch_size"] = max_batch_size
    return ModelRunnerCpp.from_dir(**kwargs)


def executor_of(runner):
    """The executor a ModelRunnerCpp holds: ``runner.executor`` in the stored model_runner_cpp.py read
    (tests/fixtures/trtllm/model_runner_cpp.json), ``runner.session`` in older ones."""
    for name in ("executor", "session"):
        executor = getattr(runner, name, None)
        if executor is not None:
            return executor
    raise BundleError(
        f"{type(runner).__name__} has neither .executor nor .session: not a ModelRunnerCpp this "
        "adapter knows (tensorrt_llm/runtime/model_runner_cpp.py)"
    )


class ExecutorSession:
    """Greedy requests on one engine through the executor that ModelRunnerCpp holds (``executor_of``).

    What ModelRunnerCpp.generate itself does with ``draft_tokens_list`` (tensorrt_llm/runtime/model_runner_cpp.py,
    "Draft-Target-Model speculative decoding"), per row instead of one max_new_tokens for the batch: one
    ``tensorrt_llm.bindings.executor.Request(input_token_ids, max_tokens, pad_id, end_id, sampling_config,
    output_config, external_draft_tokens_config)`` per row, ``enqueue_requests``, then ``await_responses()`` until
    every ``result.is_final``; tokens in ``result.output_token_ids[0]``. Not run here: no GPU.
    """

    def __init__(self, runner, end_id: int, pad_id: int):
        self.runner, self.end_id, self.pad_id = runner, end_id, pad_id
        self.executor = executor_of(runner)

    def generate(
        self, histories: list[list[int]], max_tokens: list[int], drafts: list[list[int]] | None = None
    ) -> list[list[int]]:
        """New tokens per row (the input excluded); with drafts, the target verifies them in the same request."""
        import tensorrt_llm.bindings.executor as executor

        requests = []
        for row, history in enumerate(histories):
            draft = drafts[row] if drafts else []
            requests.append(
                executor.Request(
                    input_token_ids=list(history),
                    max_tokens=int(max_tokens[row]),
                    end_id=self.end_id,
                    pad_id=self.pad_id,
                    sampling_config=executor.SamplingConfig(top_k=1),
                    output_config=executor.OutputConfig(exclude_input_from_output=True),
                    external_draft_tokens_config=executor.ExternalDraftTokensConfig(draft) if draft else None,
                )
            )
        ids = self.executor.enqueue_requests(requests)
        done: dict[int, list[int]] = {}
        while len(done) < len(ids):
            for response in self.executor.await_responses():
                if response.has_error():
                    raise RuntimeError(f"TensorRT-LLM request failed: {response.error_msg}")
                if response.result.is_final:
                    done[response.request_id] = list(response.result.output_token_ids[0])
        return [done[i] for i in ids]


class ExternalDraftGenerator:
    """Greedy draft-target generation over two executors: draft proposes, target verifies (engine flavor).

    ``target`` and ``draft`` are ExecutorSession-like: ``generate(histories, max_tokens, drafts=None)``.
    """

    def __init__(self, manifest: Manifest, target, draft, tokenizer, eos_ids: tuple[int, ...] = ()):
        self.manifest, self.target, self.draft, self.tokenizer = manifest, target, draft, tokenizer
        self.eos_ids = tuple(eos_ids)
        self.default_k = manifest.default_k
        self.max_k, self.max_context = manifest.spec.max_k, manifest.max_context

    def generate(
        self,
        prompts: str | list[str],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        k: int | None = None,
        chat: bool = False,
        mode: str = "speculative",
        **unsupported,
    ):
        """SpeculativeGenerator.generate's call and result types, greedy; mode "target" drafts nothing."""
        from runtime.core.handles import Generation
        from runtime.errors import RequestError

        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, received {max_new_tokens!r}")
        given = sorted(key for key, value in unsupported.items() if value not in (None, False, 0, 0.0))
        if temperature or given:
            raise RequestError(
                "engine-flavor TensorRT-LLM bundles generate greedily in-process (the target verifies "
                f"draft tokens itself); not supported here: {given or ['temperature > 0']}. "
                "Serve the bundle with Triton or build the llmapi flavor for sampling."
            )
        k = self.default_k if k is None else k
        if mode not in ("speculative", "target") or not 1 <= k <= self.max_k:
            raise RequestError(
                f"mode must be 'speculative' or 'target' and k in [1, {self.max_k}], received {mode!r}, {k!r}"
            )
        single = isinstance(prompts, str)
        rows = [_Row(self._encode(p, chat), max_new_tokens) for p in ([prompts] if single else list(prompts))]
        while any(not row.finished for row in rows):
            self._step([row for row in rows if not row.finished], 0 if mode == "target" else k)
        results = [
            Generation(
                self.tokenizer.decode(row.generated), list(row.generated), len(row.prompt), row.finished, row.stats
            )
            for row in rows
        ]
        return results[0] if single else results

    def _encode(self, prompt: str, chat: bool) -> list[int]:
        from runtime.errors import RequestError

        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string")
        ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt) if chat else prompt)
        if not ids or len(ids) >= self.max_context:
            raise RequestError(f"prompt has {len(ids)} tokens; this bundle's context is {self.max_context}")
        return ids

    def _step(self, rows: list["_Row"], k: int) -> None:
        """One draft call and one verify call for every live row."""
        room = [
            min(row.budget - len(row.generated), self.max_context - len(row.prompt) - len(row.generated))
            for row in rows
        ]
        lengths = [max(0, min(k, r - 1)) for r in room]
        histories = [row.prompt + row.generated for row in rows]
        drafts = [[] for _ in rows]
        drafting = [i for i, n in enumerate(lengths) if n]
        if drafting:
            proposed = self.draft.generate([histories[i] for i in drafting], [lengths[i] for i in drafting])
            for i, tokens in zip(drafting, proposed):
                drafts[i] = list(tokens[: lengths[i]])
        outputs = self.target.generate(histories, [len(d) + 1 for d in drafts], drafts)
        for row, draft, new, limit in zip(rows, drafts, outputs, room):
            row.take(list(new)[:limit], draft, self.eos_ids, limit)


class _Row:
    def __init__(self, prompt: list[int], budget: int):
        from runtime.metrics import RequestStats

        self.prompt, self.budget, self.generated, self.finished = prompt, budget, [], ""
        self.stats = RequestStats(prompt_tokens=len(prompt))

    def take(self, new: list[int], draft: list[int], eos_ids: tuple[int, ...], room: int) -> None:
        accepted = 0
        while accepted < min(len(draft), len(new)) and new[accepted] == draft[accepted]:
            accepted += 1
        stop = next((i for i, t in enumerate(new) if t in eos_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        self.stats.record_step(len(draft), min(accepted, len(new)), len(new), False)
        self.generated.extend(new)
        if stop is not None:
            self.finished = "stop"
        elif not new or len(new) >= room:
            self.finished = "length"
        self.stats.finish_reason = self.finished


class RunnerEngine(Engine):
    """runtime.engines.base.Engine over a runner with ModelRunnerCpp's ``generate`` (or any object with that method).

    State lives in the KVCache: ``extra["tokens"]`` holds each row's live token ids; ``mask``/``lengths`` mirror
    them so the speculative loop sees the same cache fields as with ONNX engines (``past`` stays empty).
    """

    def __init__(self, runner, *, vocab_size: int, max_context: int, end_id: int, pad_id: int):
        self.runner, self.vocab_size, self.max_context = runner, vocab_size, max_context
        self.end_id, self.pad_id = end_id, pad_id

    def new_cache(self, batch: int) -> KVCache:
        return KVCache(
            [], np.zeros((batch, 0), np.int64), np.zeros(batch, np.int64), extra={"tokens": [[] for _ in range(batch)]}
        )

    def compute(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        valid: np.ndarray | None = None,
        *,
        exact: bool = True,
        last: bool = False,
        score: bool = True,
        features: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Append tokens [B, S] (valid [B, S]: 1 = real token) and return logits [B, S, V] of the new positions;
        with ``last``, [B, 1, V] at each row's last new token (the rest of the runner's context logits are never
        copied to the host). Without ``score`` (a prompt whose logits nobody reads) they are only recorded: every
        call sends each row's whole history (the runner keeps no state of ours), so the next call scores the prompt
        with its new tokens anyway."""
        import torch

        tokens = np.asarray(tokens, dtype=np.int64)
        if not score:
            self._append(cache, tokens, valid)
            return None
        valid = np.ones_like(tokens) if valid is None else np.asarray(valid, dtype=np.int64)
        batch, width = tokens.shape
        histories = cache.extra["tokens"]
        new = [[int(t) for t, v in zip(tokens[b], valid[b]) if v] for b in range(batch)]
        rows = [b for b in range(batch) if new[b]]
        logits = np.zeros((batch, 1 if last else width, self.vocab_size), np.float32)
        if rows:
            inputs = [torch.tensor(histories[b] + new[b], dtype=torch.int32) for b in rows]
            # max_new_tokens=1: a context pass; return_dict=True gives "context_logits" (per request
            # [input_len, vocab] when the engine gathers context logits). With block reuse, only the rows after the
            # reused prefix may be returned, so the new positions are read from the end.
            out = self.runner.generate(
                inputs, max_new_tokens=1, end_id=self.end_id, pad_id=self.pad_id, return_dict=True
            )
            context = out["context_logits"]
            for i, b in enumerate(rows):
                if last:
                    logits[b, 0] = _to_numpy(context[i][-1:])[0, : self.vocab_size]
                else:
                    rows_logits = _to_numpy(context[i])[-len(new[b]) :, : self.vocab_size]
                    logits[b, np.flatnonzero(valid[b])] = rows_logits
        self._append(cache, tokens, valid)
        return logits

    def _append(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None) -> None:
        """Each row's valid tokens joined to its history; mask, lengths and the call count follow."""
        valid = np.ones_like(tokens) if valid is None else np.asarray(valid, dtype=np.int64)
        for b, history in enumerate(cache.extra["tokens"]):
            history.extend(int(t) for t, v in zip(tokens[b], valid[b]) if v)
        cache.mask = np.concatenate([cache.mask, valid], axis=1)
        cache.lengths = cache.lengths + valid.sum(axis=1)
        cache.calls += 1

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        for b, history in enumerate(cache.extra["tokens"]):
            del history[int(keep[b]) :]
        cache.lengths = np.minimum(cache.lengths, keep)
        cache.mask = (np.arange(cache.slots)[None, :] < cache.lengths[:, None]).astype(np.int64)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        tokens = [list(cache.extra["tokens"][int(r)]) for r in rows]
        lengths = cache.lengths[rows]
        width = int(lengths.max()) if len(rows) else 0
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return KVCache([], mask, lengths.copy(), cache.calls, extra={"tokens": tokens})

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        tokens = [list(t) for t in cache.extra["tokens"] + other.extra["tokens"]]
        lengths = np.concatenate([cache.lengths, other.lengths])
        width = int(lengths.max()) if len(lengths) else 0
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return KVCache([], mask, lengths, cache.calls, extra={"tokens": tokens})


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


# --- any bundle -----------------------------------------------------------------------------------------------------


def default_devices(manifest: Manifest) -> list[int]:
    """GPUs 0 .. tp*pp-1: one per rank of the engine (draft and target share them by default, as the draft-target
    guide recommends when both fit on the same GPUs)."""
    return list(range(manifest.spec.tp_size * manifest.spec.pp_size))


def open_generator(
    path: str | os.PathLike,
    threads: int = 0,
    verify: bool = True,
    target_devices: list[int] | None = None,
    draft_devices: list[int] | None = None,
):
    """SpeculativeGenerator for onnxruntime bundles, ExternalDraftGenerator for engine-flavor bundles,
    LlmApiGenerator for llmapi bundles.

    target_devices / draft_devices (engine flavor): the GPU of each rank (tp x pp ids each; default
    ``default_devices``), passed as ModelRunnerCpp ``device_ids`` in orchestrator mode.
    """
    from runtime.api import SpeculativeGenerator
    from runtime.core.loaded import load_tokenizer

    root = Path(path)
    # which loader: each verifies the files it loads as it loads them (from the bytes it hashed, where it can), so
    # no file is swapped in between a check here and a load there
    manifest = load_manifest(root, verify=False)
    if manifest.spec.backend == "onnxruntime":
        return SpeculativeGenerator.from_bundle(root, threads=threads, verify=verify)
    if manifest.spec.trtllm_flavor == "llmapi":
        return LlmApiGenerator.from_bundle(root, verify=verify)
    if verify:  # ModelRunnerCpp reads its engine folders itself
        verify_files(root, manifest)
    world = manifest.spec.tp_size * manifest.spec.pp_size
    devices = {
        "target": list(target_devices or default_devices(manifest)),
        "draft": list(draft_devices or default_devices(manifest)),
    }
    for role, ids in devices.items():
        if len(ids) != world or len(set(ids)) != len(ids) or any(not isinstance(d, int) or d < 0 for d in ids):
            raise BundleError(
                f"{role}_devices: expected {world} distinct GPU ids (tp_size x pp_size of the engine), received {ids}"
            )
    tokenizer = load_tokenizer(root, manifest, verify)  # from the bytes it checked
    eos = manifest.eos_token_ids[0] if manifest.eos_token_ids else 0
    sessions = {
        entry.role: ExecutorSession(
            open_runner(root / entry.engine, manifest.spec.max_batch_size, devices=devices[entry.role]),
            end_id=eos,
            pad_id=eos,
        )
        for entry in (manifest.target, manifest.draft)
    }
    return ExternalDraftGenerator(manifest, sessions["target"], sessions["draft"], tokenizer, manifest.eos_token_ids)
