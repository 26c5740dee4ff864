"""``draftsmith bench``: measure speculative decoding against target-only decoding on the same engines, in the same
run, over a k sweep and prompt workloads; compare with Leviathan et al.'s prediction, the memory bandwidth bound and
peers; recommend (and optionally store) the bundle's default k.

Longer than most modules: the command, its sweep and the report's JSON are one flow (the report math is
bench/stats.py, the tables bench/report.py, the peers bench/peers/); splitting it would scatter one measurement.

How a measurement runs: for each workload and batch size, the prompts are taken a batch at a time and each batch is
decoded target-only and then with every k, back to back (interleaved, so slow drifts of a shared machine hit every
configuration alike), after one untimed warm-up per configuration. The engines' ``forward`` and their ONNX Runtime
sessions are wrapped with timers (nothing else changes), which splits the time into draft calls, verify calls,
prefill, and the loop's own work outside the engines. The report math lives in ``bench.stats``, its rendering in
``bench.report``.
"""

from __future__ import annotations


import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import click

from bench.report import plot, render_summary, render_table
from bench.stats import (
    CellRecord,
    EngineCall,
    SequenceRecord,
    bandwidth_bound,
    best_k,
    recommend_k,
    summarize,
    where_time_goes,
)
from runtime.drafter_names import DRAFTERS
from runtime.engines.base import Call
from runtime.text.prompt_files import parse_prompts
from builder.distill.corpus import HELDOUT_SETS, load_heldout
from runtime.request import decode_request
from runtime.engines.sessions import DEVICES, DeviceError

BUILTIN_WORKLOADS = ("code", "chat", "reasoning", "json")  # json: with --response-format prompts/json_event.json
# prompts no distillation trains on (builder/data/heldout-*.txt, the distiller's held-out sets): measure drafts there
HELDOUT_WORKLOADS = tuple(HELDOUT_SETS)
CHAT_BY_DEFAULT = ("chat", "reasoning", "json", "heldout-chat")  # through the chat template unless --no-chat


# --- prompts --------------------------------------------------------------------------------------------------------


def load_workload(spec: str) -> tuple[str, list[str]]:
    """A built-in workload name or a prompt file; returns (name, prompts)."""
    if spec in BUILTIN_WORKLOADS:
        text = resources.files("bench").joinpath("prompts", f"{spec}.txt").read_text(encoding="utf-8")
        return spec, parse_prompts(text)
    if spec in HELDOUT_WORKLOADS:
        return spec, [prompt.text for prompt in load_heldout([spec])]
    path = Path(spec)
    if not path.is_file():
        raise click.BadParameter(
            f"{spec!r} is neither a built-in workload ({', '.join(BUILTIN_WORKLOADS + HELDOUT_WORKLOADS)}) nor a "
            "prompt file",
            param_hint="--workload",
        )
    prompts = parse_prompts(path.read_text(encoding="utf-8"))
    if not prompts:
        raise click.BadParameter(f"{spec}: no prompts found", param_hint="--workload")
    return path.stem, prompts


def int_list(values, name: str) -> list[int]:
    """'1,2,3' / repeated options -> [1, 2, 3] (order kept, duplicates dropped); every value >= 1."""
    out: list[int] = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            if not part.isdigit() or int(part) < 1:
                raise click.BadParameter(f"expected integers >= 1, received {part!r}", param_hint=name)
            if int(part) not in out:
                out.append(int(part))
    return out


# --- instrumentation ------------------------------------------------------------------------------------------------


class Recorder:
    """Every call of a generator's engines, timed (the whole call and its ONNX Runtime part) into ``calls``: the
    engines' own observers (runtime/engines/base.py), so nothing of theirs is wrapped or patched."""

    def __init__(self, generator, drafts: list | None = None):
        """``drafts``: draft engines besides the generator's (other bundles' drafts a bench compares)."""
        self.calls: list[EngineCall] = []
        self._watched = []
        for role, engine in [("target", generator.target), ("draft", generator.draft)] + [
            ("draft", d) for d in drafts or []
        ]:
            if engine is not None and all(engine is not e for e, _ in self._watched):
                observer = functools.partial(self._record, role)
                engine.watch(observer)
                self._watched.append((engine, observer))

    def _record(self, role: str, call: Call) -> None:
        """A prompt's prefill, and a drafter's first call on its prompt, count as prefill."""
        prefill = call.kind != "forward" or call.first
        self.calls.append(EngineCall(role, prefill, call.seconds, call.session_seconds, call.width, call.rows))

    def take(self) -> list[EngineCall]:
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        for engine, observer in self._watched:
            engine.unwatch(observer)
        self._watched = []


