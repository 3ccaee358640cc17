"""Per-replica metrics: each data-parallel replica's latest StatsMsg, exported with a `dp_rank`
label (`minisgl_replica_*`), and summed over replicas for the unlabeled totals of metrics.py.
A server without --dp has one replica, dp_rank 0."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from minisgl.message import StatsMsg

_GAUGES = (  # (name, help, StatsMsg field)
    ("minisgl_replica_num_requests_running", "Requests being decoded, per replica", "running"),
    ("minisgl_replica_num_requests_waiting", "Requests waiting to start, per replica", "queued"),
    ("minisgl_replica_kv_slots_used", "KV-cache token slots in use, per replica", "kv_used"),
    ("minisgl_replica_kv_slots_total", "KV-cache token slots in all, per replica", "kv_total"),
    (
        "minisgl_replica_load_tokens",
        "Tokens (prompt + generated so far) of running and waiting requests: the load the DP dispatcher weighs",
        "load_tokens",
    ),
)
_COUNTERS = (
    ("minisgl_replica_prompt_tokens", "Prompt tokens admitted, per replica", "prompt_tokens"),
    (
        "minisgl_replica_prefix_cache_hit_tokens",
        "Admitted prompt tokens served from the replica's prefix cache",
        "cache_hit_tokens",
    ),
    ("minisgl_replica_requests_received", "Requests the replica received", "received"),
)


class ReplicaStats:
    """The latest report of every replica; also a Prometheus collector of them."""

    def __init__(self) -> None:
        self.latest: dict[int, StatsMsg] = {}

    def update(self, s: StatsMsg) -> None:
        self.latest[s.dp_rank] = s

    def total(self) -> StatsMsg:
        """The sums over replicas (dp_rank -1)."""
        fields = ("running", "queued", "kv_used", "kv_total", "prompt_tokens", "cache_hit_tokens",
                  "spec_proposed", "spec_accepted", "spec_verified", "kv_swa_used", "kv_swa_total",
                  "host_kv_bytes", "host_kv_hits", "host_kv_tokens_loaded", "host_kv_load_s", "state_used",
                  "state_total", "state_snapshots", "state_snapshots_total")
        sums = {f: sum(getattr(s, f) for s in self.latest.values()) for f in fields}
        load = sum(s.load_tokens for s in self.latest.values())
        received = sum(s.received for s in self.latest.values())
        return StatsMsg(**sums, dp_rank=-1, load_tokens=load, received=received)

    def collect(self) -> Iterator[Metric]:
        reports = sorted(self.latest.items())
        for name, doc, attr in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["dp_rank"])
            for rank, s in reports:
                g.add_metric([str(rank)], getattr(s, attr))
            yield g
        hit = GaugeMetricFamily(
            "minisgl_replica_prefix_cache_hit_rate",
            "Share of the replica's admitted prompt tokens served from its prefix cache",
            labels=["dp_rank"],
        )
        for rank, s in reports:
            hit.add_metric([str(rank)], s.cache_hit_rate)
        yield hit
        for name, doc, attr in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["dp_rank"])
            for rank, s in reports:
                c.add_metric([str(rank)], getattr(s, attr))
            yield c
