"""Would tree verification pay on this machine? Three measurements of a bundle, as JSON::

    draftsmith tree-headroom BUNDLE [--workload code,chat,reasoning] [--prompts 6] [--max-new-tokens 128]

1. ``verify_cost``: one target call of S = 2..8 new tokens on a past, relative to S = 2 (what a greedy step costs a
   quantized target, whose one-token calls are padded to two). Every token a tree adds is one more row.
2. ``coverage``: how often the target's token at draft position 1 is among the draft's top n (greedy, k = 1, the
   bundle's draft engine), per workload. A depth-1 tree of n candidates accepts a token exactly that often, so
   ``depth1_tree`` prices it: tokens per step (1 + hit_n) over the step's cost (verify_cost[n + 1] + c, with c the
   draft call over a target step), against the chain of one (n = 1).
3. ``tree_attention``: ONNX Runtime's GroupQueryAttention takes a tree as ``position_ids`` (each node's depth) and an
   ``attention_bias`` (-inf where a node is not an ancestor). This writes the target graph with those two inputs,
   scores a tree, and compares every node's logits with the same path scored as a chain: the main chain (laid out
   first) must agree exactly; an off-chain node attends to its ancestors at other slots, so its sums are taken in
   another order, and the difference shows how far a quantized target's logits move with that.

Greedy output must equal target-only output bit for bit, so a tree is only usable where 3 says exact; a tree pays
only where 2 beats the chain.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from bench.sweep import decode
from bench.workloads import CHAT_BY_DEFAULT, load_workload
from runtime.engines.base import Call, EngineWrapper


class _TopRecorder(EngineWrapper):
    """The draft engine, seen through a wrapper that keeps the top-``n`` ids at the last valid position of row 0 of
    every scored call, and the calls' time (its own observer)."""

    def __init__(self, engine, n: int = 4):
        super().__init__(engine)
        self.n, self.tops, self.seconds, self.calls = n, [], 0.0, 0
        self.watch(self._timed)

    def _timed(self, call: Call) -> None:
        if call.kind == "forward":
            self.seconds += call.seconds
            self.calls += 1

    def compute(self, cache, tokens, valid=None, **options):
        logits = self.engine.compute(cache, tokens, valid, **options)
        if logits is not None:
            last = 0 if options.get("last") else int(valid[0].sum()) - 1 if valid is not None else tokens.shape[1] - 1
            self.tops.append(np.argsort(-logits[0, last])[: self.n].tolist())
        return logits


def verify_cost(engine, past: int = 200, sizes=(2, 3, 4, 5, 6, 8), calls: int = 30) -> dict[int, float]:
    """Median milliseconds of one call of S new tokens on a past of ``past`` tokens, per S."""
    rng = np.random.default_rng(0)
    past, vocab = min(past, engine.max_context - max(sizes)), min(1000, engine.vocab_size)
    cache = engine.new_cache(1)
    engine.forward(cache, rng.integers(3, vocab, (1, past)))
    out = {}
    for size in sizes:
        times = []
        for _ in range(calls):
            tokens = rng.integers(3, vocab, (1, size))
            start = time.perf_counter()
            engine.forward(cache, tokens)
            times.append(time.perf_counter() - start)
            engine.rollback(cache, np.array([past]))
        out[size] = float(np.median(times) * 1000)
    return out


def coverage(generator, token_lists: list[list[int]], max_new_tokens: int) -> dict:
    """Share of greedy k=1 steps whose target token (the first emitted) is in the draft's top 1..4 at position 1,
    and the draft call's cost."""
    recorder = _TopRecorder(generator.draft)
    generator.draft, original = recorder, generator.draft
    hits, steps = np.zeros(4), 0
    try:
        for ids in token_lists:
            recorder.tops.clear()
            # k = 1 at every step (plan off): what is measured is the draft's position-1 agreement, not whether the
            # measured costs would let it draft
            records, _ = decode(generator, [ids], "speculative", 1, max_new_tokens, 0.0, 0, "model", 0.0, plan=False)
            record, at, calls = records[0], 0, iter(list(recorder.tops))
            for drafted, _accepted, emitted, _dt in record.steps:
                if drafted:
                    top = next(calls)
                    token = record.token_ids[at]
                    hits += [token in top[:n] for n in (1, 2, 3, 4)]
                    steps += 1
                at += emitted
    finally:
        generator.draft = original
    return {
        "steps": steps,
        "hit_top_1_to_4": [round(float(h / max(steps, 1)), 3) for h in hits],
        "draft_call_ms": round(1000 * recorder.seconds / max(recorder.calls, 1), 3),
    }


