"""Reading a Prometheus scrape in tests: its samples by name and labels, not by how a number
is printed.

mountd's ``/metrics`` is written by ``prometheus_client`` (:mod:`mountd.stats.metrics`),
which prints every value in Go's float format (``30.0``, ``3e+09``); a test that matched
lines of text would test that format. :func:`scraped` parses the text with
``prometheus_client``'s own parser instead, so tests assert on the series and their values.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["scraped"]


def scraped(text: str) -> dict[str, float]:
    """Every sample of ``text`` (the text exposition format) → its value, keyed as a sample
    is written: its name, then its labels in name order (``quiverfs_hits_total``,
    ``quiverfs_dataset_hits_total{dataset="imagenet"}``; label values as they are, not
    escaped)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out
