"""Triton Python model ``postprocessing``: token ids -> text, for clients that run the token path themselves.

Input ``output_ids`` INT32 [-1] (batch dimension first); output ``text_output`` STRING [-1]. Not a step of the
``ensemble``: ``speculative`` emits text itself, because incremental detokenization and stop strings need state that
spans the steps of a stream (see ``triton_repo.generate``). Parameter ``tokenizer``: a folder, relative to this
model's folder or absolute.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        from runtime.text import Tokenizer
        config = json.loads(args["model_config"])
        folder = Path(config["parameters"]["tokenizer"]["string_value"])
        if not folder.is_absolute():
            folder = Path(args.get("model_repository") or Path(__file__).resolve().parents[1]) / folder
        self.tokenizer = Tokenizer(folder)
        self.vocab_size = self.tokenizer.vocab_size

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            rows = ids.reshape(ids.shape[0], -1) if ids.ndim > 1 else ids.reshape(1, -1)
            if rows.size and (rows.min() < 0 or rows.max() >= self.vocab_size):
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"input 'output_ids': expected token ids in [0, {self.vocab_size})")))
                continue
            texts = [[self.tokenizer.decode([int(i) for i in row]).encode("utf-8")] for row in rows]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array(texts, dtype=np.object_))]))
        return responses
