"""One rank of tests/test_tp_cpu.py::test_ranks_agree_on_the_smallest_value (a script, so the
child imports nothing from the test module): `python gloo_min_worker.py RANK PORT`."""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist

from minisgl.distributed.communicator import min_across_ranks

if __name__ == "__main__":
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
                            timeout=datetime.timedelta(seconds=60))
    got = min_across_ranks(1000 - 7 * rank, dist.group.WORLD)  # rank 1 has less free memory
    dist.destroy_process_group()
    print(f"rank {rank}: {got}", flush=True)
