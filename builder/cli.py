"""build-engines: the command line over builder.build (a thin layer; the library holds the defaults)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import click

from runtime.bundle import DRAFT_BLOCKS, QUANTS, BuildSpec, BundleError, SpecError, from_dict, load_manifest
from runtime.drafter_names import DRAFTERS
from runtime.presets import load_preset


def load_config(path: Path) -> dict:
    """The preset at ``path`` (runtime.presets), or a usage error saying why it cannot be read."""
    try:
        return load_preset(path)
    except SpecError as err:
        raise click.UsageError(str(err)) from None


def spec_from(config: dict, overrides: dict) -> tuple[BuildSpec, str | None]:
    data = {**config, **{k: v for k, v in overrides.items() if v is not None}}
    out = data.pop("out", None)
    data.pop("distill", None)  # the draft's recipe: `draftsmith distill --config` reads it, the build does not
    draft = str(data.get("draft", ""))
    if draft.startswith("self:") and not draft.startswith("self:layers=") and "draft_quant" not in data:
        data["draft_quant"] = draft.partition(":")[2]  # --draft self:int4 means the target re-quantized to int4
    try:
        return from_dict(BuildSpec, data), out
    except (TypeError, SpecError) as err:
        raise click.UsageError(str(err)) from None


class DefaultGroup(click.Group):
    """`build-engines --target ...` builds; `build-engines inspect BUNDLE` inspects."""

    def parse_args(self, ctx, args):
        if args and args[0] in self.commands:
            ctx.meta["subcommand"] = True
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Preset YAML (see configs/); flags given here override it.",
)
@click.option("--target", help="Target checkpoint: HF folder, .gguf file, or pkg:PACKAGE/FILE.")
@click.option("--draft", help="Draft checkpoint, 'self' (target re-quantized) or 'self:layers=N'.")
@click.option(
    "--target-quant",
    type=click.Choice(QUANTS),
    help="Target engine weights (TensorRT-LLM: fp16 default; int4_awq/int8_sq/w4a8_awq/fp8 via ModelOpt).",
)
@click.option("--draft-quant", type=click.Choice(QUANTS), help="Draft engine weights (TensorRT-LLM: int4_awq default).")
@click.option("--k", type=int, help="Default draft tokens per verify step.")
@click.option(
    "--drafter",
    type=click.Choice(DRAFTERS),
    help="The runtime's default drafter: the draft engine (model), n-gram lookup (prompt_lookup), a suffix "
    "trie over the context (suffix), hybrid / hybrid_suffix (lookup or suffix where the context "
    "matches, the engine elsewhere), or, for a draft with another tokenizer, tli (the tokens both "
    "share; its default) / string (its text re-tokenized).",
)
@click.option(
    "--draft-confidence",
    type=float,
    help="The runtime's default draft confidence: after its first token a draft row stops where the "
    "draft's top probability is under this (0: never), so a larger k drafts further only where sure.",
)
@click.option("--block-size", type=int, help="Quantization block size (16..256).")
@click.option("--symmetric/--asymmetric", default=None, help="Symmetric weight quantization.")
@click.option("--accuracy-level", type=int, help="MatMulNBits accuracy level 0..4 (4: int8 compute, fastest).")
@click.option(
    "--gguf-kernel",
    type=click.Choice(["auto", "native", "matmulnbits"]),
    help="quant gguf: multiply by the file's blocks with Draftsmith's GgufMatMul (native: the file's bytes; built "
    "by setup.sh) or ONNX Runtime's MatMulNBits (~1.5x the bytes). auto (default): native where it is built.",
)
@click.option(
    "--draft-blocks",
    type=click.Choice(DRAFT_BLOCKS),
    help="A GGUF draft (--draft-quant gguf): its file's own blocks (file, default) or re-quantized into the "
    "kernel's 4-bit blocks (q4_0: ~half the bytes a token of an 8-bit-ish file; acceptance moves, output never).",
)
@click.option(
    "--draft-head",
    type=int,
    help="A GGUF draft's head over the N most frequent target tokens only (0: all; e.g. 32768).",
)
@click.option(
    "--allow-slow-draft",
    is_flag=True,
    default=None,
    help="Build a draft whose one-token call measures as costly as the target's or more (refused otherwise: "
    "speculation with it is slower than the target alone).",
)
@click.option("--max-context", type=int, help="Cap the context (default: the pair's usable maximum).")
@click.option(
    "--eval-tokens",
    type=int,
    help="Tokens of the evaluation set the build report scores (default 0: all, ~25,000; fewer is faster).",
)
@click.option("--opset", type=int, help="ONNX opset.")
@click.option(
    "--graph",
    type=click.Choice(["fused", "export"]),
    help="Engine graph: fused (ONNX Runtime's fused CPU operators; the CPU default) or export (torch's "
    "decoder op by op; the CUDA default).",
)
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt_llm"]), help="Engine backend.")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    help="Device the engines are built for. onnxruntime: cpu = fp32/int8/int4 engines; cuda = fp16/int8/int4 "
    "engines for onnxruntime-gpu's CUDA and TensorRT execution providers (built and checked on any "
    "machine; the target defaults to fp16).",
)
@click.option("--allow-pickle", is_flag=True, default=None, help="Accept pickled .bin/.pt weights (can run code).")
@click.option("--trust-remote-code", is_flag=True, default=None, help="Run a checkpoint's own modelling code.")
@click.option(
    "--trtllm-flavor",
    type=click.Choice(["engine", "llmapi"]),
    help="TensorRT-LLM workflow: trtllm-build engines or the LLM API (default: from the installed version).",
)
@click.option("--tp-size", type=int, help="TensorRT-LLM tensor parallel GPUs per engine.")
@click.option("--pp-size", type=int, help="TensorRT-LLM pipeline parallel GPUs per engine.")
@click.option("--max-batch-size", type=int, help="TensorRT-LLM: sequences decoded together.")
@click.option("--max-input-len", type=int, help="TensorRT-LLM: longest prompt (default max_seq_len - 1).")
@click.option("--max-seq-len", type=int, help="TensorRT-LLM: prompt + output tokens (default: the pair's context).")
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["fp8"]),
    help="TensorRT-LLM: FP8 KV cache (engine flavor: with --target-quant/--draft-quant fp8 or w4a8_awq only, "
    "which keep paged context FMHA and so the block reuse the target needs).",
)
@click.option(
    "--target-devices",
    help="TensorRT-LLM --triton-repo: GPU ids of the target's ranks, e.g. 0,1 (tp x pp ids; default 0..tp*pp-1).",
)
@click.option(
    "--draft-devices", help="TensorRT-LLM --triton-repo: GPU ids of the draft's ranks (default: the target's)."
)
@click.option(
    "--num-nodes",
    type=int,
    default=1,
    show_default=True,
    help="TensorRT-LLM --triton-repo: nodes the ranks span (> 1: ranks started up front, participant ids).",
)
@click.option("--dry-run", is_flag=True, help="Print the TensorRT-LLM build plan (every command) and build nothing.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), help="Bundle directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing bundle at --out.")
@click.option(
    "--triton-repo",
    "triton_repo",
    type=click.Path(path_type=Path, file_okay=False),
    help="Also write a Triton model repository for the new bundle here (see `draftsmith triton-repo`).",
)
@click.option(
    "--upstream-models",
    "upstream_models",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="TensorRT-LLM bundles with --triton-repo: a copy of TensorRT-LLM's triton_backend/all_models/"
    "inflight_batcher_llm (or all_models/llmapi) to fill and copy the models from.",
)
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads for evaluation.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
@click.pass_context
def main(
    ctx,
    config_path,
    out,
    force,
    triton_repo,
    upstream_models,
    threads,
    as_json,
    dry_run,
    target_devices,
    draft_devices,
    num_nodes,
    **flags,
):
    """Export a draft and a target checkpoint to quantized engines and write one bundle."""
    if ctx.meta.get("subcommand"):
        return
    config = load_config(config_path) if config_path else {}
    if not config and not flags.get("target"):
        raise click.UsageError("give --target (and --draft), or --config configs/NAME.yaml")
    spec, config_out = spec_from(config, _device_defaults(config, flags))
    if "distill" in config and spec.draft == config.get("draft") and not Path(spec.draft).exists():
        raise click.UsageError(
            f"the draft {spec.draft} of {config_path} is made by its 'distill:' recipe: run "
            f"`draftsmith distill --config {config_path}` first (about 20 minutes on 2 cores), or "
            "pass --draft self for the target re-quantized"
        )
    if dry_run:
        return _trtllm_dry_run(spec, as_json)
    out = out or (Path(config_out) if config_out else None)
    if out is None:
        raise click.UsageError("give --out DIR (where to write the bundle)")
    manifest = (
        _run_trtllm_build(spec, out, force, as_json)
        if spec.backend == "tensorrt_llm"
        else _run_build(spec, out, force, threads, as_json)
    )
    if triton_repo is not None:
        placement = {
            "target_devices": _ids(target_devices, "--target-devices"),
            "draft_devices": _ids(draft_devices, "--draft-devices"),
            "num_nodes": num_nodes,
        }
        _write_triton_repo(out, triton_repo, force, upstream_models, placement)
    if as_json:
        click.echo(json.dumps(_summary(out, manifest), indent=2))
    else:
        _print_summary(out, manifest)


def _ids(text: str | None, flag: str) -> list[int] | None:
    """'0,1' -> [0, 1]; None stays None (the default placement)."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise click.UsageError(f"{flag}: expected comma-separated GPU ids such as 0,1, received {text!r}") from None


