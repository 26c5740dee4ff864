"""Stage 1: the target continues every prompt: with its ONNX engine in continuous batches (teacher rows from the same
calls), or with torch ``generate`` (left-padded batches of similar length) where no fused engine can be built."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from builder.distill.corpus import Sample


def eos_ids_of(model, tokenizer) -> list[int]:
    ids = set()
    for value in (
        getattr(model.config, "eos_token_id", None),
        getattr(model.generation_config, "eos_token_id", None) if getattr(model, "generation_config", None) else None,
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos_ids: list[int],
    pad_id: int,
    batch_size: int = 16,
    advance: Callable[[int], None] = lambda n: None,
) -> list[Sample]:
    """Continue every prompt with the target (left-padded batches of similar length); returns the samples in the
    order of ``prompts``."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    done: dict[int, Sample] = {}
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        options = dict(
            do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids or None
        )
        if temperature > 0:
            options.update(temperature=temperature, top_k=0, top_p=1.0)
        else:
            options.update(temperature=None, top_k=None, top_p=None)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **options)
        for r, i in enumerate(rows):
            continuation = []
            for token in out[r, width:].tolist():
                continuation.append(token)
                if token in eos_ids:
                    break
            done[i] = Sample(list(prompts[i]), continuation)
        advance(len(rows))
    return [done[i] for i in sorted(done)]


@dataclass
class Job:
    """One continuation to make: a prompt, the temperature to continue it at (0: greedy), whether the prompt's
    own positions get teacher rows (once per prompt is enough: further samples of it would only repeat them), and
    the number its draws are seeded by (None: its place in the list; a resumed run gives each job its place in
    the whole plan, so it draws what the unbroken run drew)."""

    prompt: list[int]
    temperature: float = 0.0
    prompt_rows: bool = True
    number: int | None = None


@dataclass
class _Row:
    job: int
    prompt: list[int]
    temperature: float
    generator: object  # the row's own torch.Generator: its draws do not depend on the rows beside it
    rows_from: int = 0
    continuation: list[int] = field(default_factory=list)
    top_ids: list = field(default_factory=list)
    top_probs: list = field(default_factory=list)
    features: list = field(default_factory=list)  # float16 [n, H] chunks: the target's hidden state per position


def generate_with_engine(
    engine,
    jobs: list[Job],
    max_new_tokens: int,
    *,
    top_k: int,
    eos_ids: list[int],
    seed: int = 0,
    batch_size: int = 32,
    features: bool = False,
    advance: Callable[[int], None] = lambda n: None,
    sink: Callable[[int, Sample], None] | None = None,
) -> list[Sample]:
    """Continue every job's prompt with the target's ONNX engine (``runtime.engines.fused.FusedEngine``), filling each
    sample's teacher rows from the same calls: no second teacher pass.

    Continuous batching: up to ``batch_size`` rows step together one token a call; a finished row leaves and a
    waiting prompt (prefilled alone, with logits for its positions) joins. On 2 cores a step of 32 GGUF-target rows
    makes ~390 tokens/s (the default recipe: 222 end to end, prefills included) against ~25-100 for torch's
    ``generate``. ``features``: keep the target's final hidden state at every position too (float16; a feature
    draft's training data, from the calls already made). Every job runs (no clock stops it); each sampled row draws
    from its own generator, seeded by ``seed`` and the job's number, so a job's continuation does not depend on
    which rows shared its batches. Returns the samples, in job order. ``sink(job, sample)``: each sample is handed
    over as it finishes instead (its features need not stay in memory: builder/distill/shards.py writes them), and
    the list returned is empty.
    """
    import torch

    waiting = deque(range(len(jobs)))
    rows: list[_Row] = []
    cache = None
    done: dict[int, Sample] = {}
    made = 0  # samples finished (handed to ``sink`` or kept in ``done``)
    eos = set(eos_ids)
    while True:
        while waiting and len(rows) < batch_size:
            row, one = _admit(engine, waiting.popleft(), jobs, top_k, features, seed)
            rows.append(row)
            cache = one if cache is None else engine.join(cache, one)
        live = [b for b, r in enumerate(rows) if r.continuation[-1] not in eos and len(r.continuation) < max_new_tokens]
        if len(live) < len(rows):
            for b in sorted(set(range(len(rows))) - set(live)):
                sample = _sample_of(rows[b], features)
                if sink is not None:
                    sink(rows[b].job, sample)
                else:
                    done[rows[b].job] = sample
            made += len(rows) - len(live)
            advance(len(rows) - len(live))
            rows = [rows[b] for b in live]
            cache = engine.select(cache, np.array(live, np.int64)) if rows else None
        if not rows:
            if waiting:
                continue
            return [done[i] for i in sorted(done)]
        tokens = np.array([[r.continuation[-1]] for r in rows], np.int64)
        logits = torch.from_numpy(engine.forward(cache, tokens)[:, 0])
        ids, probs = _top(logits, top_k)
        chosen = _choose(logits, [r.temperature for r in rows], [r.generator for r in rows])
        hidden = cache.extra.get("hidden") if features else None
        for b, r in enumerate(rows):
            r.top_ids.append(ids[b : b + 1])
            r.top_probs.append(probs[b : b + 1])
            r.continuation.append(int(chosen[b]))
            if hidden is not None:
                r.features.append(hidden[b].astype(np.float16))
        advance(0)  # a step, no row finished: lets a Heartbeat report on time


