"""ONNX Runtime GenAI as a peer: its own model-builder graphs of the same weights (fp32 and int4), plain, and its
speculative decoding (``GeneratorParams.set_speculative_options``) with the bundle's draft built by the same builder.
Graphs are cached under ``~/.cache/draftsmith/peers/<sha256 of the source weights>/`` (or ``$DRAFTSMITH_PEERS_CACHE``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
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

CACHE_ENV = "DRAFTSMITH_PEERS_CACHE"
BUILDER_TIMEOUT_S = 1800  # the genai builder on a large checkpoint; a 135M model takes well under a minute


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "draftsmith" / "peers")


def _publish(build: Callable[[Path], None], out: Path) -> Path:
    """Run ``build(tmp)`` into a fresh folder beside ``out`` and rename it into place (a crash leaves no half
    cache entry; a concurrent winner is kept)."""
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def hf_folder(checkpoint, sha256: str, layers: int = 0) -> Path:
    """A safetensors Hugging Face folder of ``checkpoint`` (its first ``layers`` layers when > 0), what the genai
    builder reads; for a GGUF the dequantized weights (FACTS: drop ``hf_quantizer`` and ``quantization_config``)."""

    def save(tmp: Path) -> None:
        from builder.model_surgery import truncate

        quiet_transformers()
        with contextlib.redirect_stderr(io.StringIO()):
            model = checkpoint.load_model()
            tokenizer = checkpoint.load_tokenizer()
        if layers:
            model = truncate(model, layers)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))

    return _publish(save, cache_root() / sha256 / (f"hf-layers{layers}" if layers else "hf"))


def genai_graph(hf: Path, precision: str) -> Path:
    """ONNX Runtime GenAI's own builder graph of the HF folder ``hf`` at ``precision`` (fp32 or int4), for CPU."""
    import onnxruntime_genai as og

    def run_builder(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(dir=tmp.parent) as scratch:
            command = [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-i",
                str(hf),
                "-o",
                str(tmp),
                "-p",
                precision,
                "-e",
                "cpu",
                "-c",
                scratch,
            ]
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILDER_TIMEOUT_S, cwd=scratch)
        if done.returncode != 0 or not (tmp / "genai_config.json").is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PeerError(f"the onnxruntime-genai builder failed on {hf} ({precision}): " + " | ".join(tail))

    return _publish(run_builder, hf.parent / f"genai-{og.__version__}-{hf.name}-{precision}")


