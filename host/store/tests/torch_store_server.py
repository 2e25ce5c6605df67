"""Hosts a torch.distributed.TCPStore server (PyTorch's own) on port 0.

Usage: torch_store_server.py USE_LIBUV(0|1)

Sets "from_torch_server" to b"hello", prints the port on the first line of
stdout, then serves until stdin closes. A line "check" on stdin makes it
verify, through its own client, that "from_rust" holds b"rust", then print
"CHECK OK".
"""

import sys
from datetime import timedelta

import torch.distributed as dist


def main():
    use_libuv = sys.argv[1] == "1"
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
        use_libuv=use_libuv,
    )
    store.set("from_torch_server", "hello")
    print(store.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            assert store.get("from_rust") == b"rust", store.get("from_rust")
            print("CHECK OK", flush=True)


if __name__ == "__main__":
    main()
