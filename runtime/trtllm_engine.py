"""Runtime adapter for tensorrt_llm bundles. tensorrt_llm is imported lazily: this module loads without it.

Engine flavor (bundles with target/engine and draft/engine):
    ``ExternalDraftGenerator`` runs draft-target speculative decoding the way TensorRT-LLM supports it for
    ``draft_tokens_external`` engines: the draft engine proposes k tokens (greedy), and the target engine verifies
    them itself in one request carrying them as ``ExternalDraftTokensConfig`` (what Triton's ``tensorrt_llm_bls``
    sends as ``draft_input_ids``). The target returns the accepted draft tokens plus its own next token, so the
    output is the target's greedy output by construction. It cannot return per-position logits: ``trtllm-build``
    refuses ``--gather_context_logits`` with ``--max_draft_len > 0`` (tests/fixtures/trtllm/trtllm_build.json), which
    is why this flavor does not drive ``SpeculativeGenerator`` (that needs target logits for every appended
    position). Greedy only; sampled requests are refused with the reason.
    ``RunnerEngine`` remains the runtime's Engine protocol over a ModelRunnerCpp-like runner, for engines built
    without a draft length and with ``--gather_context_logits`` (tests/test_engine_contract.py checks it).

LLM-API flavor (bundles with llm_api.yaml):
    ``LlmApiGenerator`` runs ``LLM(target, speculative_config=DraftTargetDecodingConfig(max_draft_len=K,
    speculative_model=draft))``; TensorRT-LLM drafts and verifies internally. Its ``generate`` takes the same
    arguments and returns the same ``Generation`` objects as ``SpeculativeGenerator.generate`` for the subset the
    LLM API exposes (greedy or sampled with temperature/top_k/top_p/seed; no per-request k, no draft statistics).
    The bundle's llm_api.yaml is data from outside: only the keys in ``LLM_API_KEYS`` pass (never
    ``trust_remote_code`` or anything that loads code), and every path must stay inside the bundle.

``open_generator(bundle)`` picks the right one for any bundle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime.bundle import BundleError, Manifest, load_manifest
from runtime.engine import KVCache

# speculative_config.decoding_type as written into llm_api.yaml and Triton's model.yaml: the key
# DecodingBaseConfig.from_dict accepts in 1.0-1.2 ("Draft_Target" raises "Invalid decoding type" there), and a YAML
# spelling current main accepts too (tests/fixtures/trtllm/decoding_types.json).
DECODING_TYPE = "DraftTarget"
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

def open_runner(engine_dir: Path, max_batch_size: int | None = None, kv_fraction: float = 0.4,
                block_reuse: bool = True):
    """ModelRunnerCpp for one engine (tensorrt_llm/runtime/model_runner_cpp.py: from_dir keywords).

    block_reuse: KV-cache block reuse lets a request that repeats a row's history skip recomputing it; it can change
    logits by about one BF16 ULP (TensorRT-LLM issue 15503), so exact greedy comparisons turn it off.
    """
    require_tensorrt_llm()
    from tensorrt_llm.runtime import ModelRunnerCpp
    kwargs: dict[str, Any] = dict(engine_dir=str(engine_dir), kv_cache_enable_block_reuse=block_reuse,
                                  kv_cache_free_gpu_memory_fraction=kv_fraction)
    if max_batch_size:
        kwargs["max_batch_size"] = max_batch_size
    return ModelRunnerCpp.from_dir(**kwargs)


class ExecutorSession:
    """Greedy requests on one engine through the executor that ModelRunnerCpp holds (``runner.session``).

    What ModelRunnerCpp.generate itself does with ``draft_tokens_list`` (tensorrt_llm/runtime/model_runner_cpp.py,
    "Draft-Target-Model speculative decoding"), per row instead of one max_new_tokens for the batch: one
    ``tensorrt_llm.bindings.executor.Request(input_token_ids, max_tokens, pad_id, end_id, sampling_config,
    output_config, external_draft_tokens_config)`` per row, ``session.enqueue_requests``, then
    ``session.await_responses()`` until every ``result.is_final``; tokens in ``result.output_token_ids[0]``.
    Not run here: no GPU.
    """

    def __init__(self, runner, end_id: int, pad_id: int):
        self.runner, self.end_id, self.pad_id = runner, end_id, pad_id

    def generate(self, histories: list[list[int]], max_tokens: list[int],
                 drafts: list[list[int]] | None = None) -> list[list[int]]:
        """New tokens per row (the input excluded); with drafts, the target verifies them in the same request."""
        import tensorrt_llm.bindings.executor as executor
        requests = []
        for row, history in enumerate(histories):
            draft = drafts[row] if drafts else []
            requests.append(executor.Request(
                input_token_ids=list(history), max_tokens=int(max_tokens[row]), end_id=self.end_id,
                pad_id=self.pad_id, sampling_config=executor.SamplingConfig(top_k=1),
                output_config=executor.OutputConfig(exclude_input_from_output=True),
                external_draft_tokens_config=executor.ExternalDraftTokensConfig(draft) if draft else None))
        ids = self.runner.session.enqueue_requests(requests)
        done: dict[int, list[int]] = {}
        while len(done) < len(ids):
            for response in self.runner.session.await_responses():
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

    def generate(self, prompts: str | list[str], max_new_tokens: int = 128, temperature: float = 0.0,
                 k: int | None = None, chat: bool = False, mode: str = "speculative", **unsupported):
        """SpeculativeGenerator.generate's call and result types, greedy; mode "target" drafts nothing."""
        from runtime.api import Generation
        from runtime.errors import RequestError
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, received {max_new_tokens!r}")
        given = sorted(key for key, value in unsupported.items() if value not in (None, False, 0, 0.0))
        if temperature or given:
            raise RequestError("engine-flavor TensorRT-LLM bundles generate greedily in-process (the target verifies "
                               f"draft tokens itself); not supported here: {given or ['temperature > 0']}. "
                               "Serve the bundle with Triton or build the llmapi flavor for sampling.")
        k = self.default_k if k is None else k
        if mode not in ("speculative", "target") or not 1 <= k <= self.max_k:
            raise RequestError(f"mode must be 'speculative' or 'target' and k in [1, {self.max_k}], received "
                               f"{mode!r}, {k!r}")
        single = isinstance(prompts, str)
        rows = [_Row(self._encode(p, chat), max_new_tokens) for p in ([prompts] if single else list(prompts))]
        while any(not row.finished for row in rows):
            self._step([row for row in rows if not row.finished], 0 if mode == "target" else k)
        results = [Generation(self.tokenizer.decode(row.generated), list(row.generated), len(row.prompt),
                              row.finished, row.stats) for row in rows]
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
        room = [min(row.budget - len(row.generated), self.max_context - len(row.prompt) - len(row.generated))
                for row in rows]
        lengths = [max(0, min(k, r - 1)) for r in room]
        histories = [row.prompt + row.generated for row in rows]
        drafts = [[] for _ in rows]
        drafting = [i for i, n in enumerate(lengths) if n]
        if drafting:
            proposed = self.draft.generate([histories[i] for i in drafting], [lengths[i] for i in drafting])
            for i, tokens in zip(drafting, proposed):
                drafts[i] = list(tokens[:lengths[i]])
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
            new = new[:stop + 1]
        self.stats.record_step(len(draft), min(accepted, len(new)), len(new), False)
        self.generated.extend(new)
        if stop is not None:
            self.finished = "stop"
        elif not new or len(new) >= room:
            self.finished = "length"
        self.stats.finish_reason = self.finished


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


