"""OpenVINO GenAI as a peer (``openvino-genai``): its ``LLMPipeline`` reads the bundle's GGUF source file directly
(its own GGUF reader, no conversion), plain greedy decoding and its prompt-lookup speculative decoding.

Its draft-model mode (``openvino_genai.draft_model``) takes a second model in OpenVINO's own format or a GGUF file;
a Draftsmith draft is neither (an ONNX graph, and a feature draft reads the target's hidden states), so there is no
OpenVINO row with a draft model. Prompt lookup runs at two settings, the bench's best k for the workload and the
setting OpenVINO's own sample uses (5 tokens, 3-grams), so the peer's best mode is in the table.

Install: ``pip install --no-deps openvino openvino-genai openvino-tokenizers openvino-telemetry`` (2026.4 is what
was measured; ``--no-deps`` keeps numpy < 2 for the tritonserver tests).
"""

from __future__ import annotations

import importlib.util
from typing import Callable

from bench.peers.common import PeerError, locate_checkpoint, skip, timed_rows
from runtime.bundle import Manifest

INSTALL = "pip install --no-deps openvino openvino-genai openvino-tokenizers openvino-telemetry (2026.4 was measured)"
SAMPLE_LOOKUP = (5, 3)  # num_assistant_tokens, max_ngram_size of OpenVINO GenAI's prompt-lookup sample


def run_openvino(
    manifest: Manifest,
    bundle,
    workloads: dict[str, list[list[int]]],
    best_k: dict[str, int],
    max_new_tokens: int,
    threads: int,
    eos_ids: tuple[int, ...] = (),
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """OpenVINO GenAI on the GGUF file the target was built from: plain greedy decoding and prompt lookup (at the
    bench's best k with 2-grams, and at its sample's 5 tokens with 3-grams), on the same prompt token ids."""
    if not manifest.spec.target.endswith(".gguf"):
        return [skip("openvino", "the bundle's target is not a GGUF file (OpenVINO GenAI reads GGUF directly)")]
    if importlib.util.find_spec("openvino_genai") is None:
        return [skip("openvino", f"openvino_genai is not installed ({INSTALL})")]
    try:
        import openvino_genai

        checkpoint = locate_checkpoint(manifest.target, bundle)
        path = str(checkpoint.folder / checkpoint.gguf_file)
        properties = {"INFERENCE_NUM_THREADS": threads} if threads else {}
        plain = openvino_genai.LLMPipeline(path, "CPU", **properties)
        lookup = openvino_genai.LLMPipeline(path, "CPU", prompt_lookup=True, **properties)
    except (PeerError, ImportError, RuntimeError) as err:
        return [skip("openvino", str(err))]
    rows = []
    for workload, prompts in workloads.items():
        k = best_k.get(workload) or manifest.default_k
        settings = list(dict.fromkeys([(k, 2), SAMPLE_LOOKUP]))
        modes = {"plain": _generate(plain, max_new_tokens, eos_ids)}
        modes.update({_lookup_mode(s): _generate(lookup, max_new_tokens, eos_ids, s) for s in settings})
        extra = {_lookup_mode(s): {"k": s[0], "max_ngram_size": s[1]} for s in settings}
        rows += timed_rows("openvino", workload, prompts, modes, k, progress, **extra)
    return rows


def _lookup_mode(setting: tuple[int, int]) -> str:
    return f"prompt-lookup k={setting[0]} n={setting[1]}"


def _generate(pipeline, max_new_tokens: int, eos_ids, lookup: tuple[int, int] | None = None):
    """Greedy new ids from ``pipeline.generate`` on token ids (``TokenizedInputs``), stopping at the file's EOS or
    at the limit (as our decoding and the other peers do)."""
    import numpy as np
    import openvino
    import openvino_genai

    config = pipeline.get_generation_config()
    config.max_new_tokens, config.do_sample = max_new_tokens, False
    if eos_ids:
        config.stop_token_ids = set(int(e) for e in eos_ids)
    if lookup is not None:
        config.num_assistant_tokens, config.max_ngram_size = lookup

    def generate(ids):
        array = np.asarray([ids], dtype=np.int64)
        inputs = openvino_genai.TokenizedInputs(openvino.Tensor(array), openvino.Tensor(np.ones_like(array)))
        return [int(t) for t in pipeline.generate(inputs, config).tokens[0]][:max_new_tokens]

    return generate
