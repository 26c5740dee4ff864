"""What stop strings cost a row at every step: ``StopText.push`` timed alone, over a long generation of short pieces.

The scheduler pushes every row's new text through its ``StopText`` at every step, on its own thread, so this cost is
paid batch-size times per step (issue 54's figures: 16 stops of 256 characters cost 705 µs a row-step, about 5.6 ms a
step at batch 8 on a model whose step is ~5 ms). Run it against another checkout's runtime with
``PYTHONPATH=CHECKOUT``.

    python -m bench.stop_strings --steps 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="pushes per row (a row's steps)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case; the median is reported")
    args = parser.parse_args()
    for name, stops in CASES.items():
        seconds = statistics.median(row_step_seconds(stops, args.steps) for _ in range(args.repeats))
        print(f"{name:>28}: {seconds * 1e6:8.1f} µs a row-step, {8 * seconds * 1e3:6.3f} ms a step at batch 8")


if __name__ == "__main__":
    main()
