"""Prometheus metrics of one router process, on a private registry built by `server.run`.

Request-path updates go through cached label children (one dict lookup per request), and
everything that is a level rather than an event (in-flight per engine, routable engines,
discovery health) is read from the live objects only when `/metrics` is scraped. No Trio here
beyond reading its clock at a scrape, no global registry.

- `registry`: `Metrics`, the registry, the calls that update it, and its exposition;
- `families`: the counters and histograms updated as things happen, declared by concern;
- `levels`: the collectors that read states from the live objects at scrape time;
- `engines`: the per-engine gauges, written as text straight from the routing table.
"""

from __future__ import annotations

from .engines import ACTIVE_S
from .families import LATENCY_BUCKETS, NO_LABEL, TTFB_BUCKETS, TTFT_ERROR_BUCKETS
from .levels import ModelLoadView
from .registry import CONTENT_TYPE, Metrics

__all__ = [
    "ACTIVE_S",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "NO_LABEL",
    "TTFB_BUCKETS",
    "TTFT_ERROR_BUCKETS",
    "Metrics",
    "ModelLoadView",
]
