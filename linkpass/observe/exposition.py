"""The one place prometheus_client is imported: registries, the process and runtime collectors,
metric families for the agent's and the coordinator's collectors, and the text exposition. A
change of client library, or of its version's names, is this file."""
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "CollectorRegistry", "CounterMetricFamily", "GCCollector", "GaugeMetricFamily",
           "HistogramMetricFamily", "PlatformCollector", "ProcessCollector", "generate_latest"]
