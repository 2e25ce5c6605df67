"""Shares a file with our FileStore through torch.distributed.FileStore.

Usage: torch_file_store.py PATH

Expects "from_rust" == b"rust" and the counter "n" == 2 (written by our
store), then sets "from_torch" to b"torch", adds 5 to "n", deletes
"to_delete", and prints OK.
"""

import sys
from datetime import timedelta

import torch.distributed as dist


def main():
    store = dist.FileStore(sys.argv[1], -1)
    store.set_timeout(timedelta(seconds=10))
    assert store.get("from_rust") == b"rust", store.get("from_rust")
    assert store.add("n", 0) == 2
    assert store.check(["to_delete"])
    store.set("from_torch", "torch")
    assert store.add("n", 5) == 7
    assert store.delete_key("to_delete")
    print("OK", flush=True)


if __name__ == "__main__":
    main()
