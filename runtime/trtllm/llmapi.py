"""Runtime adapter for llmapi-flavor tensorrt_llm bundles: the llm_api.yaml allow-list and ``LlmApiEngine``.

``LlmApiEngine`` runs ``LLM(target, speculative_config=DraftTargetDecodingConfig(max_draft_len=K,
speculative_model=draft))`` behind the runtime's engine contract, as an engine that speculates inside its calls,
decoded by the one scheduler (runtime/core/scheduler.py) in one-call steps; TensorRT-LLM drafts and verifies
internally, on as many GPUs as the yaml's tensor/pipeline parallel sizes ask for (the LLM API starts its own
workers). The bundle's llm_api.yaml is data from outside: only the keys in ``LLM_API_KEYS`` pass (never
``trust_remote_code`` or anything that loads code), and every path must stay inside the bundle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.bundle import BundleError, Manifest, load_manifest, read_verified
from runtime.core.loaded import load_tokenizer
from runtime.engines.tokens import TokenEngine
from runtime.trtllm.common import require_tensorrt_llm


# Keys a bundle's llm_api.yaml may set, each with its check. Anything else is refused, by name: in particular
# trust_remote_code (consent comes from the person running the command, never from a file), and keys that load code
# or point outside the bundle (backend, checkpoint_loader, kv_connector_config, logits_post_processors, ...).
# Names: tensorrt_llm/llmapi/llm_args.py (BaseLlmArgs / TorchLlmArgs).
LLM_API_KEYS = {
    "model": "path",
    "tokenizer": "path",
    "dtype": ("float16", "bfloat16"),
    "tensor_parallel_size": "count",
    "pipeline_parallel_size": "count",
    "max_batch_size": "count",
    "max_seq_len": "count",
    "disable_overlap_scheduler": "bool",
    "kv_cache_config": "nested",
    "speculative_config": "nested",
}
# KvCacheConfig fields a bundle may set (tensorrt_llm/llmapi/llm_args.py: enable_block_reuse, max_tokens,
# free_gpu_memory_fraction in [0, 1], dtype "auto" or a KV-cache type such as "fp8", "only for the Pytorch backend").
KV_CACHE_KEYS = {
    "enable_block_reuse": "bool",
    "max_tokens": "count",
    "free_gpu_memory_fraction": "fraction",
    "dtype": ("auto", "fp8"),
}
# decoding_type: "DraftTarget" (what builds write; DecodingBaseConfig.from_dict's key in 1.0-1.2) or
# "Draft_Target" (bundles written before that fix); the runtime builds DraftTargetDecodingConfig itself.
SPECULATIVE_KEYS = {
    "decoding_type": ("DraftTarget", "Draft_Target"),
    "max_draft_len": "count",
    "speculative_model": "path",
}
LLM_API_REQUIRED = ("model", "tokenizer", "speculative_config")


def llm_api_kwargs(root: Path, manifest: Manifest) -> dict[str, Any]:
    """The bundle's llm_api.yaml, checked against the allow-list, with paths resolved inside the bundle.

    Raises BundleError naming every key or value that is refused.
    """
    import yaml

    root = Path(root).resolve()
    text = read_verified(root, manifest, "llm_api.yaml").decode("utf-8", errors="replace")  # the bytes hashed
    try:
        data = yaml.safe_load(text)
    except (OSError, yaml.YAMLError, RecursionError) as err:
        raise BundleError(f"{root}/llm_api.yaml cannot be read ({err}); rebuild the bundle") from None
    problems: list[str] = []
    kwargs = _checked(data, LLM_API_KEYS, LLM_API_REQUIRED, root, "", problems)
    if isinstance(data, dict) and "speculative_config" in data:
        kwargs["speculative_config"] = _checked(
            data["speculative_config"], SPECULATIVE_KEYS, tuple(SPECULATIVE_KEYS), root, "speculative_config.", problems
        )
    if isinstance(data, dict) and "kv_cache_config" in data:
        kwargs["kv_cache_config"] = _checked(
            data["kv_cache_config"], KV_CACHE_KEYS, (), root, "kv_cache_config.", problems
        )
    if problems:
        raise BundleError(
            f"{root}/llm_api.yaml is refused; rebuild the bundle with build-engines:\n  " + "\n  ".join(problems)
        )
    return kwargs


def _checked(
    data: Any, allowed: dict[str, Any], required: tuple[str, ...], root: Path, where: str, problems: list[str]
) -> dict[str, Any]:
    if not isinstance(data, dict):
        problems.append(f"{where.rstrip('.') or 'the file'}: expected a mapping, received {type(data).__name__}")
        return {}
    checked: dict[str, Any] = {}
    for key, value in data.items():
        rule = allowed.get(key)
        if rule is None:
            problems.append(
                f"{where}{key}: not a key a bundle may set (allowed: {', '.join(allowed)})"
                + (
                    "; trust_remote_code is granted only by the person running the command"
                    if key == "trust_remote_code"
                    else ""
                )
            )
        elif rule != "nested":
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
    if rule == "fraction":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
        return (True, value) if ok else (False, "expected a number in [0, 1]")
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


class LlmApiEngine(TokenEngine):
    """An llmapi bundle's ``LLM`` under the runtime's engine contract (runtime/engines/base.py): with a speculative
    config its executor drafts and verifies inside each call (``speculation`` "internal"), so the scheduler drives
    it as one-call steps: each asks for up to ``step_tokens`` tokens a row and takes what the executor accepted.

    Every call sends each row's whole history as token ids, which the KV cache's block reuse spares a second
    prefill: tensorrt_llm/llmapi/llm.py (stored commit 00966934) ``LLM.generate(inputs: PromptInputs |
    Sequence[PromptInputs], sampling_params: SamplingParams | List[SamplingParams] | None, use_tqdm: bool = True,
    ...)``, where a list of ints is a prompt of token ids (``PromptInputs``; upstream's tests/hlapi/run_llm.py
    passes ``[prompt_token_ids]``) and a list of SamplingParams gives each input its own; each RequestOutput's
    ``outputs[0].token_ids`` are the tokens generated.

    Each row is decoded as it asks (``samples``): greedy rows as they always were (``temperature=0.0``), sampled
    rows with their temperature, top-k, top-p and a seed of this call (``llm_sampling_params``). How a sampled row's
    speculation stays exact is TensorRT-LLM's own, not ours: its executor drafts, verifies and samples inside the
    call (tensorrt_llm/_torch/pyexecutor/sampler.py ``process_draft_tokens``, stored versions: rejection sampling
    where the drafter gives draft logits, else the draft matched against the target's own samples), and nothing of
    it is checked here."""

    samples = True

    def __init__(self, llm, *, vocab_size: int, max_context: int, step_tokens: int, speculative: bool = True):
        super().__init__(vocab_size=vocab_size, max_context=max_context)
        self.llm, self.step_tokens = llm, step_tokens
        self.speculation = "internal" if speculative else ""

    def emit(
        self, inputs: list[list[int]], drafts: list[list[int]], room: list[int], sampling: list
    ) -> list[list[int]]:
        params = [llm_sampling_params(min(r, self.step_tokens), s) for r, s in zip(room, sampling)]
        # RequestOutput: outputs[0] is a CompletionOutput whose token_ids are the tokens generated
        return [list(output.outputs[0].token_ids) for output in self.llm.generate(inputs, params, use_tqdm=False)]


def llm_sampling_params(max_tokens: int, sampling):
    """``tensorrt_llm.SamplingParams`` for one row of one call (``sampling``: its ``RowSampling``; None: greedy).

    tensorrt_llm/sampling_params.py ``SamplingParams`` (dataclass, keyword-only; read at 1.0.0rc4, commit 000a01de,
    and a later stored version with ``params_imply_greedy_decoding``): ``max_tokens``, ``temperature``, ``top_k``,
    ``top_p``, ``seed`` (Optional[int], "the random seed used by the random number generator in sampling"). Which
    values sample differs between them: in the later one, neither temperature, top_k nor top_p set is greedy, and
    temperature 0, top_k 1 or top_p 0 is greedy; in 1.0.0rc4 an unset top_k and top_p are the C++ runtime's
    defaults, 0 and 0, which its ``regularizeTopKTopP`` (cpp/tensorrt_llm/kernels/samplingTopKKernels.h, stored
    commit e41b05cd) turns into top_k 1, greedy whatever the temperature. So a sampled row sets all three: top_k 0
    ("all logits") for no top-k, top_p 1.0 for no nucleus, and its temperature (> 0), which both sample from."""
    from tensorrt_llm import SamplingParams

    if sampling is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params = sampling.params
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(params.temperature),
        top_k=int(params.top_k or 0),
        top_p=1.0 if params.top_p is None else float(params.top_p),
        seed=int(sampling.seed),
    )


def open_llm_api(path: str | os.PathLike, verify: bool = True, speculative: bool = True, **overrides):
    """A SpeculativeGenerator over an llmapi bundle's LLM (``LlmApiEngine``; no draft engine of ours: the
    executor drafts). speculative=False: the same target without a draft (the baseline). overrides: LLM keywords
    from the caller (the person running the command, e.g. ``kv_cache_config``), never from the bundle."""
    from runtime.api import SpeculativeGenerator

    root = Path(path)
    manifest = load_manifest(root, verify=verify)
    kwargs = llm_api_kwargs(root, manifest)
    tokenizer = load_tokenizer(root, manifest, verify)
    step = kwargs["speculative_config"]["max_draft_len"] + 1  # one executor step's most tokens
    engine = LlmApiEngine(
        open_llm(kwargs, speculative, overrides),
        vocab_size=tokenizer.vocab_size,
        max_context=manifest.max_context,
        step_tokens=step,
        speculative=speculative,
    )
    return SpeculativeGenerator(manifest, engine, None, tokenizer, manifest.eos_token_ids)


def open_llm(kwargs: dict[str, Any], speculative: bool, overrides: dict[str, Any]):
    """``LLM(target, speculative_config=DraftTargetDecodingConfig(...))`` from the checked llm_api.yaml keywords."""
    require_tensorrt_llm()
    from tensorrt_llm import LLM

    options = kwargs.pop("speculative_config")
    if speculative:
        kwargs["speculative_config"] = draft_target_config(options)
    if "kv_cache_config" in kwargs:  # checked keys only (KV_CACHE_KEYS); LLM takes a KvCacheConfig
        from tensorrt_llm.llmapi import KvCacheConfig

        kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
    # trust_remote_code is never taken from the bundle (llm_api_kwargs refuses it); say False explicitly.
    return LLM(**{**kwargs, **overrides, "trust_remote_code": False})
