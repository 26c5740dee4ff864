"""The bench's report, rendered: the results table, the peers' table, a summary in sentences, and the plot.

Pure functions of the report dict that ``bench.speed_report`` assembles, so a saved JSON report can be rendered again.
"""

from __future__ import annotations

from pathlib import Path


def _fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def render_table(console, report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"draftsmith bench: {report['bundle']}", show_lines=False, pad_edge=False)
    several = len({r.get("drafter", "") for r in report["results"] if r["mode"] == "speculative"}) > 1
    for name in (
        "workload",
        "b",
        "k",
        *(("drafter",) if several else ()),
        "k̄",
        "accept",
        "α",
        "len",
        "tok/s",
        "TTFT ms",
        "p50 ms",
        "p95 ms",
        "speedup",
        "paired (95%)",
        "predicted",
        "c",
        "same",
    ):
        table.add_column(name, justify="left" if name == "workload" else "right")
    best = {w: (r["batch"], r["k"], r.get("drafter", "")) for w, r in report["best_k"].items()}
    for r in report["results"]:
        spec = r["mode"] == "speculative"
        mark = "*" if spec and best.get(r["workload"]) == (r["batch"], r["k"], r.get("drafter", "")) else ""
        table.add_row(
            r["workload"],
            str(r["batch"]),
            f"{r['k']}{mark}" if spec else r["mode"],
            *((_drafter_label(r.get("drafter", "")) if spec else "",) if several else ()),
            _fmt(r.get("mean_draft_length")) if spec else "",
            _fmt(r["acceptance_rate"]) if spec else "",
            _fmt(r["alpha"]) if spec else "",
            _fmt(r["mean_acceptance_length"]) if spec else "",
            _fmt(r["tokens_per_second"], ".1f"),
            _fmt(r["ttft_mean"] * 1e3, ".0f"),
            _fmt(r["latency_p50"] * 1e3, ".1f"),
            _fmt(r["latency_p95"] * 1e3, ".1f"),
            _fmt(r["speedup"]) + "x",
            _paired(r) if spec else "",
            (_fmt(r["predicted_speedup"]) + "x") if spec else "",
            _fmt(r["c"]) if spec else "",
            _fmt(r["identical_to_target"], ".0%", "") if spec else "",
        )
    console.print(table)
    render_peers_table(console, report)


def _drafter_label(label: str) -> str:
    """A drafter's column: model@BUNDLE shortened to its folder's name."""
    return "model@" + Path(label[len("model@") :]).name if label.startswith("model@") else label


def _paired(row: dict) -> str:
    """The geometric mean of the per-prompt paired ratios and its bootstrap interval."""
    interval = row.get("speedup_interval")
    text = _fmt(row.get("paired_speedup")) + "x"
    return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def render_peers_table(console, report: dict) -> None:
    """Every peer next to us on the same prompts: tok/s, speedup over its own plain decoding and over our
    target-only decoding, and whether its greedy ids equal ours."""
    rows = [p for p in report.get("peers", []) if "skipped" not in p]
    if not rows:
        return
    from rich.table import Table

    table = Table(title="peers on the same prompt token ids (greedy, one sequence at a time)", pad_edge=False)
    for name in ("system", "workload", "mode", "k", "tok/s", "vs own plain", "vs our target-only", "same ids"):
        table.add_column(name, justify="left" if name in ("system", "workload", "mode") else "right")
    for workload, ours in report.get("peers_reference", {}).items():
        table.add_row(
            "draftsmith",
            workload,
            "target-only",
            "",
            _fmt(ours["target_tokens_per_second"], ".1f"),
            "1.00x",
            "1.00x",
            "",
        )
        if ours.get("speculative_tokens_per_second"):
            vs = _ratio(ours["speculative_tokens_per_second"], ours["target_tokens_per_second"])
            table.add_row(
                "draftsmith",
                workload,
                "speculative",
                str(ours["k"]),
                _fmt(ours["speculative_tokens_per_second"], ".1f"),
                _fmt(vs) + "x",
                _fmt(vs) + "x",
                _fmt(ours.get("speculative_identical_to_ours"), ".0%", ""),
            )
    for p in sorted(rows, key=lambda r: (r["workload"], r["peer"])):
        table.add_row(
            p["peer"],
            p["workload"],
            p["mode"],
            "" if p.get("k") is None else str(p["k"]),
            _fmt(p["tokens_per_second"], ".1f"),
            _fmt(p.get("speedup")) + "x",
            _fmt(p.get("speedup_vs_ours_target")) + "x",
            _fmt(p.get("identical_to_ours"), ".0%", ""),
        )
    console.print(table)


