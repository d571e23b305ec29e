"""Parse Prometheus exposition text into {(sample name, labels): value}."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse(text: str | bytes) -> Samples:
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; a missing sample is an error, not 0."""
    key = (name, frozenset(labels.items()))
    if key not in samples:
        raise KeyError(f"no sample {name}{labels or ''} in the scrape")
    return samples[key]


def metric_names(samples: Samples) -> set[str]:
    return {name for name, _labels in samples}
