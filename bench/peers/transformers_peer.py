"""transformers as a peer: plain ``generate`` and assisted generation with the bundle's draft (torch, fp32)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
from pathlib import Path
from typing import Callable

from bench.peers.common import (
    PeerError,
    is_feature_draft,
    quiet_transformers,
    self_layers,
    skip,
    target_and_draft,
    timed_rows,
)
from runtime.bundle import Manifest


def transformers_assistant(manifest: Manifest, target, draft_checkpoint=None):
    """The assistant model for transformers' assisted generation, and a sentence saying what it is.

    - a checkpoint draft: that checkpoint (``draft_checkpoint``, located and checked by the caller);
    - ``self:layers=N``: the target's first N layers (shared weights), what the bundle's draft was built from;
    - ``self`` (the target re-quantized for the bundle): the target with its Linear layers dynamically quantized to
      int8 by torch (``quantize_dynamic``): the same weights at lower precision and lower cost, the nearest thing
      transformers runs on CPU to the bundle's int4 MatMulNBits self-draft (a plain fp32 copy would agree on every
      token but cost as much as the target, so it could never speed anything up).
    """
    from builder.model_surgery import truncate

    layers = self_layers(manifest)
    if layers:
        return truncate(target, layers), f"the target's first {layers} layers (as the bundle's draft)"
    if draft_checkpoint is None:
        import warnings
        import torch
        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assistant = quantize_dynamic(copy.deepcopy(target), {torch.nn.Linear}, dtype=torch.qint8)
        return assistant, (
            "the target with torch dynamic int8 Linear layers (stands in for the bundle's int4 "
            "self-draft, which transformers cannot run)"
        )
    return draft_checkpoint.load_model(), f"the draft checkpoint {manifest.spec.draft}"


def run_transformers(
    manifest: Manifest,
    bundle: Path,
    workloads: dict[str, list[list[int]]],
    best_k: dict[str, int],
    max_new_tokens: int,
    threads: int,
    eos_ids: tuple[int, ...],
    progress: Callable[[str], None] | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
) -> list[dict]:
    """Plain ``generate`` and ``generate(assistant_model=...)``, greedy, per workload.

    ``allow_pickle`` / ``trust_remote_code``: the caller's consent for reloading the source checkpoints (the
    manifest's record of the build's flags is never taken as consent)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return [skip("transformers", "transformers/torch not installed (pip install draftsmith[peers])")]
    import torch

    quiet_transformers()
    if threads:
        torch.set_num_threads(threads)
    consent = {"allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code}
    try:
        target_ckpt, draft_ckpt = target_and_draft(manifest, bundle, consent)
        with contextlib.redirect_stderr(io.StringIO()):  # GGUF dequantization draws its own tqdm bars
            target = target_ckpt.load_model()
            assistant, what = (
                (None, "") if is_feature_draft(manifest) else transformers_assistant(manifest, target, draft_ckpt)
            )
    except PeerError as err:
        return [skip("transformers", str(err))]
    except Exception as err:  # a peer failing must not sink the bench
        return [skip("transformers", f"could not load the checkpoints: {type(err).__name__}: {err}")]
    eos = list(eos_ids) or None

    def generator(assisted: bool):
        def generate(ids):
            input_ids = torch.tensor([ids])
            options = dict(
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else None,
                attention_mask=torch.ones_like(input_ids),
            )
            if assisted:
                options["assistant_model"] = assistant
            with torch.inference_mode():
                return target.generate(input_ids, **options)[0, len(ids) :].tolist()

        return generate

    rows = []
    for workload, prompts in workloads.items():
        k = best_k.get(workload) or manifest.default_k
        modes = {"plain": generator(False)}
        if assistant is not None:  # a feature draft is no language model transformers could assist with
            assistant.eval()
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            modes["assisted"] = generator(True)
        rows += timed_rows("transformers", workload, prompts, modes, k, progress, assisted={"assistant": what})
    return rows