def _write_triton_repo(
    bundle: Path, repo: Path, force: bool, upstream_models: Path | None = None, placement: dict | None = None
) -> None:
    if load_manifest(bundle, verify=False).spec.backend == "tensorrt_llm":
        return _write_trtllm_repo(bundle, repo, force, upstream_models, placement or {})
    try:
        from triton_repo.generate import RepositoryError, write_repository
    except ImportError as err:
        raise click.ClickException(
            f"--triton-repo needs the triton extra: pip install 'draftsmith[triton]' ({err})"
        ) from None
    try:
        write_repository(bundle, repo, overwrite=force)
    except (RepositoryError, BundleError, ValueError) as err:
        raise click.ClickException(f"bundle built at {bundle}, but the Triton repository failed: {err}") from None
    click.echo(f"Triton repository written to {repo}; serve it with `draftsmith serve {repo}`", err=True)


def _write_trtllm_repo(
    bundle: Path, repo: Path, force: bool, upstream_models: Path | None, placement: dict | None = None
) -> None:
    from triton_repo.pbtxt import ConfigError
    from triton_repo.trtllm.layouts import write_trtllm_repository

    try:
        write_trtllm_repository(bundle, repo, upstream_models=upstream_models, overwrite=force, **(placement or {}))
    except (ConfigError, BundleError, ImportError) as err:
        raise click.ClickException(f"bundle built at {bundle}, but the Triton repository failed: {err}") from None
    click.echo(f"Triton repository written to {repo} (TensorRT-LLM layout; see its README.md)", err=True)


