"""A single-instance plugin (`wasmrpc.single_instance()`): module-level
state shared by every call on a worker, as in one Python process, and an
object a function hands to `rpc.remote()` (PyTorch's
`rpc.remote("ps", get_parameter_server)`). The tests of
`tests/all/python_plugins/single_instance.rs` call it."""

from wasmrpc import _guest, _host, futures, remote, remote_class, rpc, single_instance, torch

single_instance()

calls = 0
counter = None
weights = None
waiting = False


@remote_class
class Counter:
    def __init__(self, start):
        self.n = start

    def add(self, k):
        self.n += k
        return self.n


@remote_class
class Batcher:
    """PyTorch's batching parameter server (`BatchUpdateParameterServer`)
    in small: each update waits for the round's others, and the last of
    the round completes them all with the running total."""

    def __init__(self, trainers):
        self.trainers = trainers
        self.seen = 0
        self.total = 0
        self.future = rpc.Future()

    @staticmethod
    @rpc.functions.async_execution
    def update(ps_rref, k):
        self = ps_rref.local_value()
        self.total += k
        self.seen += 1
        fut = self.future
        if self.seen == self.trainers:
            self.seen = 0
            self.future = rpc.Future()
            fut.set_result(self.total)
        return fut

    def total_so_far(self):
        return self.total


@remote
def train(ps_rref, rounds):
    """A trainer: one update a round, each waiting for the round's end."""
    return [
        rpc.rpc_sync(ps_rref.owner(), Batcher.update, args=(ps_rref, 1)) for _ in range(rounds)
    ]


@remote
def run_ps(trainers, rounds):
    """PyTorch's `run_ps`: the server made in place, its RRef handed to the
    trainers, whose updates reach it while this call waits for them."""
    ps_rref = rpc.RRef(Batcher(len(trainers)))
    futs = [rpc.rpc_async(t, train, args=(ps_rref, rounds)) for t in trainers]
    results = futures.wait_all(futs)
    # A proxy call from here runs in place, beside the waiting call too.
    return results, ps_rref.rpc_sync().total_so_far()


@remote
def wait_for_release(key):
    """Waits until `release(key, value)` and gives the value: the
    instance's other calls run meanwhile (as visits)."""
    global waiting
    waiting = True
    try:
        return rpc.Future.shared(key).wait()
    finally:
        waiting = False


@remote
def release(key, value):
    rpc.Future.shared(key, take=True).set_result(value)
    return True


@remote
def is_waiting():
    """Whether a call of the instance waits (this call is then a visit)."""
    return waiting


@remote
def abandon_the_next_visit():
    """What a hostile guest could do: take the call the worker hands it
    while it waits, and end without running it."""
    global waiting
    waiting = True
    try:
        never = rpc.Future()
        wake = _host.call("future_wait_serving", never._handle())
    finally:
        waiting = False
    return type(wake).__name__


@remote
def visit_done_without_a_visit():
    """What a hostile guest could send: the outcome of no visit."""
    _, types = _host.bindings()
    return _host.call("visit_done", 0, types.VisitOutcome_Returned(_host.value(1)))


@remote
def plus_one(k):
    return k + 1


@remote
def remote_then_to_here(k):
    """`rpc.remote()` of this plugin's own function on this very worker,
    then `to_here()`: the creation needs the instance this call holds
    while it waits, and runs as a visit."""
    me = rpc.get_worker_info().name
    return rpc.remote(me, plus_one, args=(k,)).to_here()


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
