"""A /metrics text as the tests read it (its samples, its families), and the families of the one table
(runtime/metric_families.py) every server's /metrics must have."""

from __future__ import annotations

from runtime.metric_families import FAMILIES


def prometheus_samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def type_lines(text: str, prefixes: tuple[str, ...] = ("",)) -> dict[str, str]:
    """{family name: kind} from the ``# TYPE`` lines of a Prometheus text (the names starting with ``prefixes``)."""
    found = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    return {name: kind for name, kind in found.items() if name.startswith(prefixes)}


def table_names() -> dict[str, str]:
    """{family name on /metrics: kind} of the table."""
    return {f.exported: f.kind for f in FAMILIES}
