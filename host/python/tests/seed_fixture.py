"""PyTorch's own RPC test methods, run unmodified against `wasmrpc`.

The seed files (`../shared/seeds/*.py.txt`: PyTorch's `rpc_test.py` and
`dist_autograd_test.py`, annotated) do not parse as a whole, so each piece
is cut out by name as text: a test method with its decorators, the helper
methods of its class and of the seed's base classes, and the file's
module-level functions and classes. Each piece is compiled as PyTorch wrote
it, in a namespace where the names PyTorch's test imports resolve to
wasmrpc's (`rpc`, `dist_autograd`, `RRef`, `WorkerInfo`) and to this
fixture (`dist_init`, `worker_name`, `initialize_pg`), which provides what
`RpcAgentTestFixture` and `dist_utils` provide.

Nothing of a test's body is changed; a piece that does not compile (the
seed text is damaged in places) is left out, and a test that needs it then
fails with a `NameError` naming it.
"""

import concurrent.futures
import contextlib
import enum
import json
import os
import re
import sys
import textwrap
import threading
import time
from collections import namedtuple
from functools import partial, wraps
from threading import Event, Lock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Function
from torch.futures import Future
from torch.testing._internal.common_utils import TemporaryFileName, TestCase

import wasmrpc.distributed.autograd as dist_autograd
from wasmrpc import rpc
from wasmrpc.rpc import RRef, WorkerInfo

_DEF = re.compile(r"^(\s*)(?:async\s+)?(def|class)\s+(\w+)")


def _indent(line):
    return len(line) - len(line.lstrip(" "))


def _is_code(line):
    s = line.strip()
    return bool(s) and not s.startswith("#")


class Piece:
    """One `def` or `class` of a seed file, with its decorators."""

    def __init__(self, kind, name, indent, start, header, end, lines):
        self.kind, self.name, self.indent = kind, name, indent
        self.start, self.header, self.end = start, header, end
        self.source = textwrap.dedent("\n".join(lines[start:end])) + "\n"
        self.line = header + 1

    def __repr__(self):
        return f"{self.kind} {self.name} (line {self.line})"


def _pieces(lines):
    """Every `def`/`class` of the file, in order, each with the lines it
    spans (decorators included)."""
    out = []
    for i, line in enumerate(lines):
        m = _DEF.match(line)
        if not m:
            continue
        indent, kind, name = len(m.group(1)), m.group(2), m.group(3)
        # Decorators above, at the same indentation (a decorator may span
        # several lines, more indented).
        start, j = i, i - 1
        while j >= 0:
            above = lines[j]
            if not _is_code(above) or _indent(above) > indent:
                j -= 1
                continue
            if _indent(above) == indent and above.lstrip().startswith("@"):
                start = j
                j -= 1
                continue
            break
        # The header may span lines (its parentheses are open until `:`).
        k, depth = i, 0
        while k < len(lines):
            code = lines[k].split("#", 1)[0]
            depth += code.count("(") + code.count("[") - code.count(")") - code.count("]")
            if depth <= 0 and code.rstrip().endswith(":"):
                break
            k += 1
        end = k + 1
        while end < len(lines) and (not _is_code(lines[end]) or _indent(lines[end]) > indent):
            end += 1
        while end > k + 1 and not _is_code(lines[end - 1]):
            end -= 1
        out.append(Piece(kind, name, indent, start, i, end, lines))
    return out


class SeedFile:
    """A seed file cut into its pieces: top-level functions and classes,
    and each class's methods."""

    def __init__(self, path):
        self.path = path
        with open(path, encoding="utf-8") as f:
            self.lines = f.read().splitlines()
        pieces = _pieces(self.lines)
        self.top = [p for p in pieces if p.indent == 0]
        self.classes = {p.name: p for p in self.top if p.kind == "class"}
        self.methods = {}
        # A class's methods run to the next top-level class: where the seed
        # lost a method's indentation the class goes on after it.
        starts = sorted(p.header for p in self.classes.values()) + [len(self.lines)]
        for cls in self.classes.values():
            until = next(h for h in starts if h > cls.header)
            inner = [
                p
                for p in pieces
                if cls.header < p.header < until and p.kind == "def" and p.indent > 0
            ]
            if inner:
                level = min(p.indent for p in inner)
                self.methods[cls.name] = {p.name: p for p in inner if p.indent == level}
            else:
                self.methods[cls.name] = {}

    def bases(self, cls_name):
        """The seed file's own classes `cls_name` derives from, nearest
        first, itself included."""
        header = self.lines[self.classes[cls_name].header]
        m = re.search(r"\(([^)]*)\)", header)
        names = [b.strip() for b in m.group(1).split(",")] if m else []
        out = [cls_name]
        for b in names:
            if b in self.classes:
                out += [x for x in self.bases(b) if x not in out]
        return out


def worker_name(rank):
    """PyTorch's `dist_utils.worker_name`."""
    return f"worker{rank}"


def initialize_pg(init_method, rank, world_size):
    """PyTorch's `dist_utils.initialize_pg`: torch's own Gloo process group,
    which the seeds use for `dist.barrier()` between their ranks."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo", init_method=init_method, rank=rank, world_size=world_size
        )


def dist_init(
    old_test_method=None,
    setup_rpc=True,
    clean_shutdown=True,
    faulty_messages=None,
    messages_to_delay=None,
):
    """PyTorch's `dist_utils.dist_init`: `init_rpc` as `worker<rank>` before
    the test, `shutdown` after it."""
    if old_test_method is None:
        return partial(
            dist_init,
            setup_rpc=setup_rpc,
            clean_shutdown=clean_shutdown,
            faulty_messages=faulty_messages,
            messages_to_delay=messages_to_delay,
        )

    @wraps(old_test_method)
    def new_test_method(self, *arg, **kwargs):
        rpc.api._ignore_rref_leak = False
        self.worker_id = self.rank
        self.setup_fault_injection(faulty_messages, messages_to_delay)
        rpc_backend_options = self.rpc_backend_options
        if setup_rpc:
            rpc.init_rpc(
                name=f"worker{self.rank:d}",
                backend=self.rpc_backend,
                rank=self.rank,
                world_size=self.world_size,
                rpc_backend_options=rpc_backend_options,
            )
        return_value = old_test_method(self, *arg, **kwargs)
        if setup_rpc:
            rpc.shutdown(graceful=clean_shutdown)
        return return_value

    return new_test_method


class RPCExecMode(enum.Enum):
    """`torch.distributed.rpc.internal.RPCExecMode`."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


