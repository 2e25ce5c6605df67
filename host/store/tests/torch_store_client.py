"""Drives torch.distributed.TCPStore (PyTorch's own client) against a store
server, over every operation, asserting PyTorch's
semantics. Prints OK and exits 0 on success; any failure raises.

Usage: torch_store_client.py HOST PORT USE_LIBUV(0|1)

USE_LIBUV is the client's own flag (queues are a libuv-client API).

The Rust side sets the key "from_rust" to b"rust" before starting this script
and checks afterwards that "from_torch" holds b"torch".
"""

import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist


USE_LIBUV = True


def client(host, port, timeout=10.0):
    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
        use_libuv=USE_LIBUV,
    )


def expect_timeout(fn, seconds):
    start = time.monotonic()
    try:
        fn()
    except RuntimeError as e:  # DistStoreError is a RuntimeError
        took = time.monotonic() - start
        assert 0.8 * seconds <= took < seconds + 2.0, f"timed out after {took}s: {e}"
        return str(e)
    raise AssertionError("expected a timeout")


def main():
    global USE_LIBUV
    host, port = sys.argv[1], int(sys.argv[2])
    USE_LIBUV = sys.argv[3] == "1"
    s = client(host, port)

    # A key our client set, seen through PyTorch's key prefix.
    assert s.get("from_rust") == b"rust", s.get("from_rust")

    s.set("k", "v1")
    assert s.get("k") == b"v1"
    s.set("k", b"v2")
    assert s.get("k") == b"v2"
    s.set("bin", bytes(range(256)))
    assert s.get("bin") == bytes(range(256))

    assert s.add("c", 5) == 5
    assert s.add("c", -2) == 3
    assert s.add("c", 0) == 3
    assert s.get("c") == b"3"

    assert s.compare_set("cs", "", "first") == b"first"
    assert s.get("cs") == b"first"
    assert s.compare_set("cs", "wrong", "x") == b"first"
    assert s.compare_set("cs", "first", "second") == b"second"
    assert s.get("cs") == b"second"
    assert s.compare_set("absent", "expected", "x") == b"expected"
    assert not s.check(["absent"])

    assert s.check(["k", "c"])
    assert not s.check(["k", "nope"])

    before = s.num_keys()
    s.set("fresh", "1")
    assert s.num_keys() == before + 1
    assert s.delete_key("fresh") is True
    assert s.delete_key("fresh") is False
    assert s.num_keys() == before

    s.append("log", "ab")
    s.append("log", b"cd")
    assert s.get("log") == b"abcd"

    s.multi_set(["m1", "m2"], ["one", b"two"])
    assert s.multi_get(["m2", "m1"]) == [b"two", b"one"]

    # wait: immediate, woken by another client, and timing out (then the
    # connection must still be in step).
    s.wait(["k", "c"])
    s.wait(["k"], timedelta(seconds=1))
    other = client(host, port)

    def later():
        time.sleep(0.3)
        other.set("late", "here")

    t = threading.Thread(target=later)
    t.start()
    start = time.monotonic()
    s.wait(["late"], timedelta(seconds=10))
    assert time.monotonic() - start < 5
    t.join()
    assert s.get("late") == b"here"

    expect_timeout(lambda: s.wait(["never"], timedelta(milliseconds=500)), 0.5)
    assert s.get("k") == b"v2"
    s.set_timeout(timedelta(seconds=1))
    text = expect_timeout(lambda: s.get("never"), 1.0)
    print("get timeout text:", text, flush=True)
    assert s.get("k") == b"v2"

    # multi_get waits for every key.
    t = threading.Thread(target=lambda: (time.sleep(0.3), other.set("late2", "x")))
    t.start()
    s.set_timeout(timedelta(seconds=10))
    assert s.multi_get(["late2", "k"]) == [b"x", b"v2"]
    t.join()

    # Queues (an API of PyTorch's libuv client only).
    if USE_LIBUV:
        s.queue_push("q", b"a")
        s.queue_push("q", b"b")
        assert s.queue_len("q") == 2
        assert s.queue_pop("q") == b"a"
        assert s.queue_pop("q", block=False) == b"b"
        assert s.queue_len("q") == 0
        # A blocking pop is woken by a push from another client.
        t = threading.Thread(target=lambda: (time.sleep(0.3), other.queue_push("q", b"c")))
        t.start()
        assert s.queue_pop("q") == b"c"
        t.join()

    # A worker that counts itself on init/ (PyTorch's wait_for_workers).
    dist.TCPStore(host, port, world_size=2, is_master=False,
                  timeout=timedelta(seconds=10), use_libuv=USE_LIBUV)

    s.set("from_torch", "torch")
    print("OK", flush=True)


if __name__ == "__main__":
    main()