def decode(
    generator,
    token_lists: list[list[int]],
    mode: str,
    k: int | None,
    max_new_tokens: int,
    temperature: float,
    seed: int | None,
    drafter_kind: str | None = None,
    confidence: float | None = None,
    response_format=None,
    forced_drafts: bool = True,
    top_p: float | None = None,
    policy: str = "exact",
    plan: bool = True,
) -> tuple[list[SequenceRecord], float]:
    """Run one batch through the generator's own decoding loop (``generate``'s: the front door admits the token
    lists, the scheduler runs them as one group), recording each step through the loop's step observer.
    ``response_format`` constrains every answer (target-only decoding too: the baseline is constrained target-only
    decoding). ``plan``: each step's draft lengths from the measured costs, ``k`` the most (False: ``k`` every
    step)."""
    if mode == "plain":  # target-only without exactness padding: what a user's plain decoder runs
        mode, policy = "target", "throughput"
    elif mode == "target":
        policy = "exact"  # target-only is measured padded and plain anyway
    request = decode_request(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        k=k,
        mode=mode,
        drafter=drafter_kind,
        draft_confidence=confidence,
        response_format=response_format,
        forced_drafts=forced_drafts,
        policy=policy,
        plan=plan,
    )
    admitted = generator.door.admit_tokens(token_lists, request)
    records = [SequenceRecord() for _ in token_lists]
    clock = StepClock(records)
    if admitted.drafter is not None and admitted.config.plan:
        generator.step_costs(len(token_lists))  # measured before the clock starts, as every run of this batch size
    clock.start = time.perf_counter()
    for _ in generator.run(admitted, on_step=clock.record):
        pass
    return records, time.perf_counter() - clock.start


@dataclass
class StepClock:
    """The loop's step observer for the bench: each row's (drafted, accepted, emitted, seconds since its last step),
    its time to first token and its tokens."""

    records: list[SequenceRecord]
    start: float = 0.0
    counters: dict = dataclasses.field(default_factory=dict)  # row -> (draft tokens, accepted tokens) so far
    last: dict = dataclasses.field(default_factory=dict)  # row -> when its last step ended

    def record(self, step) -> None:
        now = time.perf_counter()
        for row, new in step:
            i, record = row.index, self.records[row.index]
            drafted0, accepted0 = self.counters.get(i, (0, 0))
            self.counters[i] = (row.stats.num_draft_tokens, row.stats.num_accepted_tokens)
            drafted, accepted = self.counters[i][0] - drafted0, self.counters[i][1] - accepted0
            record.steps.append((drafted, accepted, len(new), now - self.last.get(i, self.start)))
            self.last[i] = now
            if new and not record.ttft:
                record.ttft = now - self.start
            record.token_ids.extend(new)


def pads(engine) -> bool:
    """Whether the target pads its one-token calls for exactness: then target-only decoding is measured twice,
    padded (what speculation is identical to) and plain (the speedup's baseline)."""
    return engine.min_call_tokens > 1


def run_workloads(
    generator,
    workloads: dict[str, list[list[int]]],
    ks: list[int],
    batches: list[int],
    max_new_tokens: int,
    temperature: float,
    seed: int | None = 0,
    advance=None,
    drafter_kind: str | None = None,
    confidence: float | None = None,
    response_format=None,
    forced_drafts: bool = True,
    top_p: float | None = None,
    policy: str = "exact",
    drafters: dict[str, tuple] | None = None,
) -> list[CellRecord]:
    """Measure every (workload, batch, mode, k, drafter) cell; ``advance(description)`` is called after each decode;
    ``policy`` is the speculative cells' (DecodeRequest.policy). ``drafters``: label -> (generator, drafter kind)
    (``drafters_of``), each run at every k; default: ``drafter_kind`` on ``generator``."""
    structure = dict(response_format=response_format, forced_drafts=forced_drafts, top_p=top_p, policy=policy)
    drafters = drafters or {drafter_kind or "": (generator, drafter_kind)}
    recorder = Recorder(generator, [g.draft for g, _ in drafters.values()])
    cells: list[CellRecord] = []
    configs = (
        [("target", None, "")]
        + ([("plain", None, "")] if pads(generator.target) else [])
        + [("speculative", k, label) for label in drafters for k in ks]
    )
    runner = {"": (generator, drafter_kind), **drafters}

    def run(label: str, mode: str, k: int | None, token_lists: list[list[int]], limit: int):
        """One cell's decode of ``token_lists``, ``limit`` new tokens each (warm-up and measured runs alike)."""
        cell_generator, kind = runner[label]
        return decode(cell_generator, token_lists, mode, k, limit, temperature, seed, kind, confidence, **structure)

    try:
        for name, token_lists in workloads.items():
            for batch in batches:
                mine = {c: CellRecord(name, batch, c[0], c[1], c[2]) for c in configs}
                cells += mine.values()
                for mode, k, label in configs:  # warm-up: first calls allocate, JIT-pick kernels and fill caches
                    run(label, mode, k, token_lists[:batch], min(8, max_new_tokens))
                recorder.take()
                for turn, at in enumerate(range(0, len(token_lists), batch)):
                    chunk = token_lists[at : at + batch]
                    shift = turn % len(configs)  # rotated: no configuration always runs first or after another
                    for mode, k, label in configs[shift:] + configs[:shift]:
                        records, wall = run(label, mode, k, chunk, max_new_tokens)
                        cell = mine[(mode, k, label)]
                        cell.sequences += records
                        cell.wall += wall
                        cell.calls += recorder.take()
                        if advance:
                            advance(f"{name} b={batch} " + (mode if k is None else f"k={k} {label}".rstrip()))
    finally:
        recorder.close()
    return cells


