"""Peers measured in the same bench run, on the same prompt token ids, greedy, one sequence at a time (``pip install
draftsmith[peers]``; each peer is skipped, with the reason, when it is not installed or cannot run):

- **transformers**: plain ``generate`` and assisted generation with the bundle's draft (torch, fp32);
- **llama.cpp** (llama-cpp-python) on the bundle's GGUF source file as it is: plain decoding, and its prompt-lookup
  drafting (``LlamaPromptLookupDecoding``, the only drafter the Python bindings ship);
- **ONNX Runtime GenAI**: its own model-builder graphs of the same weights (fp32 and int4), plain, and its
  speculative decoding (``GeneratorParams.set_speculative_options``) with the bundle's draft built by the same
  builder. Graphs are cached under ``~/.cache/draftsmith/peers/<sha256 of the source weights>/`` (or
  ``$DRAFTSMITH_PEERS_CACHE``).

Every peer returns rows {"peer", "workload", "mode", "k", "prompts", "tokens", "wall_seconds", "tokens_per_second",
"speedup" (over that peer's own plain decoding), "token_ids" (one list per prompt)}, or a {"peer", "skipped"} row.
``compare_with_ours`` then adds the speedup over our target-only decoding and whether the greedy ids equal ours.
Times include each prompt's prefill, as the bench's own tokens/s do; the first prompt runs once untimed (warm-up).

Sources: a bundle names its checkpoints as the user typed them (``drafts/smollm2-135m-l4``); ``locate_checkpoint``
finds them from any working directory and checks their sha256 against the manifest, so a peer never measures other
weights than the bundle's. Reloading a pickled or remote-code checkpoint takes the bench's own flags, never the
manifest's record of the build's.
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
import time
from pathlib import Path
from typing import Callable

from runtime.bundle import Manifest, ModelEntry

CACHE_ENV = "DRAFTSMITH_PEERS_CACHE"
BUILDER_TIMEOUT_S = 1800  # the genai builder on a large checkpoint; a 135M model takes well under a minute


class PeerError(Exception):
    """A peer cannot run on this bundle; the message says why and what to do."""


def _skip(peer: str, reason: str) -> dict:
    return {"peer": peer, "skipped": reason}


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # GGUF dequantization bars would tear through the bench's own output
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# --- the bundle's sources -------------------------------------------------------------------------------------------

def source_candidates(entry: ModelEntry, bundle: Path) -> list[Path]:
    """Where the checkpoint of ``entry`` may be now, in order: its package (``pkg:``), the absolute path recorded at
    build time, then a relative source against each folder above the bundle (``bundles/x`` built from the project
    root: the grandparent) and the working directory. Candidates are only places to look: the caller checks the
    weights' sha256."""
    from builder.checkpoint import CheckpointError, _locate
    source = entry.source
    if entry.role == "draft" and (source == "self" or source.startswith("self:")):
        raise ValueError("a self draft has no checkpoint of its own: locate the target's")
    out: list[Path] = []
    if source.startswith("pkg:"):
        with contextlib.suppress(CheckpointError):
            out.append(_locate(source))
    if entry.source_resolved:
        out.append(Path(entry.source_resolved))
    typed = Path(source).expanduser()
    if not source.startswith("pkg:"):
        if typed.is_absolute():
            out.append(typed)
        else:
            out += [folder / typed for folder in Path(bundle).resolve().parents] + [Path.cwd() / typed]
    return list(dict.fromkeys(out))


def locate_checkpoint(entry: ModelEntry, bundle: Path, allow_pickle: bool = False, trust_remote_code: bool = False):
    """The checkpoint ``entry`` was built from, found from any working directory and checked by sha256.

    Raises PeerError naming every place tried when none holds the same weights."""
    from builder.checkpoint import CheckpointError, resolve
    tried = []
    for path in source_candidates(entry, bundle):
        if not path.exists():
            tried.append(f"{path} (missing)")
            continue
        try:
            checkpoint = resolve(str(path), allow_pickle, trust_remote_code)
        except CheckpointError as err:
            tried.append(f"{path} ({err})")
            continue
        if checkpoint.sha256() == entry.source_sha256:
            return checkpoint
        tried.append(f"{path} (other weights: sha256 differs from the manifest's)")
    raise PeerError(f"the {entry.role}'s source {entry.source!r} was not found: tried " + "; ".join(tried)
                    + ". Run the bench from the folder the bundle was built in, or put the checkpoint back.")


def _target_and_draft(manifest: Manifest, bundle: Path, consent: dict):
    """(target checkpoint, draft checkpoint or None for a self draft)."""
    target = locate_checkpoint(manifest.target, bundle, **consent)
    draft = manifest.spec.draft
    if draft == "self" or draft.startswith("self:"):
        return target, None
    return target, locate_checkpoint(manifest.draft, bundle, **consent)