def _admit(engine, i: int, jobs: list[Job], top_k: int, features: bool, seed: int):
    """(row, its cache) for job ``i``: its prompt prefilled alone (with logits for its teacher rows) and its first
    token chosen."""
    import torch

    job = jobs[i]
    generator = torch.Generator().manual_seed(job_seed(seed, i if job.number is None else job.number))
    row = _Row(i, list(job.prompt), job.temperature, generator, 0 if job.prompt_rows else len(job.prompt) - 1)
    one = engine.new_cache(1)
    if row.rows_from:  # the prompt without its head rows, then its last token scored alone
        engine.prefill(one, np.array([row.prompt[:-1]], np.int64))
        _keep_features(row, one, features)
    logits = torch.from_numpy(engine.forward(one, np.array([row.prompt[row.rows_from :]], np.int64))[0])
    _keep_features(row, one, features)
    ids, probs = _top(logits, top_k)
    row.top_ids.append(ids)
    row.top_probs.append(probs)
    row.continuation.append(int(_choose(logits[-1:], [row.temperature], [row.generator])[0]))
    return row, one


def job_seed(seed: int, number: int) -> int:
    """The seed of job ``number``'s draws under the run's ``seed``."""
    return (seed * 1_000_003 + number) % 2**63


def _sample_of(row: _Row, features: bool) -> Sample:
    return Sample(
        row.prompt,
        row.continuation,
        np.concatenate(row.top_ids),
        np.concatenate(row.top_probs),
        row.rows_from,
        np.concatenate(row.features) if features else None,
    )


def _keep_features(row: _Row, cache, wanted: bool) -> None:
    if wanted:
        hidden = cache.extra.get("hidden")
        if hidden is None:
            raise ValueError("this engine's graph returns no hidden states (build it with this Draftsmith)")
        row.features.append(hidden[0].astype(np.float16))


def _top(logits, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The teacher rows of ``logits`` [N, V]: top-k ids and probabilities at temperature 1."""
    import torch

    values, index = torch.softmax(logits, dim=-1).topk(min(top_k, logits.shape[-1]), dim=-1)
    return index.numpy().astype(np.int64), values.numpy().astype(np.float32)


def _choose(logits, temperatures: list[float], generators: list):
    """Each row's next token: argmax at temperature 0, else a draw from softmax(logits / T) by inverting its CDF
    (one uniform a sampled row, from the row's own generator; torch.multinomial costs ~1 ms a 49k-wide row here)."""
    import torch

    temps = torch.tensor(temperatures, dtype=torch.float32)[:, None]
    greedy = logits.argmax(dim=-1)
    if not (temps > 0).any():
        return greedy
    cdf = torch.softmax(logits / temps.clamp(min=1e-6), dim=-1).cumsum(dim=-1)
    uniform = [torch.rand(1, generator=g) if t > 0 else torch.zeros(1) for t, g in zip(temperatures, generators)]
    u = torch.stack(uniform) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u).clamp(max=logits.shape[-1] - 1)[:, 0]
    return torch.where(temps[:, 0] > 0, drawn, greedy)


def target_engine(
    model, checkpoint, folder, quant: str, accuracy_level: int, max_context: int, threads: int = 0, native: bool = False
):
    """The target as the fused ONNX engine the bundle will run (quant ``gguf``: the file's own blocks, multiplied by
    Draftsmith's GgufMatMul where ``native``, as gguf_ops.native_for the preset's kernel says the bundle's are, else
    by MatMulNBits; otherwise fp32), written into ``folder``; None where the fused graph cannot express the model
    (then torch generates)."""
    from builder import graph
    from builder.decoder import GraphError, from_transformers
    from builder.gguf import weights as gguf_weights
    from runtime.engines.onnx import new_engine

    try:
        decoder = from_transformers(model, max_context)  # rotary tables for this many tokens
    except GraphError:
        return None
    path = folder / "target.onnx"
    if quant == "gguf" and checkpoint.gguf_file:
        decoder = gguf_weights.apply(decoder, checkpoint.gguf, native=native)
        graph.build(decoder, path, accuracy_level)
    else:
        graph.build(decoder, path)
    info = graph.info_of(decoder)
    return new_engine("fused", path, info, max_context, threads=threads)
