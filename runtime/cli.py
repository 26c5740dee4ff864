"""draftsmith: run a bundle (generate), serve it (serve-openai), and the commands other parts register (bench,
triton-repo, serve)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from runtime.bundle import BundleError
from runtime.drafter_names import DRAFTERS
from runtime.errors import RequestError
from runtime.serving.cli_options import plan_option
from runtime.core.scheduler import POLICIES
from runtime.engines.sessions import DEVICES, DeviceError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Draftsmith: speculative decoding over engine bundles."""


@main.command()
@click.argument("bundle", type=click.Path())
@click.argument("prompt")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--k", type=int, default=None, help="Draft tokens per step (default: the bundle's).")
@click.option("--adaptive", is_flag=True, help="Adapt k to acceptance as it goes.")
@click.option(
    "--drafter",
    type=click.Choice(DRAFTERS),
    default=None,
    help="Who drafts: the draft engine (model), n-gram lookup (prompt_lookup), a suffix trie over the "
    "context (suffix), or hybrid / hybrid_suffix (lookup or suffix where the context matches, the "
    "engine elsewhere). Default: the bundle's drafter.",
)
@click.option(
    "--draft-confidence",
    type=click.FloatRange(0, 1, max_open=True),
    default=None,
    help="After its first token a draft row stops where the draft's top probability is under this (0: "
    "never). Default: the bundle's.",
)
@click.option("--chat/--no-chat", default=False, help="Apply the tokenizer's chat template to the prompt.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stream", is_flag=True, help="Print text as tokens are accepted.")
@click.option("--no-baseline", is_flag=True, help="Skip the target-only runs (the speedup's and the identity's).")
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads (0: all cores).")
@click.option("--draft-threads", type=int, default=None, help="The draft engine's threads (default: --threads).")
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default=None,
    help="Run on cpu, cuda or tensorrt (ONNX Runtime execution providers; default: the bundle's device).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report instead of text.")
def generate(
    bundle,
    prompt,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    k,
    adaptive,
    drafter,
    draft_confidence,
    chat,
    stop,
    stream,
    no_baseline,
    threads,
    draft_threads,
    device,
    as_json,
):
    """Generate from PROMPT with speculative decoding, then target-only, and print acceptance and speedup.

    The speedup is over plain target-only decoding (one-token calls unpadded: what a user's decoder runs); identity
    is checked against target-only decoding as exactness defines it (a fused target's padded calls)."""
    from runtime.api import SpeculativeGenerator

    try:
        generator = SpeculativeGenerator.from_bundle(
            bundle, threads=threads, draft_threads=draft_threads, device=device
        )
        options = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            k=k,
            chat=chat,
            stop=list(stop),
            adaptive=adaptive or None,
        )
        generator.generate(prompt, **{**options, "max_new_tokens": 2})  # warm both engines up
        if stream and not as_json:
            for piece in generator.stream(prompt, drafter=drafter, draft_confidence=draft_confidence, **options):
                click.echo(piece, nl=False)
            click.echo()
            result = generator.last_stream
        else:
            result = generator.generate(prompt, drafter=drafter, draft_confidence=draft_confidence, **options)
        baseline = plain = None
        if not no_baseline:
            baseline = generator.generate(prompt, mode="target", **options)
            plain = generator.generate(prompt, mode="target", policy="throughput", **options)
    except (BundleError, RequestError, DeviceError) as err:
        raise click.ClickException(str(err)) from None
    report = _report(result, baseline, plain)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if not stream:
        click.echo(result.text)
    click.echo("")
    s = result.stats
    click.echo(
        f"speculative: {s.num_emitted_tokens} tokens in {s.total_time:.2f} s = {s.tokens_per_second:.1f} tok/s; "
        f"acceptance rate {s.draft_acceptance_rate:.2f}, mean acceptance length "
        f"{s.mean_acceptance_length:.2f}, k={generator.default_k if k is None else k}"
    )
    if baseline is not None:
        p, b = plain.stats, baseline.stats
        click.echo(
            f"target-only: {p.num_emitted_tokens} tokens in {p.total_time:.2f} s = "
            f"{p.tokens_per_second:.1f} tok/s (plain decoding; {b.tokens_per_second:.1f} with exactness "
            "padding)"
        )
        click.echo(
            f"speedup over plain decoding: {report['speedup']:.2f}x; identical output: {report['identical_to_target']}"
        )


