"""The least a Python plugin's call can cost: componentize-py's dispatch
with none of the kit's code on the call's path. Served as
`dispatch_floor_py::identity`; the bench times it beside the Python seed
plugin's `identity` and the Rust plugin's, as the floor of the Python
no-op's row (`rtt_noop_py`, `docs/src/benchmarks/running.md`).

`identity` is registered as any function is, so the manifest and the
worker see an ordinary export; but every call of this plugin's `call`
export returns its first argument's nodes as they arrived, without
decoding them into Python values, running a function, or encoding a
result. What remains is what any Python function pays: the runtime
attaching the interpreter, lifting the call's name and arguments into
Python objects, one method call, and lowering the outcome."""

from wasmrpc import _guest, remote


@remote
def identity(a):
    return a


def _bare_call(self, name, args):
    return _guest.guest.Outcome_Returned(args.args[0])


_guest.Guest.call = _bare_call
