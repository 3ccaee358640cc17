"""Which replica serves a request: the DP controller's policy, free of sockets (unit-tested).

Load. Each replica reports `load_tokens` (the tokens, prompt + generated so far, of its running
and waiting requests) and how many requests it has received, a few times a second while busy
and at once when it goes idle. Requests sent to it since, which its last report does not
include yet, are added from our own record of what we sent, so a burst of requests between
two reports spreads out instead of piling onto the replica that looked idle.

Prefix affinity. Per replica, a bounded LRU set of chained hashes of the prompts sent there,
one per block of `block` tokens (a whole number of KV pages): the hash of block i covers
tokens [0, (i + 1) * block). A prompt's match on a replica is its number of leading blocks in
that set, times `block`: approximately what that replica's radix cache holds of the prompt
(approximately, because the replica may have evicted it since; the set forgets the least
recently used blocks past `max_blocks`).

Methods:
- "prefix": the replica with the least `load + tokens it would have to prefill` (prompt length
  minus its match). A cached prefix is worth as many tokens of load as it saves, so a request
  goes where its prefix is cached unless that replica is busier by more than the prefix is
  long; bursts of requests sharing a prefix still spread once the loads differ by more.
- "load": the least load, no affinity.
- "round_robin": replicas in turn.
Ties go to the replica that was sent fewer requests, then to the lowest rank.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

METHODS = ("prefix", "load", "round_robin")
BLOCK_TOKENS = 16  # affinity granularity (rounded up to whole pages)
MAX_BLOCKS = 1 << 16  # remembered blocks per replica: ~1M tokens of prefixes at 16, ~6 MB


def block_hashes(token_ids: Sequence[int], block: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`: entry i stands for tokens[: (i+1)*block]."""
    out, h = [], 0
    for start in range(0, len(token_ids) - block + 1, block):
        h = hash((h, *token_ids[start : start + block]))
        out.append(h)
    return out


class PrefixTable:
    """The blocks recently sent to one replica (an LRU set of chained block hashes)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its `hashes`) this replica was sent."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class ReplicaLoad:
    """One replica's last report plus the requests sent to it that the report predates."""

    def __init__(self) -> None:
        self.reported = 0  # load_tokens of the last report
        self.sent = 0  # requests sent so far
        self._unreported: deque[int] = deque()  # tokens of requests sent after the report's count
        self._unreported_tokens = 0

    @property
    def tokens(self) -> int:
        return self.reported + self._unreported_tokens

    def on_send(self, tokens: int) -> None:
        self.sent += 1
        self._unreported.append(tokens)
        self._unreported_tokens += tokens

    def on_report(self, load_tokens: int, received: int) -> None:
        # Reports come in order over one socket: `received` only grows, up to `sent`.
        covered = len(self._unreported) - (self.sent - received)
        for _ in range(max(0, covered)):
            self._unreported_tokens -= self._unreported.popleft()
        self.reported = load_tokens


class Dispatcher:
    def __init__(
        self, num_replicas: int, method: str = "prefix", page_size: int = 1, max_blocks: int = MAX_BLOCKS
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if page_size < 1 or max_blocks < 1:
            raise ValueError(f"page_size ({page_size}) and max_blocks ({max_blocks}) must be >= 1")
        self.method = method
        self.block = page_size * -(-BLOCK_TOKENS // page_size)
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.tables = [PrefixTable(max_blocks) for _ in range(num_replicas)]
        self._next = 0  # round robin

    def pick(self, token_ids: Sequence[int]) -> int:
        """The replica for a request with prompt `token_ids`; records that it is sent there."""
        n = len(self.loads)
        hashes: list[int] = []
        if self.method == "round_robin":
            r, self._next = self._next, (self._next + 1) % n
        elif self.method == "load":
            r = min(range(n), key=lambda i: (self.loads[i].tokens, self.loads[i].sent, i))
        else:
            hashes = block_hashes(token_ids, self.block)
            uncached = [len(token_ids) - self.tables[i].match(hashes) * self.block for i in range(n)]
            r = min(range(n), key=lambda i: (self.loads[i].tokens + uncached[i], self.loads[i].sent, i))
            self.tables[r].add(hashes)
        self.loads[r].on_send(len(token_ids))
        return r

    def on_report(self, dp_rank: int, load_tokens: int, received: int) -> None:
        self.loads[dp_rank].on_report(load_tokens, received)

    def forget_prefixes(self) -> None:
        """The replicas' caches were flushed: no prefix is where it was sent."""
        self.tables = [PrefixTable(t.max_blocks) for t in self.tables]