def summarize_cells(cells: list[CellRecord], temperature: float) -> list[dict]:
    """One row per cell. Speedups are over plain target-only decoding of the same workload/batch (unpadded; the
    padded target-only cell where the target does not pad), identity is against the padded target-only cell of batch
    1 where measured (each prompt decoded alone: what speculation promises to equal at any batch; a batched
    target-only run calls the target with other shapes, so it may part from it on near ties), else of the same batch.
    ``speedup_over_padded`` keeps the ratio to the padded cell."""
    padded = {(c.workload, c.batch): c for c in cells if c.mode == "target"}
    plain = {(c.workload, c.batch): c for c in cells if c.mode == "plain"}
    rows = []
    for cell in cells:
        key = (cell.workload, cell.batch)
        row = summarize(cell, plain.get(key) or padded.get(key))
        if key in plain and cell.mode != "plain":
            row["speedup_over_padded"] = summarize(cell, padded[key])["speedup"]
        if cell.mode == "speculative" and key in plain:
            alone = padded.get((cell.workload, 1), padded[key])
            row["identical_to_target"] = summarize(cell, alone)["identical_to_target"]
        if cell.mode in ("target", "plain") and key not in plain:
            row["speedup"] = 1.0
        if cell.mode in ("target", "plain"):
            row["identical_to_target"] = None
        if temperature > 0:
            row["identical_to_target"] = None  # sampled outputs differ by design
        rows.append(row)
    return rows


# --- the limit, memory, peers ---------------------------------------------------------------------------------------


def limit_report(bundle: Path, manifest, rows: list[dict], threads: int) -> dict:
    from bench.system import measure_bandwidth, weight_bytes_per_token

    bandwidth = measure_bandwidth(threads=max(1, threads or os.cpu_count() or 1))
    out = {"bandwidth": bandwidth, "engines": {}}
    for entry in (manifest.target, manifest.draft):
        weights = weight_bytes_per_token(bundle / entry.engine)
        weights["bound_tokens_per_second"] = bandwidth_bound(bandwidth["bytes_per_second"], weights["bytes_per_token"])
        weights["size_bytes"] = entry.size_bytes
        weights["quant"] = entry.quant
        out["engines"][entry.role] = weights
    target_rows = [r for r in rows if r["mode"] == "target" and r["batch"] == 1]
    bound = out["engines"]["target"]["bound_tokens_per_second"]
    if target_rows and bound:
        # the steady decode rate (prefill excluded), pooled over workloads: what the bound is about
        # (target-only emits one token per step, so each sequence's first step holds exactly one token)
        decoding = [r for r in target_rows if r["decode_tokens_per_second"]]
        tokens = sum(r["tokens"] - r["prompts"] for r in decoding)
        seconds = sum((r["tokens"] - r["prompts"]) / r["decode_tokens_per_second"] for r in decoding)
        measured = tokens / seconds if seconds else 0.0
        out["target_only_tokens_per_second"] = measured
        out["target_only_step_ms"] = 1e3 * _mean_of(r["verify_call_seconds"] for r in target_rows)
        out["fraction_of_bound"] = measured / bound
        out["bound_over_measured"] = bound / measured if measured else None
    return out


