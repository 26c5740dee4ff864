"""One bench run's settings, in a module of their own: the command (bench/speed.py) makes them from its flags, and
the run's phases (the drafters, the report, the peers) read them without importing the command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
