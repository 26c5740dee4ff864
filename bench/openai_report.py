"""What ``draftsmith openai-load`` prints: one run's outcomes, and the table over client levels (speculation on and
off side by side). Apart from bench/openai_load.py, which drives the clients, so each reads in one sitting."""

from __future__ import annotations

import json


def level_summary(runs: list[dict]) -> list[dict]:
    """Per client level: speculative and plain (speculation off) tokens/s, their ratio, the speculative run's p95
    time to first text and the mean draft length the server planned; the speculative throughput against one
    client's (``scaling``)."""
    levels: dict[int, dict] = {}
    for run in runs:
        row = levels.setdefault(run["clients"], {"clients": run["clients"]})
        kind = "speculative" if run["speculation"] else "plain"
        row[kind] = run["output_tokens_per_s"]
        row[f"{kind}_ttft_p95_s"] = run["ttft_s"]["p95"]
        if run["speculation"]:
            row["ttft_p95_s"] = run["ttft_s"]["p95"]
            row["mean_planned_k"] = run.get("planned_draft_length", {}).get("mean", 0.0)
    out = [levels[c] for c in sorted(levels)]
    one = levels.get(1, {}).get("speculative")
    for row in out:
        if "speculative" in row and "plain" in row and row["plain"]:
            row["ratio"] = row["speculative"] / row["plain"]
        if one and "speculative" in row:
            row["scaling"] = row["speculative"] / one
    return out


def levels_report(runs: list[dict], as_json: bool) -> str:
    """Every run's report, then one line per client level (``level_summary``)."""
    summary = level_summary(runs)
    if as_json:
        return json.dumps({"levels": summary, "runs": runs}, indent=2)
    lines = []
    for run in runs:
        lines.append(f"--- {run['clients']} clients, speculation {'on' if run['speculation'] else 'off'}")
        lines.append(run_report(run, False))
    lines.append("clients  speculative tok/s  plain tok/s  ratio  TTFT p95 (s)  mean planned k")
    for row in summary:
        lines.append(
            f"{row['clients']:>7}  {row.get('speculative', 0):>17.1f}  {row.get('plain', 0):>11.1f}  "
            f"{row.get('ratio', 0):>5.2f}  {row.get('ttft_p95_s', 0):>12.3f}  "
            f"{row.get('mean_planned_k', 0):>14.2f}"
        )
    return "\n".join(lines)


def run_report(report: dict, as_json: bool) -> str:
    """One run: outcomes, throughput, latency percentiles and whatever else it measured."""
    if as_json:
        return json.dumps(report, indent=2)
    lines = [
        f"{report['sent']} sent: {report['answered']} answered, {report['cancelled']} cancelled, "
        f"{report['failed']} failed, {report['lost']} lost in {report['duration_s']:.1f} s",
        f"output: {report['output_tokens']} tokens, {report['output_tokens_per_s']:.1f} tok/s",
    ]
    for name, label in (("ttft_s", "time to first text"), ("itl_s", "inter-chunk latency")):
        p = report[name]
        lines.append(f"{label}: p50 {p['p50']:.3f} s, p95 {p['p95']:.3f} s, p99 {p['p99']:.3f} s")
    if "server_rss_mib" in report:
        r = report["server_rss_mib"]
        lines.append(
            f"server RSS: {r['start']:.0f} MiB at start, {r['peak']:.0f} peak, {r['end']:.0f} at the end; "
            f"{100 * r['growth_after_first_minute']:+.1f}% after the first minute"
        )
    if "identical" in report:
        i = report["identical"]
        lines.append(
            f"identical to alone: {i['checked'] - i['mismatches']}/{i['checked']} ({i['distinct']} distinct requests)"
        )
    if "hostile_connections" in report:
        h = report["hostile_connections"]
        lines.append(
            f"held beside: {h['idle']} idle and {h['slow_header']} slow-header connections ({h['opened']} "
            f"opened, {h['closed_by_server']} closed by the server, {h['refused']} refused)"
        )
    if "watched_stream_gap_s" in report:
        p = report["watched_stream_gap_s"]
        lines.append(f"watched stream's gaps: p50 {p['p50']:.3f} s, p99 {p['p99']:.3f} s")
    if "hostile_client" in report:
        h = report["hostile_client"]
        lines.append(
            f"hostile client: {h['sent']} requests of {h['body_bytes']} bytes with {h['sends']}, answered "
            f"{h['by_status']}, slowest {h['max_latency_s']:.3f} s"
        )
    if "event_loop_lag" in report:
        g = report["event_loop_lag"]
        lines.append(
            f"server's event-loop lag: {g['samples']} samples, {g['over_50ms']} over 50 ms, max <= "
            f"{g['max_at_most_s']} s"
        )
    if "health" in report:
        h = report["health"]
        lines.append(f"health: {h['probes']} probes, {h['failed']} failed, slowest {h['max_latency_s']:.3f} s")
    lines.extend(f"error: {error}" for error in report["errors"])
    return "\n".join(lines)