def _mean_of(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def write_default_k(bundle: Path, k: int) -> None:
    """Store k as the bundle's default_k. Only manifest.json changes (it is not among the hashed files), atomically."""
    from runtime.bundle import load_manifest, write_manifest_atomic

    manifest = load_manifest(bundle, verify=True)
    if k > manifest.spec.max_k:
        raise click.ClickException(f"k={k} exceeds this bundle's max_k ({manifest.spec.max_k})")
    write_manifest_atomic(bundle, dataclasses.replace(manifest, default_k=k))


def read_response_format(generator, path: Path | None):
    """The response_format in a JSON file (None without one), compiled once here so a bad one fails first."""
    if path is None:
        return None
    from runtime.errors import RequestError

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        generator.compile_constraint(value)
    except (ValueError, RequestError) as err:
        raise click.BadParameter(f"{path}: {err}", param_hint="--response-format") from None
    return value


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# --- the command ----------------------------------------------------------------------------------------------------

# the peers rows are named by (--peer)
PEER_NAMES = ("transformers", "llama.cpp", "llama-cpp-python", "onnxruntime-genai", "openvino")


@click.command("bench")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--workload",
    "workload_specs",
    multiple=True,
    default=("code", "chat", "reasoning"),
    show_default=True,
    help="code, chat, reasoning or a prompt file (prompts separated by '---' lines, or one per line); "
    "repeatable or comma-separated.",
)
@click.option(
    "--k",
    "k_values",
    multiple=True,
    default=("1,2,3,4,6,8",),
    show_default=True,
    help="Draft lengths to sweep (comma list or repeated).",
)
@click.option(
    "--batch",
    "batch_values",
    multiple=True,
    default=("1",),
    show_default=True,
    help="Batch sizes (comma list or repeated).",
)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling for every row (with --temperature > 0).")
@click.option(
    "--policy",
    type=click.Choice(["exact", "throughput"]),
    default="exact",
    show_default=True,
    help="The speculative cells' target calls: exact (every row padded as alone: bit for bit the request "
    "alone) or throughput (unpadded, as plain decoding runs; the plan's k=0 steps then cost a plain "
    "step).",
)
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option(
    "--prompts", "prompt_limit", type=int, default=0, help="Use the first N prompts of each workload (0: all)."
)
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads (0: all cores).")
@click.option(
    "--chat/--no-chat",
    default=None,
    help="Send prompts through the chat template (default: yes for chat and reasoning, no for code and files).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--drafter",
    "drafter_kind",
    default=None,
    help="What drafts: the draft engine (model; tli or string for a draft with its own tokenizer), n-gram "
    "lookup in the context (prompt_lookup), a suffix trie over the context (suffix), or either of those "
    "where it matches and the engine elsewhere (hybrid, hybrid_suffix); KIND@BUNDLE (model@B, hybrid@B): "
    "drafter KIND with another bundle's draft over this bundle's target (their target tokenizers must be the "
    "same). A comma list runs "
    "each, interleaved in one run; the first is the one best k and the recommended k are chosen for. "
    "Default: the bundle's drafter.",
)
@click.option(
    "--draft-confidence",
    "confidence",
    type=click.FloatRange(0, 1, max_open=True),
    default=None,
    help="After its first token a draft row stops where the draft's top probability is under this, so a "
    "larger k drafts further only where the draft is sure (0: never stop). Default: the bundle's.",
)
@click.option(
    "--response-format",
    "response_format_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A JSON file holding an OpenAI response_format (json_object, json_schema; or regex, "
    "grammar): every answer is constrained, the target-only baseline too "
    "(e.g. bench/prompts/json_event.json with --workload json).",
)
@click.option(
    "--forced-drafts/--no-forced-drafts",
    default=True,
    show_default=True,
    help="With --response-format: propose the tokens the grammar forces as drafts, without a draft call.",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the full report here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG plot here.")
@click.option("--write-k", is_flag=True, help="Store the recommended k as the bundle's default_k.")
@click.option(
    "--memory/--no-memory",
    default=True,
    show_default=True,
    help="Measure peak RSS of target-only and speculative decoding (one child process each).",
)
@click.option(
    "--limit/--no-limit",
    "limit",
    default=True,
    show_default=True,
    help="Measure memory bandwidth and the weights read per token (the bandwidth bound).",
)
@click.option(
    "--peers/--no-peers",
    default=None,
    help="Run the peers (transformers, llama.cpp, ONNX Runtime GenAI) on the same prompts (default: those installed).",
)
@click.option(
    "--peer",
    "peer_names",
    multiple=True,
    type=click.Choice(PEER_NAMES),
    help="Run only these peers (repeatable; default: every installed one). A GGUF target's "
    "transformers and ONNX Runtime GenAI peers parse the file for minutes: --peer llama.cpp skips them.",
)
@click.option(
    "--quality/--no-quality",
    default=False,
    show_default=True,
    help="Perplexity on the evaluation set beside the speed: ours, and llama.cpp's on the same GGUF file.",
)
@click.option(
    "--quality-tokens",
    type=int,
    default=0,
    show_default=True,
    help="With --quality: score only the first N tokens of the set (0: all, ~28,000).",
)
@click.option(
    "--peer-prompts",
    type=int,
    default=4,
    show_default=True,
    help="Prompts per workload for the peers (they are slow; 0: all).",
)
@click.option(
    "--peer-spinning/--no-peer-spinning",
    default=True,
    show_default=True,
    help="ONNX Runtime's thread spinning in the ONNX Runtime GenAI peer: on is its own default (and, like "
    "our engines' shared spinning pool, its best setting on few cores); --no-peer-spinning turns it "
    "off.",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default=None,
    help="Run on cpu, cuda or tensorrt (ONNX Runtime execution providers; default: the bundle's device).",
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Let the peers reload pickled source weights (.bin/.pt can run code; a bundle never grants this).",
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Let the peers run a source checkpoint's own modelling code (a bundle never grants this).",
)
@click.option("--quiet", is_flag=True, help="No progress bars.")
def bench(**flags):
    """Benchmark BUNDLE: speculative decoding at each k against target-only decoding on the same engines."""
    run_bench(BenchOptions(**flags))


@dataclass(frozen=True)
class BenchOptions:
    """One bench run's settings: the command's flags under their parameter names (``draftsmith bench --help`` says
    what each does), with the same defaults; ``run_bench`` takes them."""

    bundle: Path
    workload_specs: tuple[str, ...] = ("code", "chat", "reasoning")
    k_values: tuple[str, ...] = ("1,2,3,4,6,8",)
    batch_values: tuple[str, ...] = ("1",)
    temperature: float = 0.0
    top_p: float | None = None
    policy: str = "exact"  # the speculative cells' (DecodeRequest.policy)
    max_new_tokens: int = 64
    prompt_limit: int = 0
    threads: int = 0
    chat: bool | None = None  # None: the chat template for chat-like workloads where the tokenizer has one
    seed: int = 0
    drafter_kind: str | None = None  # None: the bundle's; a comma list runs each (the first is the primary)
    confidence: float | None = None  # None: the bundle's
    response_format_file: Path | None = None
    forced_drafts: bool = True
    json_out: Path | None = None
    plot_out: Path | None = None
    write_k: bool = False
    memory: bool = True
    limit: bool = True
    peers: bool | None = None  # None: those installed; True: required
    peer_names: tuple[str, ...] = ()
    quality: bool = False
    quality_tokens: int = 0
    peer_prompts: int = 4
    peer_spinning: bool = True
    device: str | None = None  # None: the bundle's
    allow_pickle: bool = False
    trust_remote_code: bool = False
    quiet: bool = False


def run_bench(options: BenchOptions) -> dict:
    """The bench's run (the command's body): the speed sweep, its report, then the optional measurements (limit,
    memory, peers, quality) and ``--write-k``, the JSON written after each so a slow or interrupted phase loses
    nothing measured before it; the tables last. Returns the report."""
    console = _console()
    ks, batches = int_list(options.k_values, "--k"), int_list(options.batch_values, "--batch")
    if options.max_new_tokens < 1:
        raise click.BadParameter("must be >= 1", param_hint="--max-new-tokens")
    names = [part.strip() for spec in options.workload_specs for part in spec.split(",") if part.strip()]
    loaded = dict(load_workload(n) for n in names)
    generator = _open_bundle(options)
    response_format = read_response_format(generator, options.response_format_file)
    options = _settle(options, generator, ks)
    workloads, chat_used = _encode_workloads(options, generator, loaded)
    started = time.time()
    cells = _sweep(options, generator, workloads, ks, batches, response_format, console, started)
    report = _speed_report(options, generator.manifest, workloads, chat_used, ks, batches, response_format, cells)
    manifest = generator.manifest
    del generator  # free the engines before the child processes load their own
    save = _saver(report, options.json_out, started)
    save(False)
    _measure_limit_and_memory(options, report, manifest, loaded, console)
    save(False)
    _compare_with_peers(options, report, manifest, workloads, cells, console)
    if options.quality:
        report["quality"] = quality_report(
            Path(options.bundle),
            options.threads,
            options.device,
            options.peers is not False and (not options.peer_names or "llama-cpp-python" in options.peer_names),
            options.quality_tokens,
        )
        save(False)
    _store_k(options, report)
    save(True)
    _show(console, report, options)
    return report


def _console():
    """The console the tables go to; in logs and pipes wide enough to keep the table on one line per row."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 150))


def _open_bundle(options: BenchOptions):
    """The bundle's generator on the asked device; a bundle that does not load, or a device it cannot run on, is
    the user's error, said without a traceback."""
    from runtime.api import SpeculativeGenerator
    from runtime.bundle import BundleError

    try:
        return SpeculativeGenerator.from_bundle(options.bundle, threads=options.threads, device=options.device)
    except (BundleError, DeviceError) as err:
        raise click.ClickException(str(err)) from None


def _settle(options: BenchOptions, generator, ks: list[int]) -> BenchOptions:
    """The options with the bundle's defaults in (drafter, draft confidence) and, off the CPU, the host-side
    measurements off: host RAM and host bandwidth say nothing about a GPU (peers too, unless asked for)."""
    bad = [k for k in ks if k > generator.max_k]
    if bad:
        raise click.BadParameter(f"{bad} exceed this bundle's max_k ({generator.max_k})", param_hint="--k")
    settled = dataclasses.replace(
        options,
        drafter_kind=",".join(drafter_labels(options.drafter_kind or generator.default_drafter)),
        confidence=generator.default_confidence if options.confidence is None else options.confidence,
    )
    if (options.device or generator.manifest.spec.device) != "cpu":
        settled = dataclasses.replace(
            settled, memory=False, limit=False, peers=False if options.peers is None else options.peers
        )
    return settled


def drafter_labels(text: str) -> list[str]:
    """The --drafter list: kinds (DRAFTERS) and KIND@BUNDLE entries, the first a kind; BadParameter otherwise."""
    labels = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    wrong = [label for label in labels if label not in DRAFTERS and label.partition("@")[0] not in DRAFTERS]
    if not labels or wrong or labels[0] not in DRAFTERS:
        raise click.BadParameter(
            f"expected drafter kinds {DRAFTERS} or KIND@BUNDLE, the first a kind; received {text!r}",
            param_hint="--drafter",
        )
    return labels


def drafters_of(options: BenchOptions, generator) -> dict[str, tuple]:
    """label -> (generator, drafter kind) for every --drafter entry; KIND@BUNDLE drafts by KIND with that bundle's
    draft engine over this generator's target (its target tokenizer must be this one's, byte for byte)."""
    out = {}
    for label in drafter_labels(options.drafter_kind):
        kind, _, other = label.partition("@")
        out[label] = (_borrowed_draft(generator, Path(other), options), kind) if other else (generator, label)
    return out


def _borrowed_draft(generator, other: Path, options: BenchOptions):
    """A generator over this one's target and another bundle's draft engine (same target tokenizer)."""
    from runtime.api import SpeculativeGenerator
    from runtime.engines.loading import open_engines
    from runtime.bundle import BundleError, load_manifest

    try:
        manifest = load_manifest(other)
    except BundleError as err:
        raise click.ClickException(f"--drafter KIND@{other}: {err}") from None
    key = "tokenizer/tokenizer.json"
    if manifest.files.get(key) != generator.manifest.files.get(key) or manifest.draft.tokenizer:
        raise click.ClickException(
            f"--drafter KIND@{other}: that bundle's draft does not share this bundle's target "
            "tokenizer (its tokenizer/tokenizer.json differs, or its draft has its own)"
        )
    draft = open_engines(
        other, manifest, generator.tokenizer.vocab_size, ("draft",), options.threads, device=options.device
    )["draft"]
    return SpeculativeGenerator(
        generator.manifest, generator.target, draft, generator.tokenizer, generator.eos_ids, generator.max_k
    )


def _encode_workloads(options: BenchOptions, generator, loaded: dict[str, list[str]]):
    """(token ids per workload, whether each went through the chat template): the first ``prompt_limit`` prompts,
    less those that leave no room for ``max_new_tokens`` in the bundle's context."""
    workloads: dict[str, list[list[int]]] = {}
    chat_used = {}
    for name, prompts in loaded.items():
        if options.prompt_limit:
            prompts = prompts[: options.prompt_limit]
        use_chat = (
            options.chat
            if options.chat is not None
            else (name in CHAT_BY_DEFAULT and bool(generator.tokenizer.chat_template))
        )
        chat_used[name] = use_chat
        room = generator.max_context - options.max_new_tokens
        workloads[name] = [ids for ids in (generator.encode_prompt(p, use_chat) for p in prompts) if len(ids) < room]
        if not workloads[name]:
            raise click.ClickException(
                f"workload {name}: no prompt leaves room for {options.max_new_tokens} new tokens"
            )
    return workloads, chat_used


def _sweep(options: BenchOptions, generator, workloads, ks, batches, response_format, console, started: float):
    """Every cell measured (``run_workloads``) under a bar on a terminal, or a line per decode in a log."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    drafters = drafters_of(options, generator)
    # target-only, plain where it pads, each k of each drafter
    configs = 1 + int(bool(pads(generator.target))) + len(ks) * len(drafters)
    runs = sum(math.ceil(len(t) / b) for t in workloads.values() for b in batches) * configs
    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=options.quiet,
        transient=False,
    )
    done = [0]

    def advance(description: str) -> None:
        progress.update(task, advance=1, description=description)
        done[0] += 1
        if not console.is_terminal and not options.quiet:  # logs get a line per decode instead of a live bar
            console.print(f"[{done[0]}/{runs}] {description} ({time.time() - started:.0f} s)")

    with progress:
        task = progress.add_task("decoding", total=runs)
        return run_workloads(
            generator,
            workloads,
            ks,
            batches,
            options.max_new_tokens,
            options.temperature,
            options.seed,
            advance=advance,
            drafters=drafters,
            confidence=options.confidence,
            response_format=response_format,
            forced_drafts=options.forced_drafts,
            top_p=options.top_p,
            policy=options.policy,
        )


def _speed_report(
    options: BenchOptions, manifest, workloads, chat_used, ks, batches, response_format, cells: list[CellRecord]
) -> dict:
    """The report of the sweep: settings, the bundle, a row per cell, each workload's best k, where the time goes
    and the recommended k."""
    rows = summarize_cells(cells, options.temperature)
    best = best_k(rows)
    rec_k, geomean = recommend_k(rows)
    report = {
        "bundle": str(options.bundle),
        "settings": {
            "workloads": {n: {"prompts": len(t), "chat_template": chat_used[n]} for n, t in workloads.items()},
            "k": ks,
            "batch": batches,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "policy": options.policy,
            "max_new_tokens": options.max_new_tokens,
            "threads": options.threads,
            "seed": options.seed,
            "drafter": options.drafter_kind,
            "draft_confidence": options.confidence,
            "response_format": response_format,
            "forced_drafts": options.forced_drafts,
            "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "bundle_info": {
            "target_quant": manifest.target.quant,
            "draft_quant": manifest.draft.quant,
            "draft": manifest.spec.draft,
            "target": manifest.spec.target,
            "default_k": manifest.default_k,
            "max_k": manifest.spec.max_k,
        },
        "results": rows,
        "best_k": {w: r for w, r in best.items()},
        "where_time_goes": where_time_goes(rows, best),
    }
    if rec_k is not None:
        report["recommended_k"] = {
            "k": rec_k,
            "geomean_speedup": geomean,
            "bundle_default_k": manifest.default_k,
            "chosen_by": "highest geometric mean of measured speedup over the workloads, at "
            "each workload's smallest batch; ties to the smaller k",
        }
    return report


def _recommended_k(report: dict) -> int | None:
    return report["recommended_k"]["k"] if "recommended_k" in report else None


def _saver(report: dict, json_out: Path | None, started: float):
    """``save(final)``: write the JSON report (with ``--json``) after each phase, so a slow or interrupted peer run
    loses nothing measured before it."""

    def save(final: bool) -> None:
        report["seconds"] = time.time() - started
        report["complete"] = final
        if json_out:
            json_out.write_text(json.dumps(report, indent=2, default=_json_default), encoding="utf-8")

    return save


def _measure_limit_and_memory(
    options: BenchOptions, report: dict, manifest, loaded: dict[str, list[str]], console
) -> None:
    """The bandwidth bound (``--limit``) and the peak memory of each mode in a child process (``--memory``, on the
    first workload's first prompt), into the report."""
    if options.limit:
        with console.status("measuring memory bandwidth and weights per token"):
            report["limit"] = limit_report(Path(options.bundle), manifest, report["results"], options.threads)
    if options.memory:
        from bench.system import measure_memory

        first = next(iter(loaded.values()))[0]
        with console.status("measuring peak memory (one child process per mode)"):
            report["memory"] = measure_memory(
                options.bundle, options.threads, min(options.max_new_tokens, 32), _recommended_k(report), first
            )
        report["memory"]["engine_size_bytes"] = {
            "target": manifest.target.size_bytes,
            "draft": manifest.draft.size_bytes,
        }


def _compare_with_peers(options: BenchOptions, report: dict, manifest, workloads, cells, console) -> None:
    """The peers on the first ``peer_prompts`` prompts of each workload, beside our own figures on exactly those
    prompts (unless ``--no-peers``)."""
    if options.peers is False:
        return
    peer_workloads = {n: t[: options.peer_prompts] if options.peer_prompts else t for n, t in workloads.items()}
    best = report["best_k"]
    ours = ours_on_peer_prompts(cells, {n: len(t) for n, t in peer_workloads.items()}, best)
    report["peers"] = _run_peers(options, manifest, peer_workloads, best, ours, console)
    report["peers_reference"] = {w: {key: v for key, v in r.items() if key != "token_ids"} for w, r in ours.items()}
    report["settings"]["peer_prompts"] = options.peer_prompts
    report["settings"]["peer_spinning"] = options.peer_spinning


def _store_k(options: BenchOptions, report: dict) -> None:
    """``--write-k``: the recommended k becomes the bundle's default_k, and the report says so."""
    rec_k = _recommended_k(report)
    if options.write_k and rec_k is not None:
        write_default_k(Path(options.bundle), rec_k)
        report["recommended_k"]["written"] = True
        report["recommended_k"]["bundle_default_k"] = rec_k


def _show(console, report: dict, options: BenchOptions) -> None:
    """The tables, the summary and the plot (``--plot``), and where the files went."""
    render_table(console, report)
    render_summary(console, report)
    if options.json_out:
        console.print(f"report written to {options.json_out}")
    if options.plot_out:
        plot(report, options.plot_out)
        console.print(f"plot written to {options.plot_out}")


PEER_MODULES = ("transformers", "llama_cpp", "onnxruntime_genai", "openvino_genai")


def _after_first(steps: list[tuple]) -> list[tuple]:
    """The steps after the one that emitted a sequence's first token (its gap holds the prompt's prefill)."""
    first = next((i for i, (_, _, new, _) in enumerate(steps) if new), len(steps))
    return steps[first + 1 :]


def _prompt_texts(bundle: Path, workloads: dict[str, list[list[int]]]) -> dict[str, list[str]]:
    """The prompts as text (a tool that takes text tokenizes them again): our token ids decoded by the bundle's
    tokenizer, special tokens (a chat template's) kept."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(bundle) / "tokenizer" / "tokenizer.json"))
    return {
        w: [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts] for w, prompts in workloads.items()
    }


def ours_on_peer_prompts(cells: list[CellRecord], counts: dict[str, int], best: dict[str, dict]) -> dict[str, dict]:
    """Our own figures over exactly the prompts the peers decode (the first ``counts[w]`` of each workload), from the
    batch-1 cells: target-only tok/s and greedy ids, and speculative tok/s at the workload's best k.

    At batch 1 a prompt's steps' gaps add up to its decode time (prefill included), so a prefix of the prompts has
    its own tok/s."""

    def subset(mode, workload, k):
        for cell in cells:
            if (cell.workload, cell.batch, cell.mode, cell.k) == (workload, 1, mode, k):
                return cell.sequences[: counts[workload]]
        return None

    def rate(sequences):
        seconds = sum(gap for seq in sequences for *_, gap in seq.steps)
        return sum(seq.emitted for seq in sequences) / seconds if seconds else None

    def decode_rate(sequences):  # after each sequence's first token (llama.cpp's tools print this rate)
        later = [step for seq in sequences for step in _after_first(seq.steps)]
        seconds = sum(gap for *_, gap in later)
        return sum(new for _, _, new, _ in later) / seconds if seconds else None

    out = {}
    for workload in counts:
        target = subset("target", workload, None)
        if not target:
            continue
        plain = subset("plain", workload, None) or target  # peers are compared with our plain decoding
        k = best.get(workload, {}).get("k")
        spec = subset("speculative", workload, k) if k else None
        out[workload] = {
            "prompts": len(target),
            "target_tokens_per_second": rate(plain),
            "target_decode_tokens_per_second": decode_rate(plain),
            "speculative_decode_tokens_per_second": decode_rate(spec) if spec else None,
            "token_ids": [list(seq.token_ids) for seq in target],
            "k": k,
            "speculative_tokens_per_second": rate(spec) if spec else None,
            "speculative_identical_to_ours": (
                sum(a.token_ids == b.token_ids for a, b in zip(spec, target)) / len(target)
            )
            if spec
            else None,
        }
    return out


def quality_report(bundle: Path, threads: int, device, with_llama_cpp: bool, tokens: int) -> dict:
    """Perplexity on the evaluation set (bench/quality.py): ours, and llama.cpp's on the same file where it runs.
    The bundle is opened again here: the speed runs' engines were freed before the peers ran."""
    from bench import quality
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(bundle, threads=threads, device=device)
    windows = quality.windows(generator, tokens)
    out = {"eval_tokens": sum(len(w) for w in windows), "draftsmith": quality.ours(generator, windows)}
    if with_llama_cpp:
        from bench.peers.llama_cpp_peer import llama_cpp_perplexity

        row = llama_cpp_perplexity(generator.manifest, bundle, windows, threads)
        out["llama-cpp-python"] = row.get("perplexity", row.get("skipped"))
    return out


def _run_peers(options: BenchOptions, manifest, workloads, best, ours: dict[str, dict], console) -> list:
    """The peers' rows (``--peer``: only those named; ``--peers``: required even if none is installed), each
    compared with ``ours`` on the same prompts; greedy only."""
    from bench.peers.common import compare_with_ours
    from bench.peers.genai_peer import run_onnxruntime_genai
    from bench.peers.llama_cpp_peer import run_llama_cpp
    from bench.peers.openvino_peer import run_openvino
    from bench.peers.transformers_peer import run_transformers

    if options.temperature > 0:
        return [{"peer": "all", "skipped": "peers run greedy only; use --temperature 0"}]
    import importlib.util
    from bench.peers.llama_cpp_tools import PLAIN_TOOL, tool

    if not options.peers and all(importlib.util.find_spec(m) is None for m in PEER_MODULES) and not tool(PLAIN_TOOL):
        return [{"peer": "all", "skipped": "no peer installed (pip install draftsmith[peers])"}]
    bundle, tokens, threads = Path(options.bundle), options.max_new_tokens, options.threads
    consent = {"allow_pickle": options.allow_pickle, "trust_remote_code": options.trust_remote_code}
    ks = {w: r["k"] for w, r in best.items()}
    status = console.status("peers: loading") if not options.quiet else None
    note = (lambda text: status.update(f"peers: {text}")) if status else None
    if status:
        status.start()
    eos = manifest.eos_token_ids
    try:
        wanted = set(options.peer_names or PEER_NAMES)
        rows = []
        if "transformers" in wanted:
            rows += run_transformers(manifest, bundle, workloads, ks, tokens, threads, eos, note, **consent)
        if "llama.cpp" in wanted:  # its own C++ tools, as users run them
            from bench.peers.llama_cpp_tools import run_llama_cpp_tools

            rows += run_llama_cpp_tools(manifest, bundle, _prompt_texts(bundle, workloads), tokens, threads, note)
        if "llama-cpp-python" in wanted:
            rows += run_llama_cpp(manifest, bundle, workloads, ks, tokens, threads, eos, note)
        if "onnxruntime-genai" in wanted:
            rows += run_onnxruntime_genai(
                manifest, bundle, workloads, ks, tokens, threads, eos, note, **consent, spinning=options.peer_spinning
            )
        if "openvino" in wanted:
            rows += run_openvino(manifest, bundle, workloads, ks, tokens, threads, eos, note)
    finally:
        if status:
            status.stop()
    return compare_with_ours(rows, ours, eos)
