"""What stop strings cost a row at every step: ``StopText.push`` timed alone, over a long generation of short pieces.

The scheduler pushes every row's new text through its ``StopText`` at every step, on its own thread, so this cost is
paid batch-size times per step (issue 54's figures: 16 stops of 256 characters cost 705 µs a row-step, about 5.6 ms a
step at batch 8 on a model whose step is ~5 ms). Run it against another checkout's runtime with
``PYTHONPATH=CHECKOUT``.

    python -m bench.stop_strings --steps 2000

``--bundle BUNDLE`` measures the goal instead: a batch of 8 code prompts decoded to 128 tokens with 16 stops of 256
characters that never match and with none, interleaved, ``--repeats`` times each; the decode rates' ratio, and
whether the texts are the same.

    python -m bench.stop_strings --bundle bundles/smollm2-135m --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from runtime.text.tokenizer import StopText

CASES = {
    "no stops": (),
    'one "\\n\\n"': ("\n\n",),
    "16 stops of 256 characters": tuple(f"{i:02d}" + "z" * 254 for i in range(16)),
}


def row_step_seconds(stops: tuple[str, ...], steps: int) -> float:
    """Seconds per push of one row's 5-character pieces, over ``steps`` pushes (the text grows as a row's does)."""
    text = StopText(stops)
    began = time.perf_counter()
    for i in range(steps):
        text.push(f"w{i % 10} x ")
    return (time.perf_counter() - began) / steps


def batch_rates(bundle: str, repeats: int, batch: int = 8, tokens: int = 128) -> dict:
    """Decode tokens a second of ``batch`` code prompts with the 16 long stops and without, interleaved; the best of
    ``repeats`` each, their ratio, and whether every text is the same."""
    from runtime.api import SpeculativeGenerator
    from runtime.text.prompt_files import parse_prompts

    prompts = parse_prompts((Path(__file__).parent / "prompts" / "code.txt").read_text())[:batch]
    generator = SpeculativeGenerator.from_bundle(bundle, threads=2)
    generator.generate(prompts[:1], max_new_tokens=8)  # a warm-up
    rates: dict[str, list[float]] = {"no stops": [], "16 stops of 256 characters": []}
    texts: dict[str, list[str]] = {}
    for _ in range(repeats):
        for name in rates:
            began = time.perf_counter()
            out = generator.generate(prompts, max_new_tokens=tokens, stop=list(CASES[name]) or None)
            rates[name].append(sum(len(g.token_ids) for g in out) / (time.perf_counter() - began))
            texts[name] = [g.text for g in out]
    best = {name: max(values) for name, values in rates.items()}
    return {
        "tokens_per_s": best,
        "ratio": best["16 stops of 256 characters"] / best["no stops"],
        "same_text": texts["no stops"] == texts["16 stops of 256 characters"],
        "batch": batch,
        "max_new_tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="pushes per row (a row's steps)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case; the median is reported")
    parser.add_argument("--bundle", help="measure decoding at batch 8 on this bundle instead")
    args = parser.parse_args()
    if args.bundle:
        print(json.dumps(batch_rates(args.bundle, args.repeats), indent=1))
        return
    for name, stops in CASES.items():
        seconds = statistics.median(row_step_seconds(stops, args.steps) for _ in range(args.repeats))
        print(f"{name:>28}: {seconds * 1e6:8.1f} µs a row-step, {8 * seconds * 1e3:6.3f} ms a step at batch 8")


if __name__ == "__main__":
    main()