def _report(result, baseline, plain) -> dict:
    """The JSON report: ``target_only`` is plain decoding (the speedup's base), ``target_only_padded`` the run the
    output must equal."""
    report = {
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "speculative": result.stats.to_dict(),
    }
    if baseline is not None:
        report["target_only"] = plain.stats.to_dict()
        report["target_only_padded"] = baseline.stats.to_dict()
        p, s = plain.stats.tokens_per_second, result.stats.tokens_per_second
        report["speedup"] = s / p if p else 0.0
        report["identical_to_target"] = baseline.token_ids == result.token_ids
        report["plain_identical_to_target"] = plain.token_ids == baseline.token_ids
    return report


def _key_from_file(path: str, given: str | None) -> str:
    """The API key in ``path`` without its line ending; refused with --api-key (or DRAFTSMITH_API_KEY) too, which
    would leave which key counts to the reader, or when empty."""
    if given is not None:
        raise click.UsageError("give the API key once: --api-key-file, or --api-key / DRAFTSMITH_API_KEY")
    key = Path(path).read_text(encoding="utf-8").removesuffix("\n").removesuffix("\r")
    if not key.strip():
        raise click.ClickException(f"the API key file {path} is empty")
    return key


@main.command("serve-openai")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; any but loopback exposes the server (then use --api-key).",
)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--api-key",
    envvar="DRAFTSMITH_API_KEY",
    show_envvar=True,
    default=None,
    help="Required as 'Authorization: Bearer KEY' on every route but /health (default: none).",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Read the key from this file (a Kubernetes Secret's volume): kept out of the environment, which "
    "/proc and crash reports show. One trailing newline is dropped.",
)
@click.option("--max-batch", type=int, default=8, show_default=True, help="Requests decoded together.")
@click.option(
    "--max-queue",
    type=int,
    default=256,
    show_default=True,
    help="Requests waiting for a row before new ones get 429 (overloaded).",
)
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads (0: all cores).")
@click.option("--model-name", default=None, help="The model name clients send (default: the bundle's folder name).")
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default="exact",
    show_default=True,
    help="exact: every answer is bit for bit the same request's alone; throughput: steps where no "
    "request drafts run unpadded (answers of a quantized target may then part from a lone run's at "
    "near ties).",
)
@plan_option
@click.option(
    "--prefill-chunk",
    default="auto",
    show_default=True,
    help="Prompt tokens prefilled per step while other requests decode, so a long prompt never stalls "
    "them: a number, auto (the largest chunk that keeps the step's one target call within 1.8x its "
    "cost without it, on the measured costs) or 0 (each prompt prefilled whole at admission).",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="On SIGTERM: seconds running requests get to finish (keep it under the pod's grace period).",
)
@click.option(
    "--drain-linger",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="On SIGTERM: the least seconds new requests get 503 + Retry-After before the port closes (the "
    "load balancer's time to see readiness turn false).",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds a request may run before it ends with finish_reason 'timeout'.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Requests in flight (headers received, answer not finished) past which new ones get 503; connections "
    "still sending their headers count apart (--max-pending-connections).",
)
@click.option(
    "--max-pending-connections",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Connections that have not sent a complete request (new, or kept alive between requests) held at once; "
    "past it the one waiting longest is closed, so a new client always gets in.",
)
@click.option(
    "--trusted-proxy",
    multiple=True,
    metavar="ADDR",
    help="An IP address or network (CIDR) of a proxy in front of the server whose X-Forwarded-For names the "
    "client (repeatable). Default: none, and the TCP peer is the client for --max-rows-per-client, the "
    "fewest-rows order and the logs.",
)
@click.option(
    "--max-connections-per-client",
    type=click.IntRange(min=0),
    default=64,
    show_default=True,
    help="Open connections one client address (an IPv6 /64) may hold; past it a new one gets 503 (0: no cap; "
    "raise it behind a proxy, whose connections all come from its own address).",
)
@click.option(
    "--header-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds a connection may take to send a request's headers (idle or trickling ones are closed).",
)
@click.option(
    "--health-port",
    type=click.IntRange(min=1, max=65535),
    default=None,
    help="Also serve /health and /health/live on this port, apart from the API's connections, so no "
    "client can starve the probes (point the pod's probes at it).",
)
@click.option(
    "--max-rows-per-client",
    type=click.IntRange(min=1),
    default=None,
    help="Rows one client address may hold at once (default: no cap; free rows always go first to the "
    "clients holding the fewest).",
)
@click.option(
    "--free-refusals",
    type=click.FloatRange(min=0),
    default=8.0,
    show_default=True,
    help="Refused requests (4xx) a client address gets answered at once per second; each one past it waits 50 ms "
    "more (at most 2 s), so a client looping on refused requests cannot crowd out the others' streams.",
)
def serve_openai(
    bundle,
    host,
    port,
    api_key,
    api_key_file,
    max_batch,
    max_queue,
    threads,
    model_name,
    policy,
    plan,
    prefill_chunk,
    drain_timeout,
    drain_linger,
    request_timeout,
    max_connections,
    max_pending_connections,
    trusted_proxy,
    max_connections_per_client,
    header_timeout,
    health_port,
    max_rows_per_client,
    free_refusals,
):
    """Serve BUNDLE over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /health/live, /metrics), every request on one in-flight batching scheduler. SIGTERM drains: readiness
    (/health) turns 503, new requests get 503 + Retry-After, running ones finish, then it exits 0."""
    if api_key_file is not None:
        api_key = _key_from_file(api_key_file, api_key)
    try:
        from runtime.serving.connections import ConnectionLimits
        from runtime.serving.openai_server import serve
        from runtime.serving.pacing import RefusalPacing
    except ImportError as err:  # fastapi and uvicorn are the `serve` extra, imported only here
        raise click.ClickException(
            f"serve-openai needs fastapi and uvicorn: pip install 'draftsmith[serve]' ({err})"
        ) from None
    if api_key is None:  # click reads DRAFTSMITH_API_KEY="" as unset; an empty key must not mean "no key"
        api_key = os.environ.get("DRAFTSMITH_API_KEY")
    if api_key is not None and not api_key.strip():
        raise click.ClickException(
            "the API key is empty (--api-key or DRAFTSMITH_API_KEY): set a key, or unset it to serve without one"
        )
    api_key = api_key.strip() if api_key is not None else None  # a key read from a file ends in a newline
    try:
        serve(
            bundle,
            host=host,
            port=port,
            api_key=api_key,
            max_batch=max_batch,
            max_queue=max_queue,
            threads=threads,
            model_name=model_name,
            policy=policy,
            drain_timeout=drain_timeout,
            drain_linger=drain_linger,
            request_timeout=request_timeout,
            max_connections=max_connections,
            max_rows_per_client=max_rows_per_client,
            health_port=health_port,
            connection_limits=ConnectionLimits(
                header_timeout, max_connections_per_client or None, max_pending_connections
            ),
            plan=plan,
            prefill_chunk=_prefill_chunk(prefill_chunk),
            trusted_proxy=tuple(trusted_proxy),
            refusal_pacing=RefusalPacing(free=free_refusals),
        )
    except (BundleError, RequestError, DeviceError, ValueError) as err:
        raise click.ClickException(str(err)) from None


def _prefill_chunk(value: str) -> int | str | None:
    """--prefill-chunk as the scheduler takes it: "auto", a token count, or None for 0 (whole prompts)."""
    if value == "auto":
        return value
    try:
        tokens = int(value)
    except ValueError:
        raise click.BadParameter(
            f"expected a number of tokens, auto or 0, received {value!r}", param_hint="--prefill-chunk"
        ) from None
    if tokens < 0:
        raise click.BadParameter("expected tokens >= 0", param_hint="--prefill-chunk")
    return tokens or None


# Commands other packages own, added when importable: the one place the runtime names them (tests/test_layout.py);
# their heavy imports happen inside the commands.
COMMANDS = (
    ("triton_repo.cli", "triton_repo"),
    ("triton_repo.cli", "serve"),
    ("bench.speed", "bench"),
    ("bench.profile", "profile"),
    ("bench.tree", "tree_headroom"),
    ("builder.distill.cli", "distill"),
    ("bench.load", "load"),
    ("bench.openai_load", "openai_load"),
    ("deploy.cli", "deploy"),
)


def _register_optional() -> None:
    import importlib

    for module, name in COMMANDS:
        try:
            command = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        main.add_command(command)


_register_optional()

if __name__ == "__main__":
    sys.exit(main())
