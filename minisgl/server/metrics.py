"""Prometheus metrics of the API server (GET /metrics), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from minisgl.message import StatsMsg
from minisgl.server.replica_metrics import ReplicaStats

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise to every scrape
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "minisgl_requests",
            "Finished generation requests (one per choice) by finish reason: stop, length, abort, error",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "Time from the request reaching the server to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds",
            "Time from the request reaching the server to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("minisgl_num_requests_running", "Requests being decoded", registry=r)
        self.queued = Gauge("minisgl_num_requests_waiting", "Requests waiting to start", registry=r)
        self.kv_used = Gauge("minisgl_kv_slots_used", "KV-cache token slots in use", registry=r)
        self.kv_total = Gauge("minisgl_kv_slots_total", "KV-cache token slots in all", registry=r)
        self.kv_swa_used = Gauge("minisgl_kv_swa_slots_used", "Sliding-window KV group: token slots in use", registry=r)
        self.kv_swa_total = Gauge("minisgl_kv_swa_slots_total", "Sliding-window KV group: token slots in all",
                                  registry=r)
        self.state_used = Gauge("minisgl_state_slots_used", "Recurrent-state slots held by requests (hybrid "
                                "linear-attention models)", registry=r)
        self.state_total = Gauge("minisgl_state_slots_total", "Recurrent-state slots in all", registry=r)
        self.state_snapshots = Gauge("minisgl_state_snapshots", "Recurrent-state snapshots the prefix cache holds "
                                     "(hybrid linear-attention models)", registry=r)
        self.state_snapshots_total = Gauge("minisgl_state_snapshots_total", "Recurrent-state snapshot slots in all",
                                           registry=r)
        self.cache_hit_rate = Gauge(
            "minisgl_prefix_cache_hit_rate", "Share of admitted prompt tokens served from the prefix cache", registry=r
        )
        self.spec_proposed = Counter(
            "minisgl_spec_draft_tokens", "Draft tokens proposed by speculative decoding", registry=r
        )
        self.spec_accepted = Counter("minisgl_spec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.spec_accept_length = Gauge(
            "minisgl_spec_mean_accepted_length",
            "Tokens a request gains per speculative step (accepted drafts + 1), mean since start",
            registry=r,
        )
        self.host_kv = {  # the host KV tier; the last three are cumulative since start
            "host_kv_bytes": Gauge("minisgl_host_kv_bytes_used", "Bytes of KV held in the host tier", registry=r),
            "host_kv_hits": Gauge("minisgl_host_kv_hits", "Prefix hits served (partly) from the host tier",
                                  registry=r),
            "host_kv_tokens_loaded": Gauge("minisgl_host_kv_tokens_loaded", "Tokens of KV loaded back from the "
                                           "host tier", registry=r),
            "host_kv_load_s": Gauge("minisgl_host_kv_load_seconds", "Seconds spent loading KV back from the "
                                    "host tier", registry=r),
        }
        self._spec_seen = (0, 0)  # the replicas' summed cumulative counts already added
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)  # export every series from the start, at 0
        self.replicas = ReplicaStats()  # per data-parallel replica (dp_rank label)
        r.register(self.replicas)

    def on_stats(self, report: StatsMsg) -> None:
        """A replica's report: its own series, and the totals over every replica's latest."""
        self.replicas.update(report)
        s = self.replicas.total()
        self.running.set(s.running)
        self.queued.set(s.queued)
        self.kv_used.set(s.kv_used)
        self.kv_total.set(s.kv_total)
        self.kv_swa_used.set(s.kv_swa_used)
        self.kv_swa_total.set(s.kv_swa_total)
        self.state_used.set(s.state_used)
        self.state_total.set(s.state_total)
        self.state_snapshots.set(s.state_snapshots)
        self.state_snapshots_total.set(s.state_snapshots_total)
        self.cache_hit_rate.set(s.cache_hit_rate)
        for field, gauge in self.host_kv.items():
            gauge.set(getattr(s, field))
        proposed, accepted = self._spec_seen
        self.spec_proposed.inc(max(0, s.spec_proposed - proposed))
        self.spec_accepted.inc(max(0, s.spec_accepted - accepted))
        self._spec_seen = (max(proposed, s.spec_proposed), max(accepted, s.spec_accepted))
        if s.spec_verified:
            self.spec_accept_length.set((s.spec_accepted + s.spec_verified) / s.spec_verified)

    def render(self) -> bytes:
        return generate_latest(self.registry)
