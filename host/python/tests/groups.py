"""Runs a group of workers for a test: Python processes (each runs a
module-level function of the test with its rank) and, optionally,
`wasmrpc worker` processes, all joining through one file rendezvous.

A rank's exception fails the test with that rank's traceback; a group that
does not finish within its timeout is killed and fails the test, so no
test hangs the suite."""

import multiprocessing
import os
import subprocess
import tempfile
import traceback


def _entry(fn, rank, world_size, init_method, results):
    try:
        fn(rank, world_size, init_method)
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, traceback.format_exc()))


def wasmrpc_bin():
    """The `wasmrpc` binary of the build under test."""
    path = os.environ.get("WASMRPC_BIN")
    if not path:
        raise RuntimeError("WASMRPC_BIN is not set: run the suite through `cargo nextest run`")
    return path


def plugin(name):
    """The path of the built plugin `name` (`seed_fns`, `seed_fns_py`)."""
    return os.environ[f"WASMRPC_TEST_PLUGIN_{name.upper()}"]


def run_group(fn, world_size, *, native_ranks=(), native_args=(), native_env=None, timeout=90):
    """Runs `fn(rank, world_size, init_method)` in a Python process for each
    rank not in `native_ranks`; those ranks are `wasmrpc worker`s (named
    `worker<rank>`, with `native_args` added to their command line and
    `native_env` to their environment)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"
        procs = {}
        natives = {}
        for rank in range(world_size):
            if rank in native_ranks:
                log = open(os.path.join(tmp, f"worker{rank}.log"), "w")
                natives[rank] = (
                    subprocess.Popen(
                        [
                            wasmrpc_bin(),
                            "worker",
                            "--rank",
                            str(rank),
                            "--world-size",
                            str(world_size),
                            "--init-method",
                            init_method,
                            *native_args,
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, **(native_env or {})},
                    ),
                    log,
                )
            else:
                p = ctx.Process(target=_entry, args=(fn, rank, world_size, init_method, results))
                p.start()
                procs[rank] = p
        failures = []
        try:
            for _ in procs:
                try:
                    rank, error = results.get(timeout=timeout)
                except Exception:  # noqa: BLE001 (queue.Empty)
                    failures.append(f"the group did not finish within {timeout} s")
                    break
                if error:
                    failures.append(f"rank {rank}:\n{error}")
            for rank, (proc, log) in natives.items():
                try:
                    code = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    failures.append(f"wasmrpc worker rank {rank} did not stop")
                    continue
                if code != 0:
                    log.flush()
                    with open(log.name) as f:
                        failures.append(f"wasmrpc worker rank {rank} exited {code}:\n{f.read()}")
        finally:
            for p in procs.values():
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
            for proc, log in natives.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        if failures:
            raise AssertionError("\n".join(failures))
