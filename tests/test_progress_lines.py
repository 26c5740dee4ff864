"""Long stages report in a log: the distillation's generation phase says how far it got at least once a minute
where no progress bar shows (a log file, not a terminal), with what it does, how far and the time left."""

from __future__ import annotations

import io
import re

from fakes import BigramEngine, random_table


class FakeClock:
    """Seconds that pass only when the engine is called: ``step`` per forward call."""

    def __init__(self, step: float):
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        return self.now


def _ticking(engine: BigramEngine, clock: FakeClock) -> BigramEngine:
    """The clock moves a step with every call the engine makes (its observer)."""

    def tick(call) -> None:
        clock.now += clock.step

    engine.watch(tick)
    return engine


def test_generation_says_how_far_it_got_at_least_once_a_minute():
    from builder.distill.continuations import Job, generate_with_engine
    from builder.progress import Heartbeat

    clock = FakeClock(step=7.0)  # an engine step every 7 s of the fake clock
    engine = _ticking(BigramEngine(random_table(12, seed=0)), clock)
    lines, advanced = [], []
    beat = Heartbeat("target: training continuations", 10, lines.append, advanced.append, clock=clock)
    samples = generate_with_engine(
        engine, [Job([1, 2, 3]) for _ in range(10)], 20, top_k=4, eos_ids=[], batch_size=4, advance=beat
    )
    assert len(samples) == 10 and sum(advanced) == 10 and 0 not in advanced  # the bar sees finished jobs only
    elapsed = clock.now - 1000.0
    assert len(lines) >= int(elapsed // 67)  # never more than a minute and a step without a line
    times = [float(re.search(r", (\d+) s, ", line).group(1)) for line in lines]
    assert all(b - a >= 60 for a, b in zip(times, times[1:]))  # and not more often than once a minute
    assert all(line.startswith("target: training continuations: ") for line in lines)
    done = [int(re.search(r": (\d+)/10 ", line).group(1)) for line in lines]
    assert done == sorted(done) and done[-1] >= 4
    assert any("s left" in line for line in lines if not line.startswith("target: training continuations: 0/"))


def test_time_left_is_the_rate_so_far_or_the_deadline_whichever_comes_first():
    from builder.progress import Heartbeat

    clock = FakeClock(step=0.0)
    beat = Heartbeat("gen", 100, lambda line: None, clock=clock)
    assert beat.line(clock.now + 30) == "gen: 0/100 (0%), 30 s, time left not known yet"
    beat(20)
    assert beat.line(clock.now + 60) == "gen: 20/100 (20%), 60 s, about 240 s left"  # 20 in 60 s: 80 in 240 s
    capped = Heartbeat("gen", 100, None, deadline=clock.now + 100, clock=clock)
    capped(20)
    assert capped.line(clock.now + 60) == "gen: 20/100 (20%), 60 s, about 40 s left"  # the deadline stops it first


def test_on_a_terminal_the_bar_reports_and_no_lines_are_printed():
    from builder.progress import Heartbeat

    clock = FakeClock(step=0.0)
    advanced = []
    beat = Heartbeat("gen", 5, None, advanced.append, clock=clock)
    for _ in range(5):
        clock.now += 100
        beat(1)
    assert advanced == [1] * 5 and beat.done == 5


def test_the_distill_pipeline_prints_generation_lines_into_a_log(monkeypatch):
    """The pipeline's stages are wired to it: on a console that is not a terminal, the lines reach the log."""
    from rich.console import Console

    from builder.distill import run

    log = io.StringIO()
    console = Console(file=log, force_terminal=False, width=200)
    with run.progress_bars(console, quiet=False) as progress:
        beat = run.task(progress, "target: held-out continuations", 3)
        assert beat.say is not None
        beat.last -= 61  # a minute has passed since the stage began
        beat(1)
    assert re.search(r"target: held-out continuations: 1/3 \(33%\), \d+ s, about \d+ s left", log.getvalue())
    terminal = Console(file=io.StringIO(), force_terminal=True)
    with run.progress_bars(terminal, quiet=False) as progress:
        assert run.task(progress, "x", 1).say is None


def test_the_builds_evaluation_says_how_far_it_got(tiny_pair, tmp_path, monkeypatch):
    """build-engines in a log: the evaluation stage (minutes on a large vocabulary) reports its windows through
    a Heartbeat; with a clock that moves 61 s each time it is read, a line comes for every window of every
    session (engines and their fp32 references, one open at a time)."""
    import functools

    import builder.build
    import builder.evaluate
    from builder.progress import Heartbeat
    from runtime.bundle import BuildSpec

    ticks = iter(range(0, 100_000, 61))
    monkeypatch.setattr(builder.evaluate, "Heartbeat", functools.partial(Heartbeat, clock=lambda: float(next(ticks))))
    lines = []
    target, draft = tiny_pair
    manifest = builder.build.build(
        BuildSpec(
            target=str(target),
            draft=str(draft),
            k=2,
            max_context=128,
            target_quant="fp32",
            draft_quant="fp32",
            eval_tokens=300,
        ),
        tmp_path / "b",
        say=lines.append,
    )
    windows = manifest.report["eval_windows"]
    assert all(re.fullmatch(r"evaluate: windows: \d+/\d+ \(\d+%\), \d+ s, about \d+ s left", x) for x in lines)
    passes = int(re.search(r"/(\d+) ", lines[-1]).group(1))  # every window of every session: one opens at a time
    assert windows >= 2 and passes % windows == 0 and passes >= 2 * windows and len(lines) == passes
    assert lines[-1].startswith(f"evaluate: windows: {passes}/{passes} (100%)")
