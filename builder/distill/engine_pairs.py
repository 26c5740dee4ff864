"""A feature draft's training pairs made by the target's own engine into a work folder that a killed run picks up.

What a resumable distillation (``prefill_text`` in the recipe; builder/distill/pipeline.py) keeps in its work folder:

- ``engine/``: the target as the fused ONNX engine its bundle will run. A GGUF file is written layer by layer from
  its own blocks (builder.gguf.stream: memory follows one layer, so the target is never whole in torch fp32); a
  Hugging Face folder is loaded and written as the fp32 graph. Made once: ``engine.json`` names what it was made
  from, and a run that finds it opens the file.
- ``heldout/``, ``generated/``, ``prefill/``: shard stores (builder/distill/shards.py) of the greedy held-out
  continuations, the sampled training continuations and the prefilled text windows, each sample with the target's
  hidden state at every position. A run that finds shards makes only the items they lack, each exactly as the run
  that was killed would have made it (every job draws from its own seed).
- ``clock.json``: the seconds earlier runs spent (the report's ``seconds_all_runs``: the recipe is budgeted in work,
  builder/distill/plan.py, so no clock stops a stage); and the training checkpoint (builder/distill/checkpoints.py).
"""

from __future__ import annotations

import json
import logging
import os
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from builder.distill.continuations import Job, generate_with_engine
from builder.distill.corpus import Sample
from builder.distill.prefill import prefill_samples
from builder.distill.shards import ShardStore

ENGINE_RECORD = "engine.json"
CLOCK = "clock.json"


class WorkFolder:
    """A distillation's work folder and its clock: ``elapsed()`` counts this run's seconds on top of those the
    earlier runs of the same ``fingerprint`` spent."""

    def __init__(self, path: Path, fingerprint: dict):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.fingerprint = json.loads(json.dumps(fingerprint))
        self.before = self._spent()
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return self.before + time.perf_counter() - self.started

    def save_clock(self) -> None:
        record = {"fingerprint": self.fingerprint, "elapsed": round(self.elapsed(), 1)}
        partial = self.path / (CLOCK + ".partial")
        partial.write_text(json.dumps(record), encoding="utf-8")
        os.replace(partial, self.path / CLOCK)

    def reset(self) -> None:
        """Forget the seconds spent (a finished distillation: a later one in the folder reuses its data, not its
        time)."""
        (self.path / CLOCK).unlink(missing_ok=True)

    def store(self, name: str, fingerprint: dict) -> ShardStore:
        return ShardStore(self.path / name, {**self.fingerprint, **fingerprint})

    def _spent(self) -> float:
        try:
            record = json.loads((self.path / CLOCK).read_text(encoding="utf-8"))
            return float(record["elapsed"]) if record.get("fingerprint") == self.fingerprint else 0.0
        except (OSError, ValueError, KeyError, TypeError):
            return 0.0


@dataclass
class TeacherSource:
    """Where the teacher engine and the draft's frozen rows come from: ``decoder()`` the fused graph's Decoder as the
    engine is written (the GGUF file's own blocks, or fp32), ``sizes()`` one that only sizes it (nothing read that
    the engine file already holds), ``reference`` a transformers model holding at least the embedding, final norm
    and head (a GGUF target's first layers only)."""

    decoder: Callable[[], object]
    sizes: Callable[[], object]
    reference: object
    accuracy_level: int
    native: bool = False  # the GGUF blocks multiplied by GgufMatMul (else MatMulNBits, or fp32)

    @property
    def kernel(self) -> str:
        """What multiplies by the target's weights in its engine (the engine record and the report name it)."""
        return "GgufMatMul" if self.native else "onnxruntime"


def teacher_source(checkpoint, context: int, accuracy_level: int, native: bool, block: int = 32) -> TeacherSource:
    """The target read for its engine: a GGUF file layer by layer (never whole in torch), its blocks multiplied by
    Draftsmith's GgufMatMul where ``native`` (gguf_ops.native_for the preset's kernel, as the bundle's target engine
    is written) or by MatMulNBits, anything else whole (fp32, ``native`` moot)."""
    from builder.decoder import from_transformers
    from builder.gguf import stream as gguf_stream
    from builder.gguf import weights as gguf_weights

    if gguf_stream.supported(checkpoint, "fused"):
        streamed = gguf_stream.Streamed(checkpoint, context)

        def blocks():
            return gguf_weights.apply(
                streamed.decoder(),
                checkpoint.gguf,
                block,
                permuted_qk=checkpoint.architecture.gguf_permuted_qk,
                native=native,
            )

        return TeacherSource(blocks, streamed.decoder, streamed.reference, accuracy_level, native)
    model = checkpoint.load_model()
    return TeacherSource(lambda: from_transformers(model, context), lambda: from_transformers(model, context), model, 0)