# --- LLM-API flavor -------------------------------------------------------------------------------------------------

# Keys a bundle's llm_api.yaml may set, each with its check. Anything else is refused, by name: in particular
# trust_remote_code (consent comes from the person running the command, never from a file), and keys that load code
# or point outside the bundle (backend, checkpoint_loader, kv_connector_config, logits_post_processors, ...).
# Names: tensorrt_llm/llmapi/llm_args.py (BaseLlmArgs / TorchLlmArgs).
LLM_API_PATHS = ("model", "tokenizer")
LLM_API_KEYS = {
    "model": "path", "tokenizer": "path", "dtype": ("float16", "bfloat16"), "tensor_parallel_size": "count",
    "pipeline_parallel_size": "count", "max_batch_size": "count", "max_seq_len": "count",
    "disable_overlap_scheduler": "bool", "speculative_config": "speculative",
}
# decoding_type: "DraftTarget" (what builds write; DecodingBaseConfig.from_dict's key in 1.0-1.2) or
# "Draft_Target" (bundles written before that fix); the runtime builds DraftTargetDecodingConfig itself.
SPECULATIVE_KEYS = {"decoding_type": ("DraftTarget", "Draft_Target"), "max_draft_len": "count",
                    "speculative_model": "path"}
LLM_API_REQUIRED = ("model", "tokenizer", "speculative_config")


