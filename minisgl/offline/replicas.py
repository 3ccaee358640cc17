"""The offline LLM's data parallelism, `LLM(dp_size=N)`: replica 0 is the LLM itself (in this
process); replicas 1..N-1 are full LLMs in spawned processes, each on its own device(s).

`generate` tokenizes and checks every prompt and draws every missing seed here, in input
order, exactly as one replica would; then it splits the requests by cost (prompt + max_tokens
tokens, largest first to the least loaded replica), runs shard 0 here while the other replicas
run theirs, and puts the results back in input order. So results equal those of dp_size=1
wherever a request's tokens do not depend on which other requests share its batches (greedy
and seeded sampling on the CPU; on a GPU, up to the batch-size dependence of the kernels).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from minisgl.scheduler.request import Request

START_TIMEOUT_S = 1800.0  # loading a large checkpoint from a slow disk


def split_by_cost(costs: Sequence[int], n: int) -> list[list[int]]:
    """Indices of `costs` in n shards of near-equal total cost (largest first to the lightest
    shard; ties to the lowest shard), each shard in input order."""
    shards: list[list[int]] = [[] for _ in range(n)]
    totals = [0] * n
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = min(range(n), key=lambda k: (totals[k], k))
        shards[k].append(i)
        totals[k] += costs[i]
    return [sorted(s) for s in shards]


def replica_options(options: dict[str, Any], dp_rank: int) -> dict[str, Any]:
    """LLM options of replica `dp_rank`: its GPUs follow the previous replica's."""
    tp = options.get("tp_size", 1)
    return {**options, "base_gpu_id": options.get("base_gpu_id", 0) + dp_rank * tp}


def _replica_main(conn: Connection, make_replica: Callable[[int], Any], dp_rank: int, device: str,
                  dp_size: int) -> None:
    from minisgl.distributed.placement import share_cpu

    # No PR_SET_PDEATHSIG here (it fires when the *thread* that started us ends, and an LLM
    # may live in any thread): if the parent dies, our recv() below ends with EOFError.
    share_cpu(device, dp_size)
    try:
        llm = make_replica(dp_rank)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", type(e).__name__, str(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            return
        if msg[0] == "shutdown":
            llm.shutdown()
            return
        try:
            conn.send(("ok", llm.generate(msg[1], msg[2], use_tqdm=False)))
        except Exception as e:  # noqa: BLE001 - the parent raises it
            conn.send(("error", type(e).__name__, str(e)))


class ReplicaPool:
    """Replicas 1..N-1 of an LLM, one process each. `make_replica(dp_rank)` (picklable: it is
    sent to the spawned process) builds a replica there: an object with the LLM's
    `generate(prompts, params, use_tqdm)` and `shutdown()`."""

    def __init__(self, dp_size: int, make_replica: Callable[[int], Any], device: str) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self.conns: list[Connection] = []
        # Not daemonic: a replica with tp_size > 1 starts its own rank processes. shutdown()
        # (also the LLM's finalizer, at exit) stops them; a replica whose parent died stops at
        # its next read of the pipe.
        self.procs: list[mp.process.BaseProcess] = []
        for r in range(1, dp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_replica_main, args=(child, make_replica, r, device, dp_size),
                name=f"minisgl-llm-replica{r}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_ready(self) -> None:
        for r in range(1, len(self.conns) + 1):
            msg = self._recv(r, START_TIMEOUT_S)
            if msg[0] == "error":
                self.shutdown()
                raise _error(r, msg)

    def _recv(self, r: int, timeout: float | None = None) -> Any:
        conn, proc = self.conns[r - 1], self.procs[r - 1]
        ready = wait([conn, proc.sentinel], timeout)
        if conn in ready:
            try:
                return conn.recv()
            except EOFError:
                pass
        elif not ready:
            raise RuntimeError(f"LLM replica {r} (pid {proc.pid}) did not answer within {timeout:.0f} s")
        proc.join(1.0)
        raise RuntimeError(f"LLM replica {r} (pid {proc.pid}) died (exit code {proc.exitcode})")

    def generate(self, reqs: list[Request], run_local: Callable[[list[Request]], list[dict[str, Any]]]) -> list[dict]:
        """Results of `reqs` (checked, seeded requests of replica 0) in their order."""
        n = len(self.conns) + 1
        shards = split_by_cost([len(r.prompt) + r.params.max_tokens for r in reqs], n)
        sent = []
        for r, shard in enumerate(shards[1:], start=1):
            if shard:  # concrete seeds: the replica draws none of its own
                params = [dataclasses.replace(reqs[i].params, seed=reqs[i].seed) for i in shard]
                self.conns[r - 1].send(("generate", [reqs[i].prompt for i in shard], params))
                sent.append(r)
        out: list[dict[str, Any] | None] = [None] * len(reqs)
        try:
            for i, res in zip(shards[0], run_local([reqs[i] for i in shards[0]])):
                out[i] = res
        finally:  # every answer is read, even after an error, so none is left for the next call
            answers = {r: self._recv(r) for r in sent}
        for r in sent:
            if answers[r][0] == "error":
                raise _error(r, answers[r])
            for i, res in zip(shards[r], answers[r][1]):
                out[i] = res
        return out  # type: ignore[return-value]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("shutdown",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def _error(r: int, msg: tuple) -> Exception:
    kind = ValueError if msg[1] == "ValueError" else RuntimeError
    return kind(f"LLM replica {r}: {msg[2]}" if kind is RuntimeError else msg[2])