def speculative_config(target: Path, draft: Path) -> Path:
    """A composite genai folder: the target's genai_config.json with the draft's decoder block as ``model.draft``
    (ONNX Runtime GenAI's base speculative decoding). genai 0.18 refuses ``..`` in a config's file names, so the
    two graphs' files are hard-linked (copied where links fail) into ``target/`` and ``draft/`` inside it."""
    target_cfg = json.loads((target / "genai_config.json").read_text(encoding="utf-8"))
    draft_cfg = json.loads((draft / "genai_config.json").read_text(encoding="utf-8"))
    if target_cfg["model"].get("vocab_size") != draft_cfg["model"].get("vocab_size"):
        raise PeerError(
            f"ONNX Runtime GenAI speculative decoding needs one vocabulary; the draft's has "
            f"{draft_cfg['model'].get('vocab_size')} entries, the target's "
            f"{target_cfg['model'].get('vocab_size')}"
        )
    out = target.parent / f"spec-{target.name}--{draft.parent.name[:16]}-{draft.name}"

    def write(tmp: Path) -> None:
        config = copy.deepcopy(target_cfg)
        config["model"]["draft"] = copy.deepcopy(draft_cfg["model"]["decoder"])
        for role, section, source in (("target", "decoder", target), ("draft", "draft", draft)):
            _link_tree(source, tmp / role)
            block = config["model"][section]
            block["filename"] = f"{role}/{block['filename']}"
        (tmp / "genai_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        for name in os.listdir(target):  # the tokenizer files genai loads with the model
            if name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(target / name, tmp / name)

    return _publish(write, out)


def _link_tree(source: Path, dest: Path) -> None:
    dest.mkdir()
    for path in source.iterdir():
        if path.is_file():
            try:
                os.link(path, dest / path.name)
            except OSError:
                shutil.copy2(path, dest / path.name)


def genai_session_options(threads: int, spinning: bool) -> dict:
    """genai_config ``session_options`` for every session: intra-op threads = the bench's --threads (0: genai's
    default) and, unless ``spinning`` (genai's own default, the bench's too), ONNX Runtime's thread spinning off
    (genai passes string-valued keys through as session config entries)."""
    options: dict = {"intra_op_num_threads": threads} if threads else {}
    if not spinning:
        options["session.intra_op.allow_spinning"] = "0"
        options["session.inter_op.allow_spinning"] = "0"
    return options


def _genai_model(folder: Path, threads: int, eos_ids: tuple[int, ...], spinning: bool = False):
    """og.Model over ``folder`` with ``genai_session_options`` on every session (target and draft) and the bundle's
    EOS ids, through a config overlay (the cached files stay as the builder wrote them)."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    cfg = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    model: dict = {}
    if eos_ids:
        model["eos_token_id"] = list(eos_ids)
    options = genai_session_options(threads, spinning)
    if options:
        for section in ("decoder", "draft"):
            if section in cfg["model"]:
                model[section] = {"session_options": options}
    if model:
        config.overlay(json.dumps({"model": model}))
    return og.Model(config)


def _genai_generate(model, max_new_tokens: int, k: int | None = None, stats: list | None = None):
    """Greedy ids from an og.Generator; with ``k``, ONNX Runtime GenAI's speculative decoding with the model's
    configured draft (``set_speculative_options(max_draft_tokens=k)``, fixed width); its stats go to ``stats``."""
    import numpy as np
    import onnxruntime_genai as og

    def generate(ids):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        if k:
            params.set_speculative_options(max_draft_tokens=k)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        if k and stats is not None:
            stats.append(dict(generator.get_speculative_stats()))
        return [int(t) for t in generator.get_sequence(0)[len(ids) :]]

    return generate


def _speculative_summary(stats: list[dict]) -> dict:
    """Acceptance over the timed prompts (the first entry is the warm-up), from ONNX Runtime GenAI's counters."""
    timed = stats[1:]
    total = {
        key: sum(s.get(key, 0) for s in timed)
        for key in (
            "draft_tokens_proposed",
            "draft_tokens_evaluated",
            "draft_tokens_accepted",
            "rounds",
            "draft_forward_passes",
            "target_forward_passes",
        )
    }
    evaluated = total["draft_tokens_evaluated"]
    total["acceptance_rate"] = (
        total["draft_tokens_accepted"] / total["draft_tokens_proposed"] if total["draft_tokens_proposed"] else 0.0
    )
    total["alpha"] = total["draft_tokens_accepted"] / evaluated if evaluated else 0.0
    return total


def genai_graphs(manifest: Manifest, bundle: Path, consent: dict, progress=None) -> dict:
    """Build (or reuse from the cache) ONNX Runtime GenAI's graphs for this bundle: {"fp32": dir, "int4": dir,
    "draft": dir, "draft_what": sentence}."""
    target_ckpt, draft_ckpt = target_and_draft(manifest, bundle, consent)
    if progress:
        progress("onnxruntime-genai: building graphs (cached)")
    target_hf = hf_folder(target_ckpt, manifest.target.source_sha256)
    graphs = {p: genai_graph(target_hf, p) for p in ("fp32", "int4")}
    draft_precision = "fp32" if manifest.draft.quant == "fp32" else "int4"
    layers = self_layers(manifest)
    if is_feature_draft(manifest):
        graphs["draft"], graphs["draft_what"] = None, ""  # no peer can run a draft reading our hidden states
    elif draft_ckpt is not None:
        graphs["draft"] = genai_graph(hf_folder(draft_ckpt, manifest.draft.source_sha256), draft_precision)
        graphs["draft_what"] = f"the draft checkpoint {manifest.spec.draft} ({draft_precision}, full output head)"
    elif layers:
        graphs["draft"] = genai_graph(hf_folder(target_ckpt, manifest.target.source_sha256, layers), draft_precision)
        graphs["draft_what"] = f"the target's first {layers} layers ({draft_precision})"
    else:
        graphs["draft"] = graphs[draft_precision]
        graphs["draft_what"] = f"the target itself ({draft_precision}), as the bundle's self-draft"
    return graphs


def run_onnxruntime_genai(
    manifest: Manifest,
    bundle: Path,
    workloads: dict[str, list[list[int]]],
    best_k: dict[str, int],
    max_new_tokens: int,
    threads: int,
    eos_ids: tuple[int, ...] = (),
    progress: Callable[[str], None] | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    spinning: bool = False,
) -> list[dict]:
    """ONNX Runtime GenAI on its own builder graphs of the bundle's weights: fp32 and int4 targets, each plain and
    speculative with the bundle's draft (built by the same builder); ``spinning``: leave ONNX Runtime's thread
    spinning on (its default) instead of off."""
    peer = "onnxruntime-genai"
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return [skip(peer, "onnxruntime-genai is not installed (pip install draftsmith[peers])")]
    import onnxruntime_genai as og

    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        return [skip(peer, f"onnxruntime-genai {og.__version__} has no speculative decoding; upgrade to >= 0.18")]
    consent = {"allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code}
    try:
        graphs = genai_graphs(manifest, bundle, consent, progress)
    except (PeerError, subprocess.TimeoutExpired) as err:
        return [skip(peer, str(err))]
    except Exception as err:  # a peer failing must not sink the bench
        return [skip(peer, f"could not build its graphs: {type(err).__name__}: {err}")]
    rows = []
    for precision in ("fp32", "int4"):
        name = f"{peer} {precision}"
        try:
            plain = _genai_model(graphs[precision], threads, eos_ids, spinning)
            spec = graphs["draft"] and _genai_model(
                speculative_config(graphs[precision], graphs["draft"]), threads, eos_ids, spinning
            )
        except Exception as err:
            rows.append(skip(name, f"{type(err).__name__}: {err}"))
            continue
        for workload, prompts in workloads.items():
            k = best_k.get(workload) or manifest.default_k
            stats: list[dict] = []
            modes = {"plain": _genai_generate(plain, max_new_tokens)}
            if spec:
                modes["speculative"] = _genai_generate(spec, max_new_tokens, k, stats)
            try:
                mine = timed_rows(
                    name, workload, prompts, modes, k, progress, speculative={"draft": graphs["draft_what"]}
                )
            except Exception as err:
                rows.append(skip(name, f"{workload}: {type(err).__name__}: {err}"))
                continue
            if spec:
                mine[1]["speculative_stats"] = _speculative_summary(stats)
            for row in mine:
                row["session_options"] = genai_session_options(threads, spinning)
            rows += mine
        del plain, spec
    return rows