def tp_transports():
    """`common_distributed.tp_transports`: TensorPipe's transports, which
    wasmrpc's options take and ignore."""
    return ["shm", "uv"]


class RpcAgentTestFixture(TestCase):
    """What PyTorch's `RpcAgentTestFixture` (and its TensorPipe subclass)
    give a test: `rank`, `world_size`, the rendezvous files, the backend and
    its options."""

    def __init__(self, rank, world_size, file_name, pg_file_name):
        super().__init__("runTest")
        self.rank = rank
        self._world_size = world_size
        self.file_name = file_name
        self.pg_file_name = pg_file_name

    def runTest(self):  # noqa: N802 (unittest's name)
        """unittest needs a method to name; the seed method is called
        directly."""

    @property
    def world_size(self):
        return self._world_size

    @property
    def init_method(self):
        return "file://" + self.file_name

    @property
    def file_init_method(self):
        # torch's own Gloo group keeps its file apart from the RPC
        # rendezvous (wasmrpc's store has a file format of its own).
        return "file://" + self.pg_file_name

    @property
    def rpc_backend(self):
        return rpc.backend_registry.BackendType["TENSORPIPE"]

    @property
    def rpc_backend_options(self):
        return rpc.backend_registry.construct_rpc_backend_options(
            self.rpc_backend, init_method=self.init_method, _transports=tp_transports()
        )

    def setup_fault_injection(self, faulty_messages, messages_to_delay):
        """Fault injection is the faulty agent's; the seeds run here use none."""


def namespace():
    """The globals seed code runs in: what the seed files import, with
    `torch.distributed.rpc` and `torch.distributed.autograd` as wasmrpc's."""
    return {
        "__name__": "seed",
        "concurrent": concurrent,
        "contextlib": contextlib,
        "json": json,
        "os": os,
        "sys": sys,
        "threading": threading,
        "time": time,
        "namedtuple": namedtuple,
        "partial": partial,
        "Event": Event,
        "Lock": Lock,
        "Enum": enum.Enum,
        "torch": torch,
        "nn": nn,
        "dist": dist,
        "rpc": rpc,
        "dist_autograd": dist_autograd,
        "RRef": RRef,
        "WorkerInfo": WorkerInfo,
        "Future": Future,
        "Function": Function,
        "RPCExecMode": RPCExecMode,
        "TemporaryFileName": TemporaryFileName,
        "dist_init": dist_init,
        "worker_name": worker_name,
        "initialize_pg": initialize_pg,
        "tp_transports": tp_transports,
        "RpcAgentTestFixture": RpcAgentTestFixture,
        "load_tests": None,
    }


_LOADED = {}


def load(path):
    """The seed file at `path` with its module-level pieces executed: a
    `(SeedFile, namespace, skipped)` triple, where `skipped` lists the
    pieces that did not compile or run."""
    if path in _LOADED:
        return _LOADED[path]
    seed = SeedFile(path)
    ns = namespace()
    skipped = []
    for piece in seed.top:
        if piece.kind == "class" and any(
            m.startswith("test_") for m in seed.methods.get(piece.name, {})
        ):
            continue
        try:
            exec(compile(piece.source, f"{path}:{piece.line}", "exec"), ns)
        except Exception as e:  # noqa: BLE001 (recorded: a test needing it fails by name)
            skipped.append(f"{piece!r}: {type(e).__name__}: {e}")
    _LOADED[path] = (seed, ns, skipped)
    return _LOADED[path]


def test_case(path, suite, method, rank, world_size, file_name, pg_file_name):
    """An instance of `suite` from the seed file at `path`, holding
    `method` and the helper methods of the suite and its seed bases, ready
    to run as rank `rank`."""
    seed, ns, _ = load(path)
    if suite not in seed.classes:
        raise LookupError(f"{path} has no class {suite}")
    chosen = {}
    # Helpers of every class first (nearest wins below), then the suite's
    # bases and the suite itself.
    for methods in seed.methods.values():
        for name, piece in methods.items():
            if name.startswith("_") and not name.startswith("__"):
                chosen.setdefault(name, piece)
    for cls in reversed(seed.bases(suite)):
        for name, piece in seed.methods[cls].items():
            if not name.startswith("test_") or name == method:
                chosen[name] = piece
    attrs = {}
    for name, piece in chosen.items():
        local = {}
        try:
            exec(compile(piece.source, f"{path}:{piece.line}", "exec"), ns, local)
        except Exception as e:  # noqa: BLE001
            if name == method:
                raise RuntimeError(f"{piece!r} does not compile as the seed has it: {e}") from e
            continue
        attrs[name] = local[name]
    if method not in attrs:
        raise LookupError(f"{path}: {suite} has no method {method}")
    cls = type(suite, (RpcAgentTestFixture,), attrs)
    # Seed code names its own class (`DistAutogradTest._workload_thread`).
    ns[suite] = cls
    return cls(rank, world_size, file_name, pg_file_name)
