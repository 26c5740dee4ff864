"""Triton Python model ``preprocessing``: check a request's text and length budget, tokenize the prompt once (the
ensemble passes its ids on to ``speculative``).

Inputs (batch dimension first): ``text_input`` STRING [1] (UTF-8), ``max_tokens`` INT32 [1].
Outputs: ``input_ids`` INT32 [-1], ``input_lengths`` INT32 [1], ``request_output_len`` INT32 [1].
A bad request gets its own error response; the rest of the batch is served. Bounds come before work: the prompt's
size in bytes is checked before it is decoded or tokenized, so a multi-megabyte prompt costs nothing.
Written by ``draftsmith triton-repo``; parameters: ``tokenizer`` (a folder, relative to this model's folder or
absolute), ``max_context``, ``max_tokens_limit``, ``max_prompt_bytes``.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


NAMES = {"prompt": "text_input", "max_new_tokens": "max_tokens"}  # the front door's fields in this model's names


class RequestInvalid(ValueError):
    pass


def _model_dir(args) -> Path:
    return Path(args.get("model_repository") or Path(__file__).resolve().parents[1])


def _param(config: dict, key: str) -> str:
    try:
        return config["parameters"][key]["string_value"]
    except KeyError:
        raise ValueError(f"model config has no parameter {key!r}; regenerate the repository") from None


def _scalar(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise RequestInvalid(f"input {name!r} is required")
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise RequestInvalid(f"input {name!r}: expected one value, received {values.size}")
    return values[0]


def _error(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        from runtime.core.loaded import bundle_tokenizer

        config = json.loads(args["model_config"])
        folder = Path(_param(config, "tokenizer"))
        if not folder.is_absolute():
            folder = _model_dir(args) / folder
        self.tokenizer = bundle_tokenizer(folder)  # its files' verified bytes
        self.max_context = int(_param(config, "max_context"))
        from runtime.core.request import Limits

        self.limits = Limits(int(_param(config, "max_tokens_limit")), int(_param(config, "max_prompt_bytes")))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids, max_tokens = self._prepare(request)
            except RequestInvalid as err:
                responses.append(_error(str(err)))
                continue
            except Exception as err:  # noqa: BLE001 - one request's failure never fails its batch
                responses.append(_error(f"preprocessing failed: {type(err).__name__}: {err}"))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("input_ids", np.asarray([ids], dtype=np.int32)),
                        pb_utils.Tensor("input_lengths", np.asarray([[len(ids)]], dtype=np.int32)),
                        pb_utils.Tensor("request_output_len", np.asarray([[max_tokens]], dtype=np.int32)),
                    ]
                )
            )
        return responses

    def _prepare(self, request):
        """The prompt's ids and the checked max_tokens, through the front door's own checks and words
        (runtime/core/request.py: the OpenAI server's and ``speculative``'s): the size in bytes before the text is
        decoded, then ``prompt_tokens``, the door's tokenizing (valid text, some tokens, room in the context)."""
        from runtime.errors import RequestError
        from runtime.core.request import prompt_tokens, renamed, text_bytes

        raw = _scalar(request, "text_input")
        max_tokens = int(_scalar(request, "max_tokens"))
        try:
            self.limits.check(text_bytes(raw), max_tokens, [])
            ids = prompt_tokens(self.tokenizer, raw, False, self.max_context)
        except RequestError as err:
            raise RequestInvalid(renamed(str(err), NAMES, "input '{}'")) from None
        return ids, max_tokens
