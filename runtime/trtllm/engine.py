"""Runtime adapter for engine-flavor tensorrt_llm bundles (target/engine and draft/engine). tensorrt_llm is imported
lazily: this module loads without it.

The two compiled engines sit behind the runtime's engine contract (runtime/engines/base.py) as ``ExecutorEngine``s,
engines that return tokens, and the one scheduler (runtime/core/scheduler.py) decodes them as it decodes an ONNX
Runtime pair: each step, the draft engine proposes k greedy tokens (runtime/drafters/tokens.py) and the target engine
verifies them itself in one request carrying them as ``ExternalDraftTokensConfig``, the way TensorRT-LLM supports
draft-target decoding for ``draft_tokens_external`` engines. The target returns the accepted draft tokens plus its
own next token, so the output is the target's greedy output by construction. Both engines open as upstream's
draft-target runner opens them (examples/ngram/run_dtm_ngram.py): ModelRunnerCpp in orchestrator mode with
``device_ids``, so a TP/PP > 1 engine runs from one process, and with KV-cache block reuse on (the target refuses to
load without it, and it is what spares a row's history, sent whole with each request, a second prefill). Neither
returns per-position logits: ``trtllm-build`` refuses ``--gather_context_logits`` with ``--max_draft_len > 0``
(tests/fixtures/trtllm/trtllm_build.json); so greedy only, and the front door refuses sampled requests.

LLM-API flavor (bundles with llm_api.yaml): runtime/trtllm/llmapi.py, where the executor speculates inside itself.
``open_generator(bundle)`` opens any bundle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.bundle import BundleError, Manifest, load_manifest, verify_files
from runtime.core.loaded import load_tokenizer
from runtime.engines.tokens import TokenEngine
from runtime.trtllm.common import require_tensorrt_llm
from runtime.trtllm.llmapi import open_llm_api

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


class ExecutorEngine(TokenEngine):
    """One engine-flavor engine under the runtime's contract (runtime/engines/base.py): its calls return the tokens
    the executor decodes (an ``ExecutorSession``: ``generate(histories, max_tokens, drafts)``).

    The target (``verifies``) checks a step's draft tokens itself in the same request, as a ``draft_tokens_external``
    engine does (``ExternalDraftTokensConfig``; Triton's ``tensorrt_llm_bls`` sends them as ``draft_input_ids``): it
    returns the accepted ones plus its own next token, at most ``len(draft) + 1``. The draft decodes a row's k greedy
    tokens in one request (runtime/drafters/tokens.py). Greedy only (``samples`` False): the session samples with
    ``top_k=1``. Sampling stays refused here because the executor's check of external draft tokens sent without
    draft logits is not exact under sampling: cpp/tensorrt_llm/kernels/speculativeDecoding/
    externalDraftTokensKernels.cu (stored commit 04a2cacb) accepts a draft token where it equals the target's own
    token and, at a rejection, samples the next token afresh from the target's distribution, unchanged, so the
    draft token can come out again: its probability exceeds the target's. Exact acceptance needs the draft's
    logits, which these engines do not give (``--gather_context_logits`` is refused with a draft length).
    """

    def __init__(self, session, *, vocab_size: int, max_context: int, verifies: bool):
        super().__init__(vocab_size=vocab_size, max_context=max_context)
        self.session = session
        self.speculation = "verifies" if verifies else ""

    def emit(
        self, inputs: list[list[int]], drafts: list[list[int]], room: list[int], sampling: list
    ) -> list[list[int]]:
        """The target: each draft cut to its row's room but one (the executor returns at most the draft and one
        token), max_tokens its length + 1; the draft: ``room`` greedy tokens."""
        if not self.speculation:
            return self.session.generate(inputs, list(room), drafts)
        drafts = [d[: r - 1] for d, r in zip(drafts, room)]
        return self.session.generate(inputs, [len(d) + 1 for d in drafts], drafts)


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
    """A SpeculativeGenerator for any bundle: an onnxruntime bundle's ONNX Runtime engines, an engine-flavor
    bundle's two executors (``ExecutorEngine``), an llmapi bundle's LLM (runtime/trtllm/llmapi.py); the one
    scheduler decodes them all.

    target_devices / draft_devices (engine flavor): the GPU of each rank (tp x pp ids each; default
    ``default_devices``), passed as ModelRunnerCpp ``device_ids`` in orchestrator mode.
    """
    from runtime.api import SpeculativeGenerator

    root = Path(path)
    # which loader: each verifies the files it loads as it loads them (from the bytes it hashed, where it can), so
    # no file is swapped in between a check here and a load there
    manifest = load_manifest(root, verify=False)
    if manifest.spec.backend == "onnxruntime":
        return SpeculativeGenerator.from_bundle(root, threads=threads, verify=verify)
    if manifest.spec.trtllm_flavor == "llmapi":
        return open_llm_api(root, verify=verify)
    if verify:  # ModelRunnerCpp reads its engine folders itself
        verify_files(root, manifest)
    devices = placed_devices(manifest, target_devices, draft_devices)
    tokenizer = load_tokenizer(root, manifest, verify)  # from the bytes it checked
    eos = manifest.eos_token_ids[0] if manifest.eos_token_ids else 0
    engines = {
        entry.role: ExecutorEngine(
            ExecutorSession(
                open_runner(root / entry.engine, manifest.spec.max_batch_size, devices=devices[entry.role]),
                end_id=eos,
                pad_id=eos,
            ),
            vocab_size=tokenizer.vocab_size,
            max_context=manifest.max_context,
            verifies=entry.role == "target",
        )
        for entry in (manifest.target, manifest.draft)
    }
    return SpeculativeGenerator(manifest, engines["target"], engines["draft"], tokenizer, manifest.eos_token_ids)


def placed_devices(
    manifest: Manifest, target_devices: list[int] | None, draft_devices: list[int] | None
) -> dict[str, list[int]]:
    """Each engine's GPU ids (tp x pp distinct ones; ``default_devices`` where none are given), or BundleError."""
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
    return devices
