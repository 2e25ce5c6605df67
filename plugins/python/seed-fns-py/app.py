"""The seeds' Python helper functions (`rpc_test.py`, `dist_autograd_test.py`)
as a wasmrpc Python plugin, kept as close to the seed text as the kit
allows: `torch` is the kit's (ops run in the worker), `rpc` is
`wasmrpc.rpc`, and `time.sleep` is the worker's `sleep` (a plugin holds
no thread while it waits). Served as `seed_fns_py::NAME`.

The Rust versions of the same functions are `plugins/seed-fns`; the tests
in `tests/all/python_plugins` run the seed tests against these."""

import os
import time

from wasmrpc import Tensor, remote, remote_class, rpc, sleep, torch
from wasmrpc import log as print  # noqa: A001 (the seed's print, into the worker's log)

expected_err = "Expected error"
expected_err_escape = "\nFirst line of error \n next line of error \n last line of error"


def worker_name(rank):
    return f"worker{rank}"


@remote
def my_function(a, b, c):
    return a + b + c


@remote
def my_tensor_function(a, b):
    return a + b


@remote
def my_py_add(t1, t2):
    return torch.add(t1, t2)


@remote
def my_container_sum(a):
    result = a[0]
    for tensor in a[1:]:
        result += tensor
    return result


@remote
def my_sleep_func(seconds=1):
    sleep(seconds)
    return torch.mul(torch.tensor(1), torch.tensor(1))


@remote
def my_complex_tensor_function(list_input, tensor_class_input, dict_input):
    res = list_input[0]
    for t in list_input:
        res += t
    for v in dict_input.values():
        res += v
    complex_tensors = tensor_class_input.tensors
    return (res, complex_tensors[0], complex_tensors[1], complex_tensors[2])


@remote
def my_rref_function(rref_a, rref_b):
    return rref_a.to_here() + rref_b.to_here()


@remote
def delayed_add(a, b, seconds=0.05):
    sleep(seconds)
    return a + b


@remote
def identity(a):
    return a


@remote
def no_result():
    print("do nothing")


@remote
def raise_or_inc(value):
    if value.numel() == 2:
        raise ValueError("Expected error")
    return value + 1


@remote
def nested_rpc(dst):
    return rpc.rpc_sync(dst, torch.add, args=(torch.ones(2, 2), 1))


@remote
def multi_layer_nested_async_rpc(dst, world_size, ttl):
    if ttl > 0:
        current_dst = worker_name(dst)
        next_dst = (dst + 1) % world_size
        rpc.rpc_async(
            current_dst,
            multi_layer_nested_async_rpc,
            args=(next_dst, world_size, ttl - 1),
        )
        return 0


@remote
def nested_rref(dst):
    return (
        rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 1)),
        rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 2)),
    )


@remote
def nested_remote(dst):
    rref = rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 3))
    return rref.to_here()


@remote
def rpc_return_rref(dst):
    return rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 1))


@remote
def add_rref_to_value(rref, value):
    return rref.to_here() + value


@remote
def light_rpc():
    return 0


@remote
def heavy_rpc(tensor):
    for i in range(1, 100):
        tensor *= i
        tensor /= i + 1
    return 0


class CustomException(Exception):
    def __init__(self, bool, msg):  # noqa: A002 (the seed's name)
        self.bool = bool
        super().__init__(msg)


@remote
def raise_func():
    raise ValueError(expected_err)


@remote
def callback_none(dst):
    """The seed's `rpc.rpc_async(dst, raise_func).then(None)`
    (`test_callback_none`): `then` refuses `None` with a `TypeError`."""
    return rpc.rpc_async(dst, raise_func).then(None)


@remote
def _add_one(x):
    """The seed's `lambda x: x + 1`, given the future as torch gives it."""
    return x + 1


@remote
def callback_wrong_arg_type(dst):
    """`test_callback_wrong_arg_type`: the callback adds 1 to what `then`
    hands it, the future itself, so its own `+` raises the `TypeError`
    that fails the chained future as a `RuntimeError`."""
    fut0 = rpc.rpc_async(dst, torch.add, args=(torch.ones(2, 2), 1))
    fut1 = fut0.then(_add_one)
    return fut1.wait()


@remote
def custom_raise_func():
    raise CustomException(True, "foo")