def _run_build(spec, out, force, threads, quiet):
    from builder.build import BuildError, build
    from builder.checkpoint import CheckpointError
    from builder.export import ExportError
    from builder.pairing import PairingError
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, quiet=quiet)
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=False
    ) as progress:
        current = {"task": None, "start": time.perf_counter()}

        def on_stage(name: str) -> None:
            if current["task"] is not None:
                progress.update(current["task"], completed=1, total=1)
            current["task"] = progress.add_task(name, total=None)
            if not console.is_terminal:  # a log shows no bar: a line as each stage starts
                console.print(f"build-engines: {name} ({time.perf_counter() - current['start']:.0f} s)")

        try:
            manifest = build(
                spec,
                out,
                force=force,
                on_stage=on_stage,
                threads=threads,
                say=None if console.is_terminal else lambda line: console.print(f"build-engines: {line}"),
            )
        except (BuildError, CheckpointError, PairingError, ExportError, SpecError, ValueError) as err:
            raise click.ClickException(str(err)) from None
        if current["task"] is not None:
            progress.update(current["task"], completed=1, total=1)
    return manifest


# --- backend tensorrt_llm (builder/trtllm/build.py) -----------------------------------------------------------------

TRTLLM_DEFAULTS = {"device": "cuda", "target_quant": "fp16", "draft_quant": "int4_awq"}


ONNX_CUDA_DEFAULTS = {"target_quant": "fp16"}  # ONNX Runtime on CUDA: fp16 target, int4 draft (fp32 is CPU-only)


def _device_defaults(config: dict, flags: dict) -> dict:
    """Defaults that differ from the ONNX CPU path's (backend tensorrt_llm; onnxruntime on cuda), unless the config
    or a flag sets them."""
    backend = flags.get("backend") or config.get("backend")
    device = flags.get("device") or config.get("device")
    defaults = TRTLLM_DEFAULTS if backend == "tensorrt_llm" else ONNX_CUDA_DEFAULTS if device == "cuda" else {}
    return {**flags, **{k: v for k, v in defaults.items() if flags.get(k) is None and k not in config}}


