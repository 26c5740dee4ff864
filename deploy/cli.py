"""``draftsmith deploy kubernetes BUNDLE --out DIR``: the command, its options, and the figures given on its command
line instead of measured (``--load-seconds``, ``--memory-mib``, ``--tokens-per-second``)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import click

from deploy.kubernetes import no_key_warning, write_manifests
from deploy.options import AUTOSCALERS, BUNDLE_SOURCES, SERVERS, TRTLLM_TRITON_IMAGE, DeployError, DeployOptions
from deploy.sizing import Measured, estimate_trtllm, measure
from runtime.bundle import BundleError, load_manifest


@click.group("deploy")
def deploy():
    """Deployment manifests for a bundle."""


@deploy.command("kubernetes")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the manifests.")
@click.option(
    "--server",
    type=click.Choice(SERVERS),
    default="openai",
    show_default=True,
    help="openai: draftsmith serve-openai; triton (tensorrt_llm bundles only): NVIDIA's tritonserver on a "
    "repository written at pod start.",
)
@click.option("--name", default="draftsmith", show_default=True, help="Name of every object (a DNS label).")
@click.option(
    "--image",
    default="draftsmith:cpu",
    show_default=True,
    help="The image with draftsmith installed (the Dockerfile's); the bundle is not in it.",
)
@click.option("--replicas", type=int, default=2, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True, help="ONNX Runtime threads per pod (its CPU).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Requests decoded together per pod.")
@click.option("--max-queue", type=int, default=256, show_default=True)
@click.option("--policy", type=click.Choice(["exact", "throughput"]), default="exact", show_default=True)
@click.option(
    "--bundle-source",
    type=click.Choice(BUNDLE_SOURCES),
    default="pvc",
    show_default=True,
    help="pvc: mount --bundle-pvc read-only; image: an init container copies /bundle from --bundle-image.",
)
@click.option(
    "--bundle-pvc",
    default="draftsmith-bundle",
    show_default=True,
    help="A PersistentVolumeClaim holding the bundle at its root.",
)
@click.option("--bundle-image", default="", help="An image holding the bundle at /bundle (--bundle-source image).")
@click.option(
    "--autoscale",
    type=click.Choice(AUTOSCALERS),
    default="cpu",
    show_default=True,
    help="Which autoscaler the kustomization applies (both are written): CPU, or the queue length "
    "(needs a custom-metrics adapter).",
)
@click.option("--min-replicas", type=int, default=2, show_default=True)
@click.option("--max-replicas", type=int, default=8, show_default=True)
@click.option(
    "--drain-linger",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds a stopping pod keeps answering 503 (endpoint removal reaching every node).",
)
@click.option(
    "--api-key-secret",
    default="",
    help="A Secret with key DRAFTSMITH_API_KEY, mounted as a file the server reads (openai server).",
)
@click.option(
    "--triton-image",
    default=TRTLLM_TRITON_IMAGE,
    show_default=True,
    help="tensorrt_llm bundles served by Triton: NVIDIA's Triton TRT-LLM image of the bundle's release.",
)
@click.option(
    "--upstream-models",
    default="",
    help="tensorrt_llm + triton: upstream's inflight_batcher_llm (or llmapi) folder inside --image.",
)
@click.option("--load-seconds", type=float, default=None, help="Instead of measuring: seconds to load.")
@click.option("--memory-mib", type=float, default=None, help="Instead of measuring: peak MiB of one server.")
@click.option("--tokens-per-second", type=float, default=None, help="Instead of measuring: one request's speed.")
@click.option("--overwrite", is_flag=True, help="Replace manifests already in --out.")
def kubernetes(bundle, out, load_seconds, memory_mib, tokens_per_second, overwrite, **choices):
    """Write Kubernetes manifests serving BUNDLE into --out (apply with kubectl apply -k OUT)."""
    try:
        options = DeployOptions(**choices)
        measured = _given(bundle, options, load_seconds, memory_mib, tokens_per_second)
        objects = write_manifests(bundle, out, options, measured, overwrite=overwrite)
    except (DeployError, BundleError, subprocess.TimeoutExpired) as err:
        raise click.ClickException(str(err)) from None
    sizing = json.loads(objects["deployment.yaml"]["metadata"]["annotations"]["draftsmith/sizing"])
    click.echo(f"wrote {out}: {', '.join(objects)}, kustomization.yaml (autoscaler: hpa-{options.autoscale}.yaml)")
    click.echo(
        f"sizing ({sizing['how']}): load {sizing['load_s']} s, peak {sizing['rss_mib']} MiB, "
        f"{sizing['tokens_per_s']} tok/s -> grace {sizing['grace_s']} s, memory request "
        f"{sizing['memory_request_mib']} Mi" + (f", {sizing['gpus']} GPU(s)" if sizing["gpus"] else "")
    )
    warning = no_key_warning(options)
    if warning:
        click.secho(warning, fg="red", bold=True, err=True)
    click.echo(f"apply it:  kubectl apply -k {out}")


def _given(bundle: str, options: DeployOptions, load_s, rss_mib, tokens_per_s) -> Measured | None:
    """The figures given on the command line, the rest measured (or estimated); None when none was given."""
    given = {"load_s": load_s, "rss_mib": rss_mib, "tokens_per_s": tokens_per_s}
    if all(value is None for value in given.values()):
        return None
    bad = [f"{name}={value!r}" for name, value in given.items() if value is not None and not value > 0]
    if bad:
        raise DeployError(f"expected figures > 0, received {', '.join(bad)}")
    if all(value is not None for value in given.values()):
        return Measured(**given, how="given")
    root = Path(bundle)
    manifest = load_manifest(root, verify=False)
    base = (
        estimate_trtllm(root, manifest)
        if manifest.spec.backend == "tensorrt_llm"
        else measure(root, options.threads, options.max_batch, options.policy)
    )
    return replace(base, **{k: v for k, v in given.items() if v is not None}, how=base.how + " (some given)")
