"""``draftsmith bench``: measure speculative decoding against target-only decoding on the same engines, in the same
run, over a k sweep and prompt workloads; compare with Leviathan et al.'s prediction, the memory bandwidth bound and
peers; recommend (and optionally store) the bundle's default k.

The command and its run in phases, each in a module of its own: the prompts (bench/workloads.py), the settings
(bench/bench_options.py), the drafters compared (bench/drafter_list.py), the sweep (bench/sweep.py), the report's
JSON (bench/speed_report.py; its math bench/stats.py, its tables bench/report.py), the peers (bench/peers/run.py)
and the one write into the bundle (bench/default_k.py, ``--write-k``). How a measurement runs: bench/sweep.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import click

from bench.bench_options import BenchOptions
from bench.default_k import store_recommended_k
from bench.drafter_list import drafter_labels, drafters_of
from bench.peers.run import PEER_NAMES, compare_with_peers
from bench.report import plot, render_summary, render_table
from bench.speed_report import limit_report, recommended_k, report_saver, speed_report
from bench.sweep import pads, run_workloads
from bench.workloads import CHAT_BY_DEFAULT, load_workload
from runtime.engines.sessions import DEVICES, DeviceError


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


# --- the command ----------------------------------------------------------------------------------------------------


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
    report = speed_report(options, generator.manifest, workloads, chat_used, ks, batches, response_format, cells)
    manifest = generator.manifest
    del generator  # free the engines before the child processes load their own
    save = report_saver(report, options.json_out, started)
    save(False)
    _measure_limit_and_memory(options, report, manifest, loaded, console)
    save(False)
    compare_with_peers(options, report, manifest, workloads, cells, console)
    if options.quality:
        report["quality"] = quality_report(
            Path(options.bundle),
            options.threads,
            options.device,
            options.peers is not False and (not options.peer_names or "llama-cpp-python" in options.peer_names),
            options.quality_tokens,
        )
        save(False)
    if options.write_k:  # the bundle's default_k: the bench's one write into it
        store_recommended_k(Path(options.bundle), report)
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
                options.bundle, options.threads, min(options.max_new_tokens, 32), recommended_k(report), first
            )
        report["memory"]["engine_size_bytes"] = {
            "target": manifest.target.size_bytes,
            "draft": manifest.draft.size_bytes,
        }


def _show(console, report: dict, options: BenchOptions) -> None:
    """The tables, the summary and the plot (``--plot``), and where the files went."""
    render_table(console, report)
    render_summary(console, report)
    if options.json_out:
        console.print(f"report written to {options.json_out}")
    if options.plot_out:
        plot(report, options.plot_out)
        console.print(f"plot written to {options.plot_out}")


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
