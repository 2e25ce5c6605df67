"""One rank of a two-rank rendezvous through torch.distributed.rendezvous;
the other rank is ours.

Usage: torch_rendezvous_peer.py URL RANK

Sets "rank{RANK}" to the rank's decimal text, reads both ranks' keys, counts
itself on "done" and waits until both ranks have; then rank 1 sets "bye" as
its last operation and rank 0 (which hosts the store) waits for "bye", so it
outlives the other. Prints OK.
"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main():
    url, rank = sys.argv[1], int(sys.argv[2])
    store, got_rank, world_size = next(
        dist.rendezvous(url, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    )
    assert (got_rank, world_size) == (rank, 2)
    store.set(f"rank{rank}", str(rank))
    for other in range(2):
        assert store.get(f"rank{other}") == str(other).encode()
    store.add("done", 1)
    deadline = time.monotonic() + 30
    while store.add("done", 0) < 2:
        assert time.monotonic() < deadline, "the other rank never finished"
        time.sleep(0.01)
    if rank == 0:
        store.wait(["bye"])
    else:
        store.set("bye", "1")
    print("OK", flush=True)


if __name__ == "__main__":
    main()
