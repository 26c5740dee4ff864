"""Triton Python model ``postprocessing``: token ids -> text, for clients that run the token path themselves.

Input ``output_ids`` INT32 [-1] (batch dimension first); output ``text_output`` STRING [-1]. Not a step of the
``ensemble``: ``speculative`` emits text itself, because incremental detokenization and stop strings need state that
spans the steps of a stream (see ``triton_repo.generate``). Parameters: ``tokenizer`` (a folder, relative to this
model's folder or absolute) and ``max_output_ids`` (the most ids a row may carry: the bundle's context; more are
refused before any is decoded). A bad request gets its own error; the rest of the batch is served.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class RequestInvalid(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        from runtime.core.loaded import bundle_tokenizer

        config = json.loads(args["model_config"])
        parameters = config["parameters"]
        folder = Path(parameters["tokenizer"]["string_value"])
        if not folder.is_absolute():
            folder = Path(args.get("model_repository") or Path(__file__).resolve().parents[1]) / folder
        self.tokenizer = bundle_tokenizer(folder)  # its files' verified bytes
        self.vocab_size = self.tokenizer.vocab_size
        try:
            self.max_output_ids = int(parameters["max_output_ids"]["string_value"])
        except KeyError:
            raise ValueError("model config has no parameter 'max_output_ids'; regenerate the repository") from None

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts = self._decode(request)
            except Exception as err:  # noqa: BLE001 - one request's failure never fails its batch
                message = str(err) if isinstance(err, RequestInvalid) else f"{type(err).__name__}: {err}"
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message)))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", np.array(texts, dtype=np.object_))]
                )
            )
        return responses

    def _decode(self, request) -> list[list[bytes]]:
        tensor = pb_utils.get_input_tensor_by_name(request, "output_ids")
        if tensor is None:
            raise RequestInvalid("input 'output_ids' is required")
        ids = tensor.as_numpy()
        rows = ids.reshape(ids.shape[0], -1) if ids.ndim > 1 else ids.reshape(1, -1)
        if rows.shape[1] > self.max_output_ids:
            raise RequestInvalid(
                f"input 'output_ids' has {rows.shape[1]} ids per row; this server's limit is "
                f"max_output_ids={self.max_output_ids} (the model's context)"
            )
        if rows.size and (rows.min() < 0 or rows.max() >= self.vocab_size):
            raise RequestInvalid(f"input 'output_ids': expected token ids in [0, {self.vocab_size})")
        return [[self.tokenizer.decode([int(i) for i in row]).encode("utf-8")] for row in rows]
