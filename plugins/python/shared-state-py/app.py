"""A single-instance plugin (`wasmrpc.single_instance()`): module-level
state shared by every call on a worker, as in one Python process, and an
object a function hands to `rpc.remote()` (PyTorch's
`rpc.remote("ps", get_parameter_server)`). The tests of
`tests/all/python_plugins/single_instance.rs` call it."""

from wasmrpc import _guest, _host, remote, remote_class, rpc, single_instance, torch

single_instance()

calls = 0
counter = None
weights = None


@remote_class
class Counter:
    def __init__(self, start):
        self.n = start

    def add(self, k):
        self.n += k
        return self.n


@remote
def count_call():
    """How many calls of it this worker has served (a module global)."""
    global calls
    calls += 1
    return calls


@remote
def get_counter(start):
    """One `Counter` per worker, made by the first call: `remote()` of it
    gives RRefs to that very object."""
    global counter
    if counter is None:
        counter = Counter(start)
    return counter


@remote
def counter_total():
    return None if counter is None else counter.n


@remote
def keep_weights():
    """A tensor kept in a global, for later calls."""
    global weights
    weights = torch.ones(2, 2)
    return True


@remote
def weights_sum():
    return weights.sum().item()


@remote
def _call_method(method, rref, *args):
    return method(rref.local_value(), *args)


@remote
def counter_rref_made_in_place(start):
    """PyTorch's `rpc.RRef(ParameterServer())`: an RRef this worker owns
    holding a new `Counter` itself. Two RRefs of it share the object, and
    `local_value()` is the object."""
    c = Counter(start)
    first, second = rpc.RRef(c), rpc.RRef(c)
    assert first.local_value() is c and second.local_value() is c
    assert first.is_owner()
    second.local_value().add(1)
    return first


@remote
def objects_in_the_instance():
    """How many objects the instance keeps (dropped ones are gone)."""
    return len(_guest._objects)


@remote
def rref_of_a_class_it_does_not_export():
    """What a hostile plugin could send: the worker refuses it."""
    return _host.call("rref_of_object", 1, "NotAClass")


@remote
def rref_of_an_object_it_never_made():
    """An id the instance never gave: the RRef's methods find no object."""
    return rpc.RRef._own(_host.call("rref_of_object", 9999, "Counter"))


@remote
def offer_a_class_it_does_not_export():
    """What a hostile plugin could send: the worker refuses it."""
    return _host.call("keep_object", 1, "NotAClass")