def _self_layers(manifest: Manifest) -> int:
    """N of a ``self:layers=N`` draft, else 0."""
    option = manifest.spec.draft.partition(":")[2]
    return int(option[7:]) if option.startswith("layers=") else 0


# --- our own reference ----------------------------------------------------------------------------------------------

def strip_eos(ids: list[int], eos_ids) -> list[int]:
    """Greedy ids without a trailing end-of-sequence token (runtimes differ on whether they return it)."""
    ids = list(ids)
    while ids and ids[-1] in eos_ids:
        ids.pop()
    return ids


def compare_with_ours(rows: list[dict], ours: dict[str, dict], eos_ids) -> list[dict]:
    """Add ``speedup_vs_ours_target`` and ``identical_to_ours`` (the share of prompts whose greedy ids equal our
    target-only ids) to each peer row; ``ours`` is {workload: {"target_tokens_per_second", "token_ids"}} over the
    same prompts."""
    eos = set(eos_ids)
    for row in rows:
        mine = ours.get(row.get("workload"))
        ids = row.pop("token_ids", None)
        if "skipped" in row or mine is None:
            continue
        base = mine["target_tokens_per_second"]
        row["speedup_vs_ours_target"] = row["tokens_per_second"] / base if base else None
        if ids is not None and len(ids) == len(mine["token_ids"]):
            same = [strip_eos(a, eos) == strip_eos(b, eos) for a, b in zip(ids, mine["token_ids"])]
            row["identical_to_ours"] = sum(same) / len(same) if same else None
    return rows


def _timed_rows(peer: str, workload: str, prompts: list[list[int]], modes: dict[str, Callable], k: int,
                progress, **extra) -> list[dict]:
    """Run each mode's ``generate(ids) -> new ids`` over the prompts (the first one once more, untimed, first) and
    shape the rows; speedup is over the mode named "plain"."""
    results = {}
    for mode, generate in modes.items():
        tokens, wall, outputs = 0, 0.0, []
        for i, ids in enumerate([prompts[0]] + prompts):
            start = time.perf_counter()
            new = generate(ids)
            elapsed = time.perf_counter() - start
            if i == 0:
                continue
            outputs.append([int(t) for t in new])
            tokens += len(new)
            wall += elapsed
            if progress:
                progress(f"{peer} {mode} {workload}")
        results[mode] = {"prompts": len(prompts), "tokens": tokens, "wall_seconds": wall,
                         "tokens_per_second": tokens / wall if wall else 0.0, "token_ids": outputs}
    base = results.get("plain", {}).get("tokens_per_second")
    return [{"peer": peer, "workload": workload, "mode": mode, "k": None if mode == "plain" else k, **r,
             "speedup": r["tokens_per_second"] / base if base else None, **extra.get(mode, {})}
            for mode, r in results.items()]


# --- transformers ---------------------------------------------------------------------------------------------------

def transformers_assistant(manifest: Manifest, target, draft_checkpoint=None):
    """The assistant model for transformers' assisted generation, and a sentence saying what it is.

    - a checkpoint draft: that checkpoint (``draft_checkpoint``, located and checked by the caller);
    - ``self:layers=N``: the target's first N layers (shared weights), what the bundle's draft was built from;
    - ``self`` (the target re-quantized for the bundle): the target with its Linear layers dynamically quantized to
      int8 by torch (``quantize_dynamic``): the same weights at lower precision and lower cost, the nearest thing
      transformers runs on CPU to the bundle's int4 MatMulNBits self-draft (a plain fp32 copy would agree on every
      token but cost as much as the target, so it could never speed anything up).
    """
    from builder import build
    layers = _self_layers(manifest)
    if layers:
        return build._truncate(target, layers), f"the target's first {layers} layers (as the bundle's draft)"
    if draft_checkpoint is None:
        import warnings
        import torch
        from torch.ao.quantization import quantize_dynamic
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assistant = quantize_dynamic(copy.deepcopy(target), {torch.nn.Linear}, dtype=torch.qint8)
        return assistant, ("the target with torch dynamic int8 Linear layers (stands in for the bundle's int4 "
                           "self-draft, which transformers cannot run)")
    return draft_checkpoint.load_model(), f"the draft checkpoint {manifest.spec.draft}"


