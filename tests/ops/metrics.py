"""Reading /metrics the way Prometheus does: the text format, parsed by prometheus-client."""

from __future__ import annotations

from django.test import Client
from prometheus_client.parser import text_string_to_metric_families


def scrape(
    client: Client | None = None, **headers: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape: (name, sorted labels) -> value."""
    response = (client or Client()).get("/metrics", **headers)
    assert response.status_code == 200, response.content[:300]
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