def llm_api_kwargs(root: Path, manifest: Manifest) -> dict[str, Any]:
    """The bundle's llm_api.yaml, checked against the allow-list, with paths resolved inside the bundle.

    Raises BundleError naming every key or value that is refused.
    """
    import yaml
    root = Path(root).resolve()
    try:
        data = yaml.safe_load((root / "llm_api.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise BundleError(f"{root}/llm_api.yaml cannot be read ({err}); rebuild the bundle") from None
    problems: list[str] = []
    kwargs = _checked(data, LLM_API_KEYS, LLM_API_REQUIRED, root, "", problems)
    if isinstance(data, dict) and "speculative_config" in data:
        kwargs["speculative_config"] = _checked(data["speculative_config"], SPECULATIVE_KEYS,
                                                tuple(SPECULATIVE_KEYS), root, "speculative_config.", problems)
    if problems:
        raise BundleError(f"{root}/llm_api.yaml is refused; rebuild the bundle with build-engines:\n  "
                          + "\n  ".join(problems))
    return kwargs


def _checked(data: Any, allowed: dict[str, Any], required: tuple[str, ...], root: Path, where: str,
             problems: list[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        problems.append(f"{where.rstrip('.') or 'the file'}: expected a mapping, received {type(data).__name__}")
        return {}
    checked: dict[str, Any] = {}
    for key, value in data.items():
        rule = allowed.get(key)
        if rule is None:
            problems.append(f"{where}{key}: not a key a bundle may set (allowed: {', '.join(allowed)})"
                            + ("; trust_remote_code is granted only by the person running the command"
                               if key == "trust_remote_code" else ""))
        elif rule != "speculative":
            ok, result = _check_value(rule, value, root)
            if ok:
                checked[key] = result
            else:
                problems.append(f"{where}{key}: {result}, received {value!r}")
    problems.extend(f"{where}{key}: missing" for key in required if key not in data)
    return checked


def _check_value(rule: Any, value: Any, root: Path) -> tuple[bool, Any]:
    """(True, the value to use) or (False, what was expected)."""
    if rule == "path":
        return _inside_bundle(value, root)
    if rule == "count":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return (True, value) if ok else (False, "expected an integer >= 1")
    if rule == "bool":
        return (True, value) if isinstance(value, bool) else (False, "expected true or false")
    return (True, value) if value in rule else (False, f"expected one of {list(rule)}")


def _inside_bundle(value: Any, root: Path) -> tuple[bool, Any]:
    if not isinstance(value, str) or not value or Path(value).is_absolute():
        return False, "expected a relative path inside the bundle"
    path = (root / value).resolve()
    try:
        path.relative_to(root)
    except ValueError:
        return False, "expected a path inside the bundle (it resolves outside it)"
    return True, str(path)


def draft_target_config(options: dict[str, Any]):
    """DraftTargetDecodingConfig(max_draft_len=K, speculative_model=draft) for the installed tensorrt_llm.

    tensorrt_llm/llmapi/llm_args.py (tests/fixtures/trtllm/decoding_types.json): current main names the field
    ``speculative_model`` (alias ``speculative_model_dir``) and validates max_draft_len > 0 and a set
    speculative_model; the 1.0-1.2 versions read here name it ``speculative_model_dir`` and validate neither, so
    llm_api_kwargs's checks (max_draft_len >= 1, the draft path inside the bundle) are what guards those releases.
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
    def from_bundle(cls, path: str | os.PathLike, verify: bool = True, speculative: bool = True,
                    **overrides) -> "LlmApiGenerator":
        """speculative=False: the same target without a draft (the baseline). overrides: LLM keywords from the
        caller (the person running the command, e.g. ``kv_cache_config``), never from the bundle."""
        root = Path(path)
        manifest = load_manifest(root, verify=verify)
        kwargs = llm_api_kwargs(root, manifest)
        require_tensorrt_llm()
        from tensorrt_llm import LLM
        options = kwargs.pop("speculative_config")
        if speculative:
            kwargs["speculative_config"] = draft_target_config(options)
        # trust_remote_code is never taken from the bundle (llm_api_kwargs refuses it); say False explicitly.
        return cls(manifest, LLM(**{**kwargs, **overrides, "trust_remote_code": False}), manifest.eos_token_ids)

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

def open_generator(path: str | os.PathLike, threads: int = 0, verify: bool = True, block_reuse: bool = True):
    """SpeculativeGenerator for onnxruntime bundles, ExternalDraftGenerator for engine-flavor bundles,
    LlmApiGenerator for llmapi bundles. block_reuse (engine flavor): KV-cache block reuse (see open_runner)."""
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
    sessions = {entry.role: ExecutorSession(open_runner(root / entry.engine, manifest.spec.max_batch_size,
                                                        block_reuse=block_reuse), end_id=eos, pad_id=eos)
                for entry in (manifest.target, manifest.draft)}
    return ExternalDraftGenerator(manifest, sessions["target"], sessions["draft"], tokenizer, manifest.eos_token_ids)
