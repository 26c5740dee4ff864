"""Stage 2 for a GGUF file: its decoder read one layer at a time, so a build's memory follows one layer, not the model.

Loading a GGUF checkpoint through transformers dequantizes every tensor into an fp32 torch model (2.5 GB for a 0.5B
file of 491 MB, 6.2 GB for a 1.5B), and everything downstream copied it again. Here:

- Every tensor is dequantized and named as transformers' GGUF loader does it, with the functions that loader runs
  (``transformers.modeling_gguf_pytorch_utils``, 5.x: its GGUF -> transformers name map and tensor processors,
  i.e. llama.cpp's q/k row permutation undone, Gemma's norm - 1), but only when needed and one at a time.
- ``Streamed.reference``: the transformers model of the first ``CHECK_LAYERS`` layers with the embedding, final
  norm and head, its weights those tensors (a truncated config; nothing else is read). It is what the fused graph
  is checked against (builder.graph.check_fused_against_torch) and where the rotary tables, scales and the
  embedding/head come from (builder.decoder.from_transformers, as for any transformers model).
- ``Streamed.decoder(layers)``: that Decoder with ``LazyLayers``: layer i is dequantized from the file when the graph
  writer asks for it and dropped once written. The quantized engine maps the same layers onto the file's own blocks
  (builder.gguf.weights).

The check compares the graph of the first layers, made by the same lazy path as every other layer, with the
transformers model of those layers: what it cannot see is a layer-dependent mistake past them, which the build report's
top-1 agreement and perplexity against the fp32 graph (every layer) would show.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from pathlib import Path

import numpy as np

from builder.decoder import Decoder, LazyLayers, attention_of, clean_config, from_transformers, layer_of

CHECK_LAYERS = 2  # layers of the transformers model the fused graph is checked against


def supported(checkpoint, engine_graph: str) -> bool:
    """Whether ``checkpoint`` is read layer by layer: a GGUF file written as the fused graph (the export graph traces
    the whole torch model)."""
    return bool(checkpoint.gguf_file) and engine_graph == "fused"


class Streamed:
    """A GGUF checkpoint as a transformers reference of its first layers plus a Decoder made layer by layer."""

    def __init__(self, checkpoint, context: int | None):
        self.checkpoint, self.context = checkpoint, context
        self.path = Path(checkpoint.folder) / checkpoint.gguf_file
        self.config = checkpoint.config
        self.layers = int(self.config.num_hidden_layers)

    @cached_property
    def reference(self):
        """The transformers model of the first CHECK_LAYERS layers (all of them for a smaller model), fp32, its
        weights the file's tensors (made without initialising weights: they are replaced, never touched)."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        layers = min(CHECK_LAYERS, self.layers)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(
                clean_config(self.config, layers), attn_implementation=self.checkpoint.architecture.attn_implementation
            )
        tensors = self._reader.outside + [t for i in range(layers) for t in self._reader.by_layer.get(i, ())]
        state = {name: torch.from_numpy(weights) for name, weights in map(self._named, tensors) if name}
        missing, _ = model.load_state_dict(state, strict=False, assign=True)
        if model.config.tie_word_embeddings:
            model.tie_weights()
            missing = [m for m in missing if m != "lm_head.weight"]
        if missing:
            raise ValueError(f"{self.path.name}: no tensor for {missing[:4]} (transformers' GGUF names)")
        return model.eval()

    @cached_property
    def _base(self) -> Decoder:
        """The reference's Decoder: rotary tables, scales, embedding, final norm and head for the whole model."""
        return from_transformers(self.reference, self.context)

    def decoder(self, layers: int | None = None) -> Decoder:
        """The Decoder of the first ``layers`` layers (None: all), each made from the file when asked for."""
        base = self._base
        count = self.layers if layers is None else layers
        ropes = [attention_of(self.config, i, base.rotary)[0] for i in range(count)]
        return dataclasses.replace(base, layers=LazyLayers(self._layer, ropes), notes=list(base.notes))

    def _layer(self, i: int):
        return layer_of(
            self._layer_state(i), i, self.checkpoint.architecture, *attention_of(self.config, i, self._base.rotary)
        )

    def _layer_state(self, i: int) -> dict[str, np.ndarray]:
        """Layer ``i``'s tensors under transformers' names, dequantized and processed as its GGUF loader does."""
        state = dict(named for named in map(self._named, self._reader.by_layer.get(i, ())) if named[0])
        if not state:
            raise ValueError(f"{self.path.name}: layer {i} has no tensors transformers can name")
        return state

    def _named(self, tensor) -> tuple[str | None, np.ndarray | None]:
        """(transformers' name, float32 weights) of one GGUF tensor, as its loader makes them; (None, None) for a
        tensor it does not load."""
        import gguf

        weights = gguf.dequantize(self._reader.read(tensor), tensor.tensor_type)
        result = self._processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=self._name_map, parsed_parameters=self._parsed
        )
        name = self._name_map.get(result.name)
        if not name:
            return None, None
        weights = np.asarray(result.weights, np.float32)
        return name, weights if weights.flags.writeable else weights.copy()  # a float32 tensor is the mapped file

    @cached_property
    def _parsed(self) -> dict:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        return load_gguf_checkpoint(str(self.path), return_tensors=False)

    @cached_property
    def _processor(self):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        architecture = self._reader.architecture
        return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self._parsed["config"])

    @cached_property
    def _name_map(self) -> dict[str, str]:
        """{GGUF tensor name: transformers name} for the whole model, from a model on the meta device (no weights)."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(self.config)
        return get_gguf_hf_weights_map(shell, self._processor)

    @cached_property
    def _reader(self) -> "_Reader":
        return _Reader(self.path)


class _Reader:
    """The file's tensors (as the gguf package's reader lists them), grouped by block number; their bytes are read
    when needed (builder.gguf.weights.FileBytes), not through the reader's mapping, whose touched pages would stay
    resident."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        from builder.gguf.weights import FileBytes

        reader = GGUFReader(str(path))
        self.bytes = FileBytes(path)
        field = reader.fields["general.architecture"]
        self.architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        self.by_layer: dict[int, list] = {}
        self.outside: list = []  # the embedding, final norm, head
        for tensor in reader.tensors:
            parts = tensor.name.split(".")
            if parts[0] == "blk" and parts[1].isdigit():
                self.by_layer.setdefault(int(parts[1]), []).append(tensor)
            else:
                self.outside.append(tensor)

    def read(self, tensor) -> np.ndarray:
        """``tensor.data`` as the reader gives it (its dtype and shape), read from the file now."""
        raw = self.bytes[tensor.data_offset : tensor.data_offset + tensor.n_bytes]
        return raw.view(tensor.data.dtype).reshape(tensor.data.shape)