def run_transformers(manifest: Manifest, bundle: Path, workloads: dict[str, list[list[int]]],
                     best_k: dict[str, int], max_new_tokens: int, threads: int, eos_ids: tuple[int, ...],
                     progress: Callable[[str], None] | None = None, allow_pickle: bool = False,
                     trust_remote_code: bool = False) -> list[dict]:
    """Plain ``generate`` and ``generate(assistant_model=...)``, greedy, per workload.

    ``allow_pickle`` / ``trust_remote_code``: the caller's consent for reloading the source checkpoints (the
    manifest's record of the build's flags is never taken as consent)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return [_skip("transformers", "transformers/torch not installed (pip install draftsmith[peers])")]
    import torch
    _quiet_transformers()
    if threads:
        torch.set_num_threads(threads)
    consent = {"allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code}
    try:
        target_ckpt, draft_ckpt = _target_and_draft(manifest, bundle, consent)
        with contextlib.redirect_stderr(io.StringIO()):  # GGUF dequantization draws its own tqdm bars
            target = target_ckpt.load_model()
            assistant, what = (None, "") if is_feature_draft(manifest) else transformers_assistant(
                manifest, target, draft_ckpt)
    except PeerError as err:
        return [_skip("transformers", str(err))]
    except Exception as err:  # a peer failing must not sink the bench
        return [_skip("transformers", f"could not load the checkpoints: {type(err).__name__}: {err}")]
    eos = list(eos_ids) or None

    def generator(assisted: bool):
        def generate(ids):
            input_ids = torch.tensor([ids])
            options = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos[0] if eos else None, attention_mask=torch.ones_like(input_ids))
            if assisted:
                options["assistant_model"] = assistant
            with torch.inference_mode():
                return target.generate(input_ids, **options)[0, len(ids):].tolist()
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
        rows += _timed_rows("transformers", workload, prompts, modes, k, progress, assisted={"assistant": what})
    return rows


def is_feature_draft(manifest: Manifest) -> bool:
    """The bundle's draft reads the target's hidden states (runtime/features.py): peers get no draft mode."""
    return "features" in manifest.draft.input_names


# --- llama.cpp ------------------------------------------------------------------------------------------------------

def run_llama_cpp(manifest: Manifest, bundle: Path, workloads: dict[str, list[list[int]]], best_k: dict[str, int],
                  max_new_tokens: int, threads: int, eos_ids: tuple[int, ...] = (),
                  progress: Callable[[str], None] | None = None) -> list[dict]:
    """llama.cpp on the GGUF file the target was built from, as it is: plain decoding and its prompt-lookup drafting.

    llama-cpp-python's speculative decoding takes a ``LlamaDraftModel`` (a Python callback that proposes tokens);
    the only one it ships is ``LlamaPromptLookupDecoding``. llama.cpp's own draft-model speculation (a second model
    in ``common/speculative``) is not exposed by the bindings, so there is no llama.cpp row with a draft model."""
    if not manifest.spec.target.endswith(".gguf"):
        return [_skip("llama.cpp", "the bundle's target is not a GGUF file")]
    if importlib.util.find_spec("llama_cpp") is None:
        return [_skip("llama.cpp", "llama_cpp is not installed (pip install llama-cpp-python diskcache; it builds "
                                   "from source, ~7 minutes on 2 cores)")]
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        checkpoint = locate_checkpoint(manifest.target, bundle)
        path = str(checkpoint.folder / checkpoint.gguf_file)
    except (PeerError, ImportError) as err:
        return [_skip("llama.cpp", str(err))]
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    rows = []
    for workload, prompts in workloads.items():
        k = best_k.get(workload) or manifest.default_k
        models = {"plain": None, "prompt-lookup": LlamaPromptLookupDecoding(num_pred_tokens=k)}
        for mode, draft in models.items():
            llm = Llama(model_path=path, n_threads=threads or None, n_threads_batch=threads or None,
                        n_ctx=longest + max_new_tokens + 8, draft_model=draft, verbose=False)
            rows += _timed_rows("llama.cpp", workload, prompts,
                                {mode: _llama_generate(llm, max_new_tokens, set(eos_ids) | {llm.token_eos()})},
                                k, progress)
            del llm
        plain = rows[-2]["tokens_per_second"]
        rows[-1]["speedup"] = rows[-1]["tokens_per_second"] / plain if plain else None
    return rows


def _llama_generate(llm, max_new_tokens: int, eos: set[int]):
    """Greedy ids from ``Llama.generate`` (the loop that consults the draft model), stopping at EOS or the limit.
    ``reset()`` first: ``generate`` would otherwise reuse the cache of a previous prompt's matching prefix and skip
    that prefill (the warm-up runs the first prompt twice)."""
    def generate(ids):
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in eos or len(out) >= max_new_tokens:
                break
        return out
    return generate


# --- ONNX Runtime GenAI ---------------------------------------------------------------------------------------------

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
        from builder import build
        _quiet_transformers()
        with contextlib.redirect_stderr(io.StringIO()):
            model = checkpoint.load_model()
            tokenizer = checkpoint.load_tokenizer()
        if layers:
            model = build._truncate(model, layers)
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
            command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
                       "-p", precision, "-e", "cpu", "-c", scratch]
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILDER_TIMEOUT_S,
                                  cwd=scratch)
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
        raise PeerError(f"ONNX Runtime GenAI speculative decoding needs one vocabulary; the draft's has "
                        f"{draft_cfg['model'].get('vocab_size')} entries, the target's {target_cfg['model'].get('vocab_size')}")
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
    default) and, unless ``spinning``, ONNX Runtime's thread spinning off, as our own engines run (genai passes
    string-valued keys through as session config entries; with two sessions taking turns on few cores, spinning
    threads cost several times the work)."""
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
        return [int(t) for t in generator.get_sequence(0)[len(ids):]]
    return generate