def _ratio(a, b):
    return a / b if a is not None and b else None


def render_summary(console, report: dict) -> None:
    for workload, row in report["best_k"].items():
        verdict = "speculation pays" if row["speedup"] > 1.0 else "target-only is faster: speculation does not pay"
        console.print(
            f"best k for [bold]{workload}[/]: k={row['k']} ({row['speedup']:.2f}x over target-only, "
            f"predicted {row['predicted_speedup']:.2f}x; {verdict})"
        )
    rec = report.get("recommended_k")
    if rec:
        console.print(
            f"recommended default k over {', '.join(report['best_k'])}: [bold]{rec['k']}[/] "
            f"(geometric-mean speedup {rec['geomean_speedup']:.2f}x); "
            f"bundle default now {rec['bundle_default_k']}" + (" [written]" if rec.get("written") else "")
        )
    quality = report.get("quality")
    if quality:
        scores = ", ".join(
            f"{name} {value:.2f}" if isinstance(value, float) else f"{name}: {value}"
            for name, value in quality.items()
            if name != "eval_tokens"
        )
        console.print(f"quality, perplexity on {quality['eval_tokens']} tokens of the evaluation set: {scores}")
    where = report.get("where_time_goes")
    if where:
        for w in where:
            console.print(
                f"time at {w['workload']} k={w['k']}: draft {w['draft']:.0%} (ORT {w['draft_ort']:.0%}), "
                f"verify {w['verify']:.0%} (ORT {w['verify_ort']:.0%}), prefill {w['prefill']:.0%}, "
                f"outside the engines {w['other']:.0%}; draft call {w['draft_call_ms']:.1f} ms, "
                f"verify call {w['verify_call_ms']:.1f} ms ({w['verify_vs_target_step']:.2f}x a target-only "
                f"step)"
            )
    mem = report.get("memory")
    if mem and "draft_overhead_fraction" in mem:
        t, s = mem["target"], mem["speculative"]
        console.print(
            f"peak RSS while decoding: target-only {t['peak_rss_decoding'] / 2**20:.0f} MiB, speculative "
            f"{s['peak_rss_decoding'] / 2**20:.0f} MiB ({mem['draft_overhead_fraction']:+.0%} for the "
            f"draft); peak while loading {t['peak_rss_loading'] / 2**20:.0f} / "
            f"{s['peak_rss_loading'] / 2**20:.0f} MiB; engines: "
            + ", ".join(
                f"{role} {e['size_bytes'] / 1e6:.0f} MB ({e['quant']})"
                for role, e in report.get("limit", {}).get("engines", {}).items()
            )
        )
    limit = report.get("limit")
    if limit and "engines" in limit:
        bw = limit["bandwidth"]["bytes_per_second"]
        t = limit["engines"]["target"]
        line = (
            f"limit: memory bandwidth {bw / 1e9:.1f} GB/s ({limit['bandwidth']['threads']} threads); target reads "
            f"{t['bytes_per_token'] / 1e6:.0f} MB of weights per token -> bound {t['bound_tokens_per_second']:.1f} "
            f"tok/s"
        )
        if limit.get("target_only_tokens_per_second"):
            line += (
                f"; target-only decodes at {limit['target_only_tokens_per_second']:.1f} tok/s (one target call "
                f"{limit['target_only_step_ms']:.1f} ms) = "
                f"{limit['fraction_of_bound']:.0%} of the bound ({limit['bound_over_measured']:.2f}x from it)"
            )
        d = limit["engines"].get("draft")
        if d:
            line += (
                f"; draft reads {d['bytes_per_token'] / 1e6:.0f} MB/token "
                f"(bound {d['bound_tokens_per_second']:.0f} tok/s)"
            )
        console.print(line)
    described = set()
    for p in report.get("peers", []):
        if "skipped" in p:
            console.print(f"peer {p['peer']}: skipped ({p['skipped']})")
        for key in ("assistant", "draft"):
            if p.get(key) and (p["peer"], key) not in described:
                described.add((p["peer"], key))
                console.print(f"peer {p['peer']} {p['mode']}: {key} = {p[key]}")


