"""The model-server gauges of llm-d's endpoint picker (KServe's LLMInferenceService runs it),
under the names of its vLLM profile, with vLLM's semantics, per replica (`engine` label = the
replica's dp_rank, as vLLM labels its engines; `model_name` = the served name):

    vllm:num_requests_waiting   requests queued, not yet admitted
    vllm:num_requests_running   requests holding KV (decoding, or mid chunked prefill)
    vllm:kv_cache_usage_perc    KV pages held by requests / all pages, in [0, 1] (cached prefixes
                                no request holds are free to evict, so they count as free, as in vLLM)
    vllm:cache_config_info      1, labels block_size (the KV page size) and num_gpu_blocks (pages)

The pods carry `llm-d.ai/engine-type: vllm` so that the picker reads these names (README:
"Kubernetes (llm-d, KServe)"). No other vLLM series is exported: a name that meant something
else here would mislead whatever reads it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from minisgl.server.replica_metrics import ReplicaStats


class VllmProfile:
    """A Prometheus collector over the replicas' latest reports."""

    def __init__(self, replicas: ReplicaStats, model_name: str, page_size: int) -> None:
        self.replicas, self.model_name, self.page_size = replicas, model_name, page_size

    def collect(self) -> Iterator[Metric]:
        reports = sorted(self.replicas.latest.items())
        labels = ["model_name", "engine"]
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be admitted", labels=labels)
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch", labels=labels)
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage: 1 = every page held by a request", labels=labels
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV-cache configuration (its labels)",
            labels=["engine", "block_size", "num_gpu_blocks"],
        )
        for rank, s in reports:
            key = [self.model_name, str(rank)]
            waiting.add_metric(key, s.queued)
            running.add_metric(key, s.running)
            usage.add_metric(key, s.kv_usage)
            info.add_metric([str(rank), str(self.page_size), str(s.kv_total // self.page_size)], 1.0)
        yield from (waiting, running, usage, info)
