"""What both TensorRT-LLM runtime adapters share: the decoding-type spelling and the lazy import of tensorrt_llm."""

from __future__ import annotations

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
        raise TrtllmUnavailable(
            f"this bundle needs TensorRT-LLM, which is not importable here ({err}): {INSTALL_HINT}"
        ) from None
    return tensorrt_llm