def teacher_engine(work: WorkFolder, source: TeacherSource, sha256: str, context: int, threads: int, say):
    """The target's fused engine from ``work/engine`` (written there first unless a finished one is there)."""
    from builder import graph
    from builder.progress import ticking
    from runtime.engines.onnx import new_engine

    folder = work.path / "engine"
    path = folder / "target.onnx"
    record = {"target_sha256": sha256, "context": context, "accuracy_level": source.accuracy_level}
    record["kernel"] = source.kernel  # an engine of the other kernel is written again
    if _read_json(folder / ENGINE_RECORD) != record or not path.is_file() or not _passes_checks(path, say):
        (folder / ENGINE_RECORD).unlink(missing_ok=True)
        with ticking("teacher: writing the target's engine", say):
            graph.build(source.decoder(), path, source.accuracy_level)
        (folder / ENGINE_RECORD).write_text(json.dumps(record), encoding="utf-8")
    info = graph.info_of(source.sizes())
    return new_engine("fused", path, info, context, threads=threads, initial_slots=context)


def continue_into(
    store: ShardStore,
    engine,
    jobs: list[Job],
    *,
    max_new_tokens: int,
    eos_ids: list[int],
    seed: int,
    batch_size: int,
    advance: Callable[[int], None] = lambda n: None,
    per_shard: int = 32,
    on_shard: Callable[[], None] = lambda: None,
) -> None:
    """The target's continuations of the ``jobs`` the store lacks, with its hidden states, written as they finish
    (a shard every ``per_shard`` samples). Each job draws from ``seed`` and its place in ``jobs``: a resumed run
    makes the samples the killed one lost, as it would have made them."""
    done = store.done()
    todo = [i for i in range(len(jobs)) if i not in done]
    pending: list[tuple[int, Sample]] = []

    def sink(job: int, sample: Sample) -> None:
        pending.append((todo[job], sample))
        if len(pending) >= per_shard:
            flush()

    def flush() -> None:
        store.add([s for _, s in pending], [i for i, _ in pending])
        pending.clear()
        on_shard()

    if todo:
        generate_with_engine(
            engine,
            [dataclasses.replace(jobs[i], number=i) for i in todo],
            max_new_tokens,
            top_k=1,
            eos_ids=eos_ids,
            seed=seed,
            batch_size=batch_size,
            features=True,
            advance=advance,
            sink=sink,
        )
        flush()


def prefill_into(
    store: ShardStore,
    engine,
    windows: list[list[int]],
    *,
    rows: int,
    advance: Callable[[int], None] = lambda n: None,
    per_shard: int = 16,
    on_shard: Callable[[], None] = lambda: None,
) -> None:
    """The target's hidden states over the ``windows`` the store lacks, ``rows`` windows a call; a shard every
    ``per_shard`` windows."""
    done = store.done()
    todo = [i for i in range(len(windows)) if i not in done]
    items, samples = [], []
    for at, made in prefill_samples(engine, [windows[i] for i in todo], rows=rows, advance=advance):
        items += [todo[i] for i in at]
        samples += made
        if len(samples) >= per_shard:
            store.add(samples, items)
            items, samples = [], []
            on_shard()
    store.add(samples, items)


def sha_of(values) -> str:
    """A short stable digest of a JSON-able value (a plan, a vocabulary) for fingerprints."""
    import hashlib

    data = json.dumps(values if not isinstance(values, np.ndarray) else values.tolist()).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _passes_checks(path: Path, say) -> bool:
    """Whether a finished engine found in the work folder passes the checks a bundle's engines do before ONNX Runtime
    opens them (operators, external data beside the graph): the folder is only files on disk, and its record names
    what the engine was made from, not what the file now holds. One that fails is said and written again."""
    from runtime.bundle import BundleError
    from runtime.engines.onnx_checks import check_operators, external_data_locations, parse_onnx

    try:
        proto = parse_onnx(path.read_bytes(), str(path))
        check_operators(proto, str(path))
        external_data_locations(proto, str(path))
        return True
    except (BundleError, OSError) as err:
        (say or logging.getLogger("draftsmith").warning)(f"teacher: {err}\nwriting the target's engine again")
        return False


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
