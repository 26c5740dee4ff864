"""llama.cpp as users run it: its own C++ tools, not a Python loop around its bindings.

- plain decoding: ``llama-completion`` (in this llama.cpp ``llama-cli`` is chat-only), greedy, stopping at EOS;
- its draft-model speculation: ``llama-speculative-simple --spec-type draft-simple`` with the bundle's draft where
  that is a GGUF file of its own, swept over ``--spec-draft-n-max`` and ``--spec-draft-p-min`` (its best setting
  is the row a comparison should take);
- its n-gram speculation (``--spec-type ngram-simple`` and ``ngram-mod``, its strongest on code), which needs no
  draft model.

The tools are found in ``$LLAMA_CPP_BIN`` or on PATH. Build them from the llama.cpp source that llama-cpp-python's
source package vendors (docs/benchmarks.md has the cmake line; ~10-15 minutes on 2 cores). Each prompt is given as
text (the bundle's tokenizer decodes our prompt ids; llama.cpp tokenizes it again) in a file (``-f``), one process
a prompt, and the figures are those the tools print: ``prompt eval time`` (the first token's wait), ``eval time``
over its runs (the decode rate after the first token) and, for the speculative tool, ``decoded N tokens in S
seconds`` (prompt encoding excluded, as its own line says) and ``accept``. Output: ``run_llama_cpp_tools`` rows
with ``decode_tokens_per_second``, ``ttft_seconds`` and ``tokens_per_second`` (new tokens over prompt + decode).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from bench.peers.common import PeerError, locate_checkpoint, skip
from runtime.bundle import Manifest

PEER = "llama.cpp"
BIN_ENV = "LLAMA_CPP_BIN"
PLAIN_TOOL, SPECULATIVE_TOOL = "llama-completion", "llama-speculative-simple"
DRAFT_SWEEP = ((2, 0.0), (4, 0.0), (8, 0.75))  # (--spec-draft-n-max, --spec-draft-p-min): the best ones
TIMEOUT_S = 600
_MS = r"=\s*([\d.]+) ms /\s*(\d+)"
PROMPT_EVAL = re.compile(r"prompt eval time " + _MS)
EVAL = re.compile(r"(?<!prompt )eval time " + _MS)
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"accept\s*=\s*([\d.]+)%")


def tool(name: str) -> Path | None:
    """The llama.cpp tool ``name`` in $LLAMA_CPP_BIN, else on PATH; None where neither has it."""
    folder = os.environ.get(BIN_ENV)
    if folder and (Path(folder) / name).is_file():
        return Path(folder) / name
    found = shutil.which(name)
    return Path(found) if found else None


def run_llama_cpp_tools(
    manifest: Manifest,
    bundle: Path,
    prompts: dict[str, list[str]],
    max_new_tokens: int,
    threads: int,
    progress: Callable[[str], None] | None = None,
    sweep: tuple[tuple[int, float], ...] = DRAFT_SWEEP,
) -> list[dict]:
    """Rows for llama.cpp's plain, draft-model and n-gram decoding of ``prompts`` ({workload: prompt texts}) on the
    bundle's GGUF target (and its GGUF draft, where the draft is one), or skip rows saying why."""
    plain, speculative = tool(PLAIN_TOOL), tool(SPECULATIVE_TOOL)
    if plain is None:
        return [
            skip(
                PEER,
                f"{PLAIN_TOOL} not found in ${BIN_ENV} or on PATH: build llama.cpp's tools "
                "(docs/benchmarks.md, 'llama.cpp's own tools')",
            )
        ]
    try:
        target = _gguf(manifest.target, bundle)
    except PeerError as err:
        return [skip(PEER, str(err))]
    draft = _separate_gguf_draft(manifest, bundle)
    modes: dict[str, list[str]] = {"plain": []}
    if speculative is not None:
        modes["ngram-simple"] = ["--spec-type", "ngram-simple"]
        modes["ngram-mod"] = ["--spec-type", "ngram-mod"]
        if draft is not None:
            for n_max, p_min in sweep:
                modes[f"draft n-max {n_max} p-min {p_min:g}"] = [
                    "--spec-type",
                    "draft-simple",
                    "-md",
                    str(draft),
                    "--spec-draft-n-max",
                    str(n_max),
                    "--spec-draft-p-min",
                    str(p_min),
                    "-td",
                    str(threads or os.cpu_count() or 1),
                ]
    rows = []
    for workload, texts in prompts.items():
        for mode, extra in modes.items():
            binary = plain if mode == "plain" else speculative
            runs = [_run(binary, target, text, max_new_tokens, threads, extra) for text in [texts[0], *texts]][1:]
            rows.append(_row(workload, mode, runs))
            if progress:
                progress(f"{PEER} {mode} {workload}")
    return rows