def plot(report: dict, path: Path) -> None:
    """Speedup (measured, and Leviathan's prediction dotted) and acceptance (rate, and alpha dotted) against k, one
    line per workload (and batch size, dashed above 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = peer_bars(report)
    fig, axes = plt.subplots(1, 3 if systems else 2, figsize=(18 if systems else 10, 4.5))
    left, right = axes[0], axes[1]
    spec = [r for r in report["results"] if r["mode"] == "speculative"]
    for workload in dict.fromkeys(r["workload"] for r in spec):
        for batch in sorted({r["batch"] for r in spec if r["workload"] == workload}):
            mine = sorted((r for r in spec if r["workload"] == workload and r["batch"] == batch), key=lambda r: r["k"])
            label = workload if batch == 1 else f"{workload} (batch {batch})"
            style = "-" if batch == 1 else "--"
            ks = [r["k"] for r in mine]
            left.plot(ks, [r["speedup"] for r in mine], style, marker="o", label=label)
            left.plot(
                ks, [r["predicted_speedup"] for r in mine], ":", marker=".", color=left.lines[-1].get_color(), alpha=0.6
            )
            right.plot(ks, [r["acceptance_rate"] for r in mine], style, marker="o", label=label)
            right.plot(ks, [r["alpha"] for r in mine], ":", marker=".", color=right.lines[-1].get_color(), alpha=0.6)
    all_k = sorted({r["k"] for r in spec})
    for axis in (left, right):
        axis.set_xticks(all_k)
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set(
        xlabel="k (draft tokens per step)",
        ylabel="speedup over target-only",
        title="speedup: measured (solid), predicted (dotted)",
    )
    right.set(
        xlabel="k (draft tokens per step)",
        ylabel="acceptance",
        ylim=(0, 1.05),
        title="acceptance rate (solid) and α (dotted)",
    )
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    if systems:
        _plot_peers(axes[2], systems)
    fig.suptitle(Path(report["bundle"]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def peer_bars(report: dict) -> dict[str, dict[str, float]]:
    """{system label: {workload: tok/s}} for us (target-only, speculative at the best k) and every peer row, on the
    peers' prompts."""
    bars: dict[str, dict[str, float]] = {}
    for workload, ours in report.get("peers_reference", {}).items():
        bars.setdefault("draftsmith target-only", {})[workload] = ours["target_tokens_per_second"] or 0.0
        if ours.get("speculative_tokens_per_second"):
            bars.setdefault("draftsmith speculative", {})[workload] = ours["speculative_tokens_per_second"]
    for p in report.get("peers", []):
        if "skipped" not in p:
            bars.setdefault(f"{p['peer']} {p['mode']}", {})[p["workload"]] = p["tokens_per_second"]
    return bars if len(bars) > 1 else {}


def _plot_peers(axis, systems: dict[str, dict[str, float]]) -> None:
    workloads = list(dict.fromkeys(w for by in systems.values() for w in by))
    width = 0.8 / len(systems)
    for i, (label, by) in enumerate(systems.items()):
        xs = [j + i * width for j, w in enumerate(workloads) if w in by]
        axis.bar(
            xs,
            [by[w] for w in workloads if w in by],
            width,
            label=label,
            hatch="" if label.startswith("draftsmith") else "//",
        )
    axis.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    axis.set(ylabel="tokens/s", title="us and the peers, same prompts")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