def depth1_tree(costs: dict[int, float], hits: list[float], draft_ms: float) -> list[dict]:
    """Predicted speed of a depth-1 tree of n candidates (n = 1: the chain of one) relative to target-only."""
    step = costs[2]
    return [
        {
            "candidates": n,
            "tokens_per_step": round(1 + hits[n - 1], 3),
            "speedup": round((1 + hits[n - 1]) / (costs[n + 1] / step + draft_ms / step), 3),
        }
        for n in (1, 2, 3)
        if n + 1 in costs
    ]


def with_tree_inputs(source: Path, out: Path) -> None:
    """The fused target graph with ``position_ids`` and ``attention_bias`` fed to every GroupQueryAttention."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(source))
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            inputs = list(node.input) + [""] * (11 - len(node.input))
            inputs[9:11] = ["position_ids", "attention_bias"]  # GroupQueryAttention's inputs 9 and 10
            del node.input[:]
            node.input.extend(inputs)
    model.graph.input.extend(
        [
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "new"]),
            helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, [1, 1, "new", "total"]),
        ]
    )
    onnx.save_model(
        model, str(out), save_as_external_data=model.ByteSize() > 1_800_000_000, location=out.name + ".data"
    )


def _score(session, entry, past_buffers, tokens, past, positions=None, bias=None) -> np.ndarray:
    import onnxruntime as ort

    binding = session.io_binding()
    binding.bind_output("logits", "cpu")
    for i in range(entry.num_layers):
        for j, kind in enumerate(("key", "value")):
            value = ort.OrtValue.ortvalue_from_numpy(past_buffers[2 * i + j])
            binding.bind_ortvalue_input(f"past.{i}.{kind}", value)
            binding.bind_ortvalue_output(f"present.{i}.{kind}", value)
    total = past + len(tokens)
    binding.bind_cpu_input("input_ids", np.array([tokens], np.int64))
    binding.bind_cpu_input("logits_to_keep", np.array([len(tokens)], np.int64))
    binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
    names = {i.name for i in session.get_inputs()}
    if "query_lengths" in names:  # a graph with batched verify calls (builder/graph.py): one row, all of it real
        binding.bind_cpu_input("query_lengths", np.array([len(tokens)], np.int32))
    if "position_ids" in names:
        positions = list(range(past, total)) if positions is None else positions
        bias = np.zeros((1, 1, len(tokens), total), np.float32) if bias is None else bias
        binding.bind_cpu_input("position_ids", np.array([positions], np.int64))
        binding.bind_cpu_input("attention_bias", bias)
    if "hidden" in {o.name for o in session.get_outputs()}:
        binding.bind_output("hidden", "cpu")
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()[0]


def _prefilled(session, entry, prompt: list[int], slots: int) -> list[np.ndarray]:
    """Fresh cache buffers holding ``prompt``."""
    shape = (1, entry.num_kv_heads, slots, entry.head_dim)
    buffers = [np.zeros(shape, np.float32) for _ in range(2 * entry.num_layers)]
    _score(session, entry, buffers, prompt, 0)
    return buffers


def tree_attention(root: Path, manifest, threads: int, trials: int = 6) -> dict:
    """Max |logit difference| between a tree call and the same paths as chains, on random prompts."""
    from runtime.engines.sessions import make_session

    entry = manifest.target
    parents = [-1, 0, 1, 2, 0, 4, 1]  # main chain c0..c3 at slots 0..3; a0 <- c0, a1 <- a0, b0 <- c1
    paths = []  # each node's path from the root, itself last
    for p in parents:
        paths.append((paths[p] if p >= 0 else []) + [len(paths)])
    rng = np.random.default_rng(0)
    longest, vocab = min(300, manifest.max_context - len(parents)), entry.vocab_size
    slots = longest + len(parents)
    with tempfile.TemporaryDirectory(prefix="draftsmith-tree-") as tmp:
        tree_path = Path(tmp) / "tree.onnx"
        with_tree_inputs(root / entry.engine, tree_path)
        chain_session = make_session(root / entry.engine, threads)
        tree_session = make_session(tree_path, threads)
        main, off, flips = 0.0, 0.0, 0
        for _ in range(trials):
            past = int(rng.integers(min(20, longest - 1), longest))
            prompt, nodes = rng.integers(3, vocab, past).tolist(), rng.integers(3, vocab, len(parents)).tolist()
            bias = np.full((1, 1, len(parents), past + len(parents)), -np.inf, np.float32)
            bias[..., :past] = 0
            for i, path in enumerate(paths):
                bias[0, 0, i, [past + j for j in path]] = 0
            positions = [past + len(path) - 1 for path in paths]
            tree = _score(
                tree_session, entry, _prefilled(tree_session, entry, prompt, slots), nodes, past, positions, bias
            )
            chain = _score(chain_session, entry, _prefilled(chain_session, entry, prompt, slots), nodes[:4], past)
            main = max(main, float(np.abs(tree[:4] - chain).max()))
            for path in (paths[5], paths[6]):  # the off-chain paths c0 a0 a1 and c0 c1 b0
                alone = _score(
                    chain_session,
                    entry,
                    _prefilled(chain_session, entry, prompt, slots),
                    [nodes[i] for i in path],
                    past,
                )
                rows = [at for at, node in enumerate(path) if node >= 4]  # the off-chain nodes of the path
                picked = tree[[path[at] for at in rows]]
                off = max(off, float(np.abs(picked - alone[rows]).max()))
                flips += int((picked.argmax(-1) != alone[rows].argmax(-1)).sum())
    return {
        "main_chain_max_abs_diff": main,
        "off_chain_max_abs_diff": off,
        "off_chain_argmax_flips": flips,
        "off_chain_rows": trials * 3,
    }


@click.command("tree-headroom")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--workload", "workload_specs", multiple=True, default=("code,chat,reasoning",), show_default=True)
@click.option("--prompts", "prompt_limit", type=int, default=6, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads (0: all cores).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the report here.")
def tree_headroom(bundle, workload_specs, prompt_limit, max_new_tokens, threads, json_out):
    """Measure whether tree verification could pay for BUNDLE on this machine (see bench/tree.py), as JSON."""
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(bundle, threads=threads)
    if generator.draft is None or generator.manifest.target.graph != "fused":
        raise click.ClickException("tree-headroom needs a bundle with a draft engine and a fused target graph")
    costs = verify_cost(generator.target)
    report = {
        "verify_cost_ms": {s: round(v, 3) for s, v in costs.items()},
        "verify_cost_relative": {s: round(v / costs[2], 3) for s, v in costs.items()},
        "workloads": {},
    }
    names = [part.strip() for spec in workload_specs for part in spec.split(",") if part.strip()]
    for name, prompts in (load_workload(n) for n in names):
        chat = name in CHAT_BY_DEFAULT and bool(generator.tokenizer.chat_template)
        ids = [generator.encode_prompt(p, chat) for p in prompts[: prompt_limit or None]]
        found = coverage(generator, ids, max_new_tokens)
        found["depth1_tree"] = depth1_tree(costs, found["hit_top_1_to_4"], found["draft_call_ms"])
        report["workloads"][name] = found
    report["tree_attention"] = tree_attention(Path(bundle), generator.manifest, threads)
    text = json.dumps(report, indent=2)
    if json_out:
        json_out.write_text(text + "\n")
    click.echo(text)