def _gguf(entry, bundle: Path) -> Path:
    checkpoint = locate_checkpoint(entry, bundle)
    if not checkpoint.gguf_file:
        raise PeerError(f"the {entry.role} {entry.source!r} is not a GGUF file")
    return checkpoint.folder / checkpoint.gguf_file


def _separate_gguf_draft(manifest: Manifest, bundle: Path) -> Path | None:
    """The draft's GGUF file where the draft is another GGUF model (llama.cpp's draft-model speculation needs one);
    None for self-drafts, feature drafts and HF folders."""
    if manifest.draft.source_sha256 == manifest.target.source_sha256 or not manifest.draft.source.endswith(".gguf"):
        return None
    try:
        return _gguf(manifest.draft, bundle)
    except PeerError:
        return None


def _run(binary: Path, model: Path, text: str, max_new_tokens: int, threads: int, extra: list[str]) -> dict:
    """One process over one prompt: the figures it prints."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as handle:
        handle.write(text)
    t = str(threads or os.cpu_count() or 1)
    command = [
        str(binary),
        "-m",
        str(model),
        "-f",
        handle.name,
        "-n",
        str(max_new_tokens),
        "-t",
        t,
        "-tb",
        t,
        "--temp",
        "0",
        "-c",
        "4096",
        *extra,
    ]
    if binary.name == PLAIN_TOOL:
        command += ["-no-cnv", "--no-display-prompt"]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, stdin=subprocess.DEVNULL
        )
    finally:
        os.unlink(handle.name)
    if done.returncode:
        raise PeerError(f"{binary.name} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return parse(done.stdout + done.stderr, binary.name == PLAIN_TOOL)


def parse(log: str, plain: bool) -> dict:
    """{"new_tokens", "ttft_seconds", "decode_seconds", "accept"} from a tool's log (plain: llama-completion's
    perf lines, where the first new token comes with the prompt pass and each later one is an eval run)."""
    if plain:
        prompt, runs = PROMPT_EVAL.search(log), EVAL.search(log)
        if not prompt or not runs:
            raise PeerError("llama-completion printed no 'prompt eval time' / 'eval time' lines")
        return {
            "new_tokens": int(runs.group(2)) + 1,
            "ttft_seconds": float(prompt.group(1)) / 1000,
            "decode_seconds": float(runs.group(1)) / 1000,
            "decode_tokens": int(runs.group(2)),
            "accept": None,
        }
    decoded, encoded, accept = DECODED.search(log), ENCODED.search(log), ACCEPT.search(log)
    if not decoded or not encoded:
        raise PeerError("llama-speculative-simple printed no 'encoded' / 'decoded' lines")
    return {
        "new_tokens": int(decoded.group(1)),
        "ttft_seconds": float(encoded.group(2)),
        "decode_seconds": float(decoded.group(2)),
        "decode_tokens": int(decoded.group(1)),
        "accept": float(accept.group(1)) / 100 if accept else None,
    }


def _row(workload: str, mode: str, runs: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in runs)
    decode = sum(r["decode_seconds"] for r in runs)
    ttft = sum(r["ttft_seconds"] for r in runs)
    accepts = [r["accept"] for r in runs if r["accept"] is not None]
    n_max = re.search(r"n-max (\d+)", mode)
    return {
        "peer": PEER,
        "workload": workload,
        "mode": mode,
        "k": int(n_max.group(1)) if n_max else None,
        "prompts": len(runs),
        "tokens": tokens,
        "wall_seconds": ttft + decode,
        "tokens_per_second": tokens / (ttft + decode) if ttft + decode else 0.0,
        "decode_tokens_per_second": sum(r["decode_tokens"] for r in runs) / decode if decode else 0.0,
        "ttft_seconds": ttft / len(runs),
        "acceptance": sum(accepts) / len(accepts) if accepts else None,
    }
