"""``draftsmith triton-repo`` and ``draftsmith serve``: thin commands over ``write_repository`` (its flags build the
``RepoOptions``) and ``start_server``."""

from __future__ import annotations

import signal
import threading

import click

from runtime.core.request import Limits
from runtime.serving.cli_options import plan_option


@click.command("triton-repo")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--instances", type=int, default=1, show_default=True, help="Speculative model instances (processes).")
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads per instance (0: all).")
@click.option(
    "--max-batch-size", type=int, default=16, show_default=True, help="Requests decoded together in one batch."
)
@click.option(
    "--max-queue-delay-us",
    type=int,
    default=2000,
    show_default=True,
    help="How long the dynamic batcher waits to fill a batch.",
)
@click.option(
    "--max-tokens-limit",
    type=int,
    default=0,
    show_default=True,
    help="Largest max_tokens a request may ask for (0: the bundle's context less one, as serve-openai).",
)
@click.option(
    "--max-prompt-bytes",
    type=int,
    default=0,
    show_default=True,
    help="Largest prompt in UTF-8 bytes, refused before tokenizing (0: 32 per context token).",
)
@click.option(
    "--max-stop-words",
    type=int,
    default=Limits.max_stop_words,
    show_default=True,
    help="Most stop strings one request may send (each is searched at every step).",
)
@click.option(
    "--max-stop-word-bytes",
    type=int,
    default=Limits.max_stop_word_bytes,
    show_default=True,
    help="Longest stop string, in UTF-8 bytes.",
)
@click.option(
    "--bundle-mount",
    default=None,
    help="Absolute path where the server will see the bundle (e.g. /bundles/x); the bundle is not copied.",
)
@click.option(
    "--link/--copy",
    "link",
    default=False,
    help="--link: a symbolic link to the bundle instead of a copy (not relocatable).",
)
@click.option(
    "--policy",
    type=click.Choice(["exact", "throughput"]),
    default="exact",
    show_default=True,
    help="The scheduler's: exact (every answer as the same request's alone) or throughput (steps where "
    "no request drafts run unpadded).",
)
@plan_option
@click.option(
    "--max-queue",
    type=int,
    default=256,
    show_default=True,
    help="Requests waiting for a row before new ones are refused as overloaded.",
)
@click.option(
    "--streaming/--no-streaming",
    default=True,
    show_default=True,
    help="Decoupled (streams; gRPC stream and generate_stream) or not (HTTP /infer works).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def triton_repo(
    bundle,
    out,
    instances,
    threads,
    max_batch_size,
    max_queue_delay_us,
    max_tokens_limit,
    max_prompt_bytes,
    max_stop_words,
    max_stop_word_bytes,
    bundle_mount,
    link,
    plan,
    policy,
    max_queue,
    streaming,
    overwrite,
):
    """Write a Triton model repository serving BUNDLE into OUT: ensemble, preprocessing, speculative, postprocessing."""
    from runtime.bundle import BundleError
    from triton_repo.generate import RepoOptions, RepositoryError, write_repository

    try:
        options = RepoOptions(
            instances=instances,
            threads=threads,
            max_batch_size=max_batch_size,
            max_queue_delay_us=max_queue_delay_us,
            max_tokens_limit=max_tokens_limit,
            bundle_mount=bundle_mount,
            copy_bundle=not (link or bundle_mount),
            policy=policy,
            max_queue=max_queue,
            plan=plan,
            streaming=streaming,
            max_prompt_bytes=max_prompt_bytes,
            max_stop_words=max_stop_words,
            max_stop_word_bytes=max_stop_word_bytes,
        )
        path = write_repository(bundle, out, options, overwrite=overwrite)
    except (BundleError, RepositoryError) as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"wrote {path}")
    click.echo(f"serve it:  draftsmith serve {path}")


@click.command("serve")
@click.argument("repo", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address every endpoint binds.")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--log-verbose", type=int, default=0, show_default=True)
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where the server's log goes (default: a temporary file; kept, its path is printed).",
)
@click.option(
    "--http-restricted-api",
    multiple=True,
    metavar="APIS:HEADER=VALUE",
    help="Triton's flag: these HTTP APIs answer only requests with this header, e.g. "
    "model-repository,model-config,statistics,trace,logging:admin-key=SECRET. Repeatable.",
)
@click.option(
    "--grpc-restricted-protocol",
    multiple=True,
    metavar="PROTOCOLS:HEADER=VALUE",
    help="Triton's flag: the same for gRPC protocols. Repeatable.",
)
@click.option(
    "--pass-env",
    multiple=True,
    metavar="NAME",
    help="Pass this environment variable to the server and its models (by default only PATH, locale, "
    "temporary-folder, thread and device settings are). Repeatable.",
)
@click.option(
    "--exit-timeout",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Seconds a stop lets requests in flight finish (tritonserver's --exit-timeout-secs).",
)
@click.option(
    "--drain-linger",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="On SIGTERM: the least seconds before the ports close (tritonserver closes them when signalled; "
    "this is the load balancer's time to drop the replica).",
)
def serve(
    repo,
    host,
    http_port,
    grpc_port,
    metrics_port,
    timeout,
    log_verbose,
    log_file,
    http_restricted_api,
    grpc_restricted_protocol,
    pass_env,
    exit_timeout,
    drain_linger,
):
    """Start a local Triton Inference Server on REPO (the tritonserver of the nvidia-pytriton wheel); Ctrl-C stops.

    SIGTERM drains: every model is unloaded (model readiness turns false, new requests are refused before any work)
    once its requests in flight finish, then after --drain-linger seconds the server exits. Models run in explicit
    control mode; the model-repository API is restricted (by your --http-restricted-api header if one covers it)."""
    from triton_repo.server import ServerError, start_server

    try:
        server = start_server(
            repo,
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            timeout=timeout,
            log_verbose=log_verbose,
            log_path=log_file,
            http_restricted_api=http_restricted_api,
            grpc_restricted_protocol=grpc_restricted_protocol,
            pass_env=pass_env,
            keep_log=True,
            exit_timeout=exit_timeout,
            drainable=True,
        )
    except ServerError as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"HTTP     {server.url}  (POST {server.url}/v2/models/ensemble/generate)")
    click.echo(f"gRPC     {server.grpc_url}")
    click.echo(f"metrics  {server.metrics_url}")
    click.echo(f"log      {server.log_path}")
    stop, received = threading.Event(), []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _: (received.append(number), stop.set()))
    try:
        while not stop.wait(1.0):
            if server.process.poll() is not None:
                raise click.ClickException(
                    f"tritonserver exited with {server.process.returncode}:\n"
                    f"{server.log()[-4000:]}\n(full log: {server.log_path})"
                )
    finally:
        if received[:1] == [signal.SIGTERM]:
            click.echo(
                f"SIGTERM: unloading the models as their requests finish; exiting in {drain_linger:g} s at the earliest"
            )
            server.drain(drain_linger)
            click.echo(
                "drained: every model unloaded once its requests finished"
                if server.unloaded
                else "drain: models still loaded at the exit timeout; stopped anyway"
            )
        else:
            click.echo("stopping")
            server.stop()
        click.echo(f"log kept at {server.log_path}")