@remote
def raise_func_escape():
    raise ValueError(expected_err_escape)


@remote
def foo_add():
    return torch.add(torch.ones(1), torch.ones(1))


@remote
def return_callee_id():
    return rpc.get_worker_info().id


@remote
def nested_udf(dst, n):
    """Not a seed function: a nested call of a plugin function (this one's
    `my_function`) rather than an op, so the host re-enters the runtime."""
    return rpc.rpc_sync(dst, my_function, args=(n, 1, 2))


@remote
def return_future():
    """The seed's `return_future()`: a function that is not
    `async_execution` returns a `Future`, which cannot be its result."""
    from wasmrpc import Future

    return Future()


@remote
def fail_on_fut(fut):
    pass


@remote
def pickle_future(dst):
    """`test_pickle_future`'s body: a `Future` as the argument of `rpc_sync`,
    `rpc_async` and `remote`; the error each call raises, as
    `(class name, message)`, or `("no error", "")`."""
    from wasmrpc import Future

    raised = []
    for call in (rpc.rpc_sync, rpc.rpc_async, rpc.remote):
        try:
            call(dst, fail_on_fut, args=(Future(),))
            raised.append(("no error", ""))
        except Exception as e:  # noqa: BLE001 (the test inspects any error)
            raised.append((type(e).__name__, str(e)))
    return raised


@remote
def no_op():
    """The bench's round trip of a Python function that does nothing."""
    return None


@remote
def spin_forever():
    """Busy Python code that never returns: the worker's time limit stops it."""
    n = 0
    while True:
        n += 1


@remote
def allocate(megabytes):
    """Grows the instance by `megabytes`: the worker's memory limit stops it."""
    blocks = [bytearray(1 << 20) for _ in range(megabytes)]
    return len(blocks)


@remote
def profiled_add(a, b):
    """Not a seed function: `a + b` inside a `record_function` range, with a
    progress report (the kit's profiler and progress APIs)."""
    from wasmrpc import profiler, progress

    progress.report("add", 1, 1, "adding")
    with profiler.record_function("##py_add##"):
        return a + b


@remote
def shared_future_set(key, value):
    """Completes the worker-wide future `key` with `value`."""
    from wasmrpc import Future

    Future.shared(key).set_result(value)


@remote
def shared_future_wait(key):
    """Waits for the worker-wide future `key`."""
    from wasmrpc import Future

    return Future.shared(key).wait()


@remote
def sandbox_probe():
    """Not a seed function: what the sandbox lets Python see (for the
    runtime's tests): files, the environment, the time of day."""
    out = {}
    for path in ("/etc/passwd", "/proc/self/environ", "app.py"):
        try:
            with open(path) as f:
                out[path] = f"read {len(f.read())} chars"
        except OSError as e:
            out[path] = type(e).__name__
    try:
        out["listdir"] = len(os.listdir("/"))
    except OSError as e:
        out["listdir"] = type(e).__name__
    out["environ"] = len(os.environ)
    out["time"] = time.time()
    start = time.monotonic()
    sleep(0.02)
    out["monotonic_advances"] = time.monotonic() > start
    return out


# ---- dist_autograd_test.py ------------------------------------------------


@remote
def my_rref_add(rref_t1, t2):
    ret = torch.add(rref_t1.local_value(), t2)
    return ret


@remote
def my_nested_rref_add(dst, rref_t1, t2):
    return rpc.rpc_sync(dst, my_rref_add, args=(rref_t1, t2))


@remote
def ret_requires_grad():
    return requires_grad_tensor()


def requires_grad_tensor():
    """The seed's module-level `requires_grad_tensor = torch.ones(3, 3,
    requires_grad=True)`: one per worker, kept by the worker as a global
    (instances of the plugin do not share Python globals)."""
    from wasmrpc import get_global, lock, set_global

    with lock("requires_grad_tensor"):
        t = get_global("requires_grad_tensor")
        if t is None:
            t = torch.ones(3, 3).requires_grad_(True)
            set_global("requires_grad_tensor", t)
        return t