def _speculative_summary(stats: list[dict]) -> dict:
    """Acceptance over the timed prompts (the first entry is the warm-up), from ONNX Runtime GenAI's counters."""
    timed = stats[1:]
    total = {key: sum(s.get(key, 0) for s in timed) for key in
             ("draft_tokens_proposed", "draft_tokens_evaluated", "draft_tokens_accepted", "rounds",
              "draft_forward_passes", "target_forward_passes")}
    evaluated = total["draft_tokens_evaluated"]
    total["acceptance_rate"] = total["draft_tokens_accepted"] / total["draft_tokens_proposed"] \
        if total["draft_tokens_proposed"] else 0.0
    total["alpha"] = total["draft_tokens_accepted"] / evaluated if evaluated else 0.0
    return total


def genai_graphs(manifest: Manifest, bundle: Path, consent: dict, progress=None) -> dict:
    """Build (or reuse from the cache) ONNX Runtime GenAI's graphs for this bundle: {"fp32": dir, "int4": dir,
    "draft": dir, "draft_what": sentence}."""
    target_ckpt, draft_ckpt = _target_and_draft(manifest, bundle, consent)
    if progress:
        progress("onnxruntime-genai: building graphs (cached)")
    target_hf = hf_folder(target_ckpt, manifest.target.source_sha256)
    graphs = {p: genai_graph(target_hf, p) for p in ("fp32", "int4")}
    draft_precision = "fp32" if manifest.draft.quant == "fp32" else "int4"
    layers = _self_layers(manifest)
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


def run_onnxruntime_genai(manifest: Manifest, bundle: Path, workloads: dict[str, list[list[int]]],
                          best_k: dict[str, int], max_new_tokens: int, threads: int, eos_ids: tuple[int, ...] = (),
                          progress: Callable[[str], None] | None = None, allow_pickle: bool = False,
                          trust_remote_code: bool = False, spinning: bool = False) -> list[dict]:
    """ONNX Runtime GenAI on its own builder graphs of the bundle's weights: fp32 and int4 targets, each plain and
    speculative with the bundle's draft (built by the same builder); ``spinning``: leave ONNX Runtime's thread
    spinning on (its default) instead of off."""
    peer = "onnxruntime-genai"
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return [_skip(peer, "onnxruntime-genai is not installed (pip install draftsmith[peers])")]
    import onnxruntime_genai as og
    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        return [_skip(peer, f"onnxruntime-genai {og.__version__} has no speculative decoding; upgrade to >= 0.18")]
    consent = {"allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code}
    try:
        graphs = genai_graphs(manifest, bundle, consent, progress)
    except (PeerError, subprocess.TimeoutExpired) as err:
        return [_skip(peer, str(err))]
    except Exception as err:  # a peer failing must not sink the bench
        return [_skip(peer, f"could not build its graphs: {type(err).__name__}: {err}")]
    rows = []
    for precision in ("fp32", "int4"):
        name = f"{peer} {precision}"
        try:
            plain = _genai_model(graphs[precision], threads, eos_ids, spinning)
            spec = graphs["draft"] and _genai_model(speculative_config(graphs[precision], graphs["draft"]), threads,
                                                    eos_ids, spinning)
        except Exception as err:
            rows.append(_skip(name, f"{type(err).__name__}: {err}"))
            continue
        for workload, prompts in workloads.items():
            k = best_k.get(workload) or manifest.default_k
            stats: list[dict] = []
            modes = {"plain": _genai_generate(plain, max_new_tokens)}
            if spec:
                modes["speculative"] = _genai_generate(spec, max_new_tokens, k, stats)
            try:
                mine = _timed_rows(name, workload, prompts, modes, k, progress,
                                   speculative={"draft": graphs["draft_what"]})
            except Exception as err:
                rows.append(_skip(name, f"{workload}: {type(err).__name__}: {err}"))
                continue
            if spec:
                mine[1]["speculative_stats"] = _speculative_summary(stats)
            for row in mine:
                row["session_options"] = genai_session_options(threads, spinning)
            rows += mine
        del plain, spec
    return rows
