"""Where the server's processes listen (ZMQ endpoints), shared by the launcher, the API
server and every worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Addresses:
    """ZMQ endpoints of one server; each is bound by its receiver. ipc:// for one box; the
    fields are plain endpoint strings, so tcp://host:port works for remote ranks later.

    With --dp > 1, `scheduler` is the DP controller's PULL (tokenizers and the detokenizer
    send there as before) and each replica's scheduler rank 0 pulls from `replicas[r]`; see
    `for_replica`."""

    api: str  # API server's PULL: replies, errors and stats
    scheduler: str  # scheduler rank 0's PULL (the DP controller's with dp > 1): requests and aborts
    detokenizer: str  # detokenizer's PULL: tokens (and, with 0 tokenizers, requests)
    tokenizers: list[str]  # one PULL per tokenizer worker
    replicas: list[str] = field(default_factory=list)  # with dp > 1: each replica's scheduler PULL
    stats: str | None = None  # where a scheduler sends StatsMsg; None: the API server

    @staticmethod
    def ipc(folder: str | Path, num_tokenizers: int, dp: int = 1) -> Addresses:
        def a(name: str) -> str:
            return f"ipc://{Path(folder) / name}.sock"

        return Addresses(
            api=a("api"),
            scheduler=a("scheduler"),
            detokenizer=a("detokenizer"),
            tokenizers=[a(f"tokenizer{i}") for i in range(num_tokenizers)],
            replicas=[a(f"replica{r}") for r in range(dp)] if dp > 1 else [],
        )

    def for_replica(self, dp_rank: int) -> Addresses:
        """The view of replica `dp_rank`'s scheduler: its own inbox, and its load reports to
        the DP controller (which forwards them to the API server). Unchanged without DP."""
        if not self.replicas:
            return self
        return dataclasses.replace(self, scheduler=self.replicas[dp_rank], stats=self.scheduler)