@remote
def my_py_nested_call(t1, t2, dst, world_size, hops):
    next_dst = (dst + 1) % world_size
    if hops > 0:
        return rpc.rpc_sync(
            worker_name(next_dst),
            my_py_nested_call,
            args=(t1, t2, next_dst, world_size, hops - 1),
        )
    else:
        return rpc.rpc_sync(worker_name(next_dst), my_py_add, args=(t1, t2))


@remote
def _set_rpc_done(ctx_id, rank_distance):
    from wasmrpc import set_global

    set_global(f"rpc_done:{rank_distance}", True)
    set_global(f"ctx_id:{rank_distance}", ctx_id)


# ---- classes ----------------------------------------------------------------


@remote_class
class MyClass:
    def __init__(self, a, delay=False):
        self.a = a
        if delay:
            sleep(2)

    def my_instance_method(self, b):
        return self.a + b

    @classmethod
    def my_class_method(cls, d, e):
        return d + e

    @staticmethod
    def my_static_method(f):
        return f > 10

    def increment_value(self, increment):
        self.a += increment

    def get_value(self):
        return self.a

    def my_slow_method(self, my_tensor_arg):
        sleep(5)
        return torch.add(self.a, my_tensor_arg)


@remote
def a_linear_layer():
    """A module by value, as PyTorch returns one (by pickle)."""
    return torch.nn.Linear(3, 2)


@remote
def a_linear_layer_state():
    """A module's state: a dict of tensors."""
    return torch.nn.Linear(3, 2).state_dict()


@remote
def rref_of_an_object_made_here(a):
    """`RRef(obj)` of an object made in a pooled instance, which ends with
    the call: the worker refuses it."""
    return rpc.RRef(MyClass(a))


@remote_class
class TensorWrapper:
    def __init__(self, t):
        self.tensor = t

    def increase(self, v):
        self.tensor += v

    def sum(self):
        return self.tensor.sum()


# ---- functions as RPC arguments (issue 45) ----------------------------------
#
# A registered function (a `@remote` function, a method of a `@remote_class`
# taken from its class, a `wasmrpc.torch` op) travels as a reference to its
# registered name, the record `wasmrpc.FunctionRef { name }`, never as code.


@remote
def call_function(fn, *args):
    """Calls the function reference `fn` here: this plugin's own function
    or method (`seed_fns_py::my_function`, `seed_fns_py::MyClass.my_static_method`),
    an op (`aten::add`), or another plugin's function (through `rpc_sync`
    on this worker)."""
    return fn(*args)


@remote
def my_function_ref():
    """Returns `my_function` itself: the caller receives the reference
    record (`seed_fns_py::my_function`)."""
    return my_function


@remote_class
class Accumulator:
    """A small class for the tutorial-style `_remote_method`."""

    def __init__(self, start):
        self.total = start

    def add(self, x):
        self.total = self.total + x
        return self.total

    def get(self):
        return self.total

    @staticmethod
    def scale(x, k):
        return x * k


# The RPC tutorials' helpers (parameter server, RL), as written there:
# `_remote_method(Net.forward, rref, x)` runs `Net.forward(rref.local_value(), x)`
# on the RRef's owner, as in PyTorch: with an RRef to a value (a tensor), and
# with an RRef to an object of this plugin, beside which the owner runs
# `_call_method` (so `local_value()` is the object itself).
# `_remote_method_proxy` calls the method through the RRef's proxy instead.
@remote
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


@remote
def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(args), kwargs=kwargs)


@remote
def _local_value_then_again(rref):
    """Reaches the object, then asks its owner (this worker) to run this
    again beside it: the second call waits for the first, which waits for
    the second; the worker ends the wait after its RPC timeout."""
    rref.local_value()
    return rpc.rpc_sync(rref.owner(), _local_value_then_again, args=(rref,), timeout=60)


@remote
def _remote_method_proxy(method, rref, *args, **kwargs):
    """`_remote_method` for an RRef to a plugin object: the method, named by
    its reference, runs on the owner through the RRef's proxy."""
    return getattr(rref.rpc_sync(), method.__name__)(*args, **kwargs)


__all__ = ["Tensor"]


@remote
def _nested_python_udf(t1, t2, dst):
    t3 = t1 * t2
    t4 = t1 + t2
    res = rpc.rpc_sync(worker_name(dst), my_py_add, args=(t3, t4))
    return t1 * t2 * t3 * t4 * res
