"""The bench's peers phase: which peers run (``--peer``), our own figures on exactly the prompts they decode, and
their rows compared with ours; the peers themselves are one module each in this package."""

from __future__ import annotations

from pathlib import Path

from bench.bench_options import BenchOptions
from bench.stats import CellRecord

# the peers rows are named by (--peer)
PEER_NAMES = ("transformers", "llama.cpp", "llama-cpp-python", "onnxruntime-genai", "openvino")
PEER_MODULES = ("transformers", "llama_cpp", "onnxruntime_genai", "openvino_genai")


def compare_with_peers(options: BenchOptions, report: dict, manifest, workloads, cells, console) -> None:
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