def _trtllm_dry_run(spec, as_json: bool) -> None:
    from builder.trtllm import build as trtllm
    from builder.trtllm import plan as trtllm_plan
    from builder.checkpoint import CheckpointError
    from builder.pairing import PairingError

    if spec.backend != "tensorrt_llm":
        raise click.UsageError("--dry-run prints the TensorRT-LLM build plan: add --backend tensorrt_llm")
    try:
        flavor, steps = trtllm.dry_run(spec)
    except (SpecError, CheckpointError, PairingError) as err:
        raise click.ClickException(str(err)) from None
    if not spec.trtllm_flavor and trtllm.installed_version() is None:
        click.echo(
            f"note: tensorrt_llm is not installed here; planned the {flavor} flavor (pass --trtllm-flavor "
            "engine for the trtllm-build plan)",
            err=True,
        )
    click.echo(trtllm_plan.plan_json(steps, flavor) if as_json else trtllm_plan.render_plan(steps, flavor), nl=False)


def _run_trtllm_build(spec, out, force, quiet):
    from builder.trtllm import build as trtllm
    from builder.build import BuildError
    from builder.checkpoint import CheckpointError
    from builder.pairing import PairingError
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    try:
        return trtllm.build(spec, out, force=force, on_stage=lambda name: console.print(f"[bold]{name}[/bold]"))
    except (trtllm.TrtllmError, BuildError, CheckpointError, PairingError, SpecError) as err:
        raise click.ClickException(str(err)) from None


def _summary(out: Path, manifest) -> dict:
    return {
        "bundle": str(out),
        "spec": dataclasses.asdict(manifest.spec),
        "default_k": manifest.default_k,
        "max_context": manifest.max_context,
        "engines": {
            e.role: {"quant": e.quant, "size_bytes": e.size_bytes, "engine": e.engine}
            for e in (manifest.target, manifest.draft)
        },
        "report": manifest.report,
    }


def _figure(value, digits: int) -> str:
    """A report figure, or 'n/a' where there is none (a reduced-head draft has no perplexity: tokens outside its
    head have probability 0)."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _agreement(report: dict) -> str:
    """The draft/target top-1 agreement, which a cross-tokenizer pair has none of (the two ids differ)."""
    if "vocab_bridge" in report:
        return "draft/target top-1 agreement n/a (another tokenizer)"
    return f"draft/target top-1 agreement {report.get('draft_target_top1_agreement', 0):.3f}"


def _print_summary(out: Path, manifest) -> None:
    from rich.console import Console
    from rich.table import Table

    report = manifest.report
    table = Table(title=f"bundle {out}")
    for column in ("engine", "quant", "size MB", "top-1 vs fp32", "perplexity"):
        table.add_column(column)
    for entry in (manifest.target, manifest.draft):
        row = report.get(entry.role, {})
        form = manifest.spec.draft_blocks if entry.role == "draft" and manifest.spec.draft_blocks != "file" else ""
        table.add_row(
            entry.role,
            f"{entry.quant} {form}".strip(),  # int4 q4_0: GgufMatMul's blocks; int4: MatMulNBits
            f"{entry.size_bytes / 1e6:.1f}",
            _figure(row.get("top1_agreement_vs_fp32"), 3),
            _figure(row.get("perplexity"), 2),
        )
    console = Console()
    console.print(table)
    console.print(
        f"fp32 target perplexity {report.get('target', {}).get('fp32_perplexity', 0):.2f}; "
        f"{_agreement(report)}; default k {manifest.default_k}; "
        f"max context {manifest.max_context}; built in {report.get('build_seconds', 0)} s"
    )
    if "draft_call_vs_target" in report:
        console.print(f"a draft call costs {report['draft_call_vs_target']:.2f} of a target call (measured in turn)")
    bridge = report.get("vocab_bridge")
    if bridge:
        console.print(
            f"cross-tokenizer pair (drafter {manifest.spec.drafter}): the draft's own tokenizer "
            f"({bridge['draft_vocab']} tokens) shares {bridge['shared_tokens']} with the target's "
            f"{bridge['target_vocab']}; {bridge['eval_overlap']:.1%} of the evaluation set's target tokens "
            "are shared; the draft's perplexity is over its own tokens"
        )
    for note in report.get("pair_notes", []):
        console.print(f"note: {note}")


@main.command("inspect")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect_cmd(bundle: Path, as_json: bool):
    """Print a bundle's manifest summary and verify every file's sha256."""
    try:
        manifest = load_manifest(bundle, verify=True)
    except BundleError as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(manifest.to_json())
        return
    _print_summary(bundle, manifest)
    click.echo(f"verified {len(manifest.files)} files against their sha256: OK")


if __name__ == "__main__":
    sys.exit(main())
