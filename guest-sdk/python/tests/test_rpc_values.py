"""Functions as RPC values (function references), `rpc.functions.async_execution`
and `RRef.local_value` errors, through the fake host in `fakehost.py`.

A function reference is the record `wasmrpc.FunctionRef { name: str }`
naming a registered function; these tests check the nodes the kit sends,
what it makes of the nodes it receives, and a round trip through the fake
host's `rpc_sync` (which answers by calling this kit's own registered
function, decoding and encoding with the kit's `_values`). Not the wasm
path: no component, no second worker.

Run:

    cd guest-sdk/python && /root/.cache/wasmrpc/torch-2.13.0/bin/python -m unittest discover -s tests -v
"""

import functools
import importlib
import os
import sys
import unittest

import fakehost

HOST = fakehost.install()
T = fakehost.T

import torch as real  # noqa: E402

import wasmrpc  # noqa: E402
from wasmrpc import _registry, _scope, _values, remote, remote_class, rpc, torch  # noqa: E402
from wasmrpc.rpc import FunctionRef, functions  # noqa: E402

NAMESPACE = "test_refs"


def configure():
    # Every test names the plugin afresh: the seed plugin's test renames it.
    _registry.configure("test-refs")


configure()


@remote
def t_double(x):
    return x * 2


@remote
def t_call_function(fn, *args):
    return fn(*args)


@remote
def t_call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


@remote
def t_echo(x):
    return x


@remote_class
class TCounter:
    def __init__(self, n):
        self.n = n

    def add(self, k):
        return self.n + k

    @staticmethod
    def triple(x):
        return x * 3

    @classmethod
    def named(cls):
        return cls.__name__


def unregistered(x):
    return x


class Plain:
    def method(self):
        return 1


def encode(obj):
    return _values.to_nodes(obj, T)


def decode(nodes):
    return _values.from_nodes(nodes, T)


def ref_nodes(name):
    """The nodes of a function reference to `name`, as a Rust sender builds them."""
    return [T.Node_Record(T.RecordNode("wasmrpc.FunctionRef", [("name", 1)])), T.Node_Str(name)]


class Encoding(unittest.TestCase):
    def setUp(self):
        configure()

    def assertRef(self, fn, name):
        self.assertEqual(encode(fn), ref_nodes(name))

    def test_remote_function(self):
        self.assertRef(t_double, f"{NAMESPACE}::t_double")

    def test_class_methods(self):
        self.assertRef(TCounter.add, f"{NAMESPACE}::TCounter.add")
        self.assertRef(TCounter.triple, f"{NAMESPACE}::TCounter.triple")
        self.assertRef(TCounter.named, f"{NAMESPACE}::TCounter.named")
        # A class method bound to its class is still the registered name.
        self.assertRef(TCounter(1).named, f"{NAMESPACE}::TCounter.named")

    def test_torch_ops(self):
        self.assertRef(torch.add, "aten::add")
        self.assertRef(torch.zeros, "aten::zeros")
        self.assertRef(torch.relu, "aten::relu")

    def test_function_ref_objects(self):
        self.assertRef(FunctionRef("other_plugin::f"), "other_plugin::f")
        # A bare name is this plugin's, qualified as the host would.
        self.assertRef(FunctionRef("t_double"), f"{NAMESPACE}::t_double")

    def test_nested(self):
        nodes = encode([1, {"f": t_double}])
        names = [n.value for n in nodes if isinstance(n, T.Node_Str)]
        self.assertIn(f"{NAMESPACE}::t_double", names)
        self.assertEqual(decode(nodes), [1, {"f": t_double}])

    def test_namespace_follows_the_host_rule(self):
        _registry.configure("wasmrpc-plugin-my-fns")
        self.assertRef(t_double, "my_fns::t_double")

    def test_unnamed_plugin(self):
        _registry.plugin["name"] = None
        with self.assertRaisesRegex(RuntimeError, "the plugin has no name"):
            encode(t_double)


class Refusals(unittest.TestCase):
    def setUp(self):
        configure()

    def refused(self, obj, *texts):
        with self.assertRaises(TypeError) as cm:
            encode(obj)
        msg = str(cm.exception)
        for t in texts:
            self.assertIn(t, msg)
        return msg

    ONLY = ("only functions registered with @remote or @remote_class", "or wasmrpc.torch ops",
            "by their registered name", "never pickled")

    def test_lambda(self):
        msg = self.refused(lambda x: x, "cannot send the function", "<lambda>", *self.ONLY)
        self.assertIn("test_lambda", msg)  # its qualified name says where it is

    def test_unregistered_function(self):
        self.refused(unregistered, "cannot send the function test_rpc_values.unregistered over RPC",
                     *self.ONLY)

    def test_unregistered_class_method(self):
        self.refused(Plain.method, "Plain.method", *self.ONLY)

    def test_bound_methods(self):
        self.refused(Plain().method, "cannot send the bound method", "bound to a Plain object",
                     "Plain.method", "as an RRef", *self.ONLY)
        # Registered or not, a bound method carries its object.
        self.refused(TCounter(1).add, "bound method", "bound to a TCounter object", "TCounter.add")

    def test_partial_and_builtins(self):
        self.refused(functools.partial(t_double, 1), "cannot send the function", *self.ONLY)
        self.refused(len, "cannot send the function builtins.len", *self.ONLY)

    def test_class(self):
        self.refused(TCounter, "cannot send the class TCounter over RPC", "rpc.remote(dst")

    def test_other_types_keep_their_message(self):
        self.refused(object(), "cannot send a value of type object over RPC")
        with self.assertRaisesRegex(RuntimeError, "Can not pickle torch.futures.Future"):
            encode(wasmrpc.Future())

    def test_rpc_sync_refuses_before_sending(self):
        before = len(HOST.rpcs)
        with self.assertRaisesRegex(TypeError, "cannot send the function"):
            rpc.rpc_sync("worker1", t_call_function, args=(lambda: 1,))
        self.assertEqual(len(HOST.rpcs), before)


class Decoding(unittest.TestCase):
    def setUp(self):
        configure()

    def test_own_function_is_itself(self):
        self.assertIs(decode(ref_nodes(f"{NAMESPACE}::t_double")), t_double)
        self.assertIs(decode(ref_nodes("t_double")), t_double)

    def test_own_methods(self):
        add = decode(ref_nodes(f"{NAMESPACE}::TCounter.add"))
        self.assertIs(add, TCounter.add)
        self.assertEqual(add(TCounter(5), 2), 7)  # method(obj, *args)
        self.assertEqual(decode(ref_nodes(f"{NAMESPACE}::TCounter.triple"))(4), 12)
        self.assertEqual(decode(ref_nodes(f"{NAMESPACE}::TCounter.named"))(), "TCounter")

    def test_ops(self):
        add = decode(ref_nodes("aten::add"))
        self.assertIs(add, torch.add)
        out = add(HOST.to_kit(real.ones(2)), 1)
        self.assertTrue(real.equal(HOST.to_torch(out), real.full((2,), 2.0)))
        zeros = decode(ref_nodes("aten::zeros"))
        self.assertEqual(HOST.to_torch(zeros(2, 3)).shape, (2, 3))
        # An overload has no kit function: the op by that name.
        mul = decode(ref_nodes("aten::mul.Tensor"))
        self.assertEqual(mul.__wasmrpc_name__, "aten::mul.Tensor")

    def test_other_names_call_by_rpc_on_this_worker(self):
        f = decode(ref_nodes("other_plugin::Thing.method"))
        self.assertIsInstance(f, FunctionRef)
        self.assertEqual((f.name, f.__name__, f.__qualname__), ("other_plugin::Thing.method", "method",
                                                                 "Thing.method"))
        self.assertEqual(f, FunctionRef("other_plugin::Thing.method"))
        self.assertEqual(encode(f), ref_nodes("other_plugin::Thing.method"))  # passed on as it came
        with self.assertRaisesRegex(RuntimeError, "no function `other_plugin::Thing.method` on worker worker0"):
            f(1)
        self.assertEqual(HOST.rpcs[-1], ("worker0", "other_plugin::Thing.method"))

    def test_function_ref_call(self):
        self.assertEqual(FunctionRef(f"{NAMESPACE}::t_double")(21), 42)
        self.assertEqual(HOST.rpcs[-1], ("worker0", f"{NAMESPACE}::t_double"))
        # `rpc_sync(dst, ref)` names the function by the reference.
        self.assertEqual(rpc.rpc_sync("worker0", FunctionRef(f"{NAMESPACE}::t_double"), args=(2,)), 4)

    def test_an_unknown_own_name_fails_when_called(self):
        f = decode(ref_nodes(f"{NAMESPACE}::missing"))
        self.assertIsInstance(f, FunctionRef)
        with self.assertRaisesRegex(RuntimeError, "no function"):
            f()

    def test_malformed_records(self):
        cases = [
            [T.Node_Record(T.RecordNode("wasmrpc.FunctionRef", []))],
            [T.Node_Record(T.RecordNode("wasmrpc.FunctionRef", [("name", 1), ("x", 1)])), T.Node_Str("a::b")],
            [T.Node_Record(T.RecordNode("wasmrpc.FunctionRef", [("name", 1)])), T.Node_Int(3)],
            [T.Node_Record(T.RecordNode("wasmrpc.FunctionRef", [("name", 1)])), T.Node_Str("")],
        ]
        for nodes in cases:
            with self.subTest(nodes=nodes), self.assertRaisesRegex(ValueError, "wasmrpc.FunctionRef"):
                decode(nodes)

    def test_other_records_stay_records(self):
        r = decode([T.Node_Record(T.RecordNode("FunctionRef", [("name", 1)])), T.Node_Str("a::b")])
        self.assertIsInstance(r, wasmrpc.Record)
        self.assertEqual(r.name, "a::b")


class RoundTrip(unittest.TestCase):
    """`rpc_sync` to this plugin's own function: the reference is encoded by
    the caller's kit and decoded by the callee's (the same kit here)."""

    def setUp(self):
        configure()

    def test_call_function(self):
        self.assertEqual(rpc.rpc_sync("worker0", t_call_function, args=(t_double, 5)), 10)
        self.assertEqual(rpc.rpc_sync("worker0", t_call_function, args=(TCounter.triple, 2)), 6)
        out = rpc.rpc_sync("worker0", t_call_function, args=(torch.add, HOST.to_kit(real.ones(2)), 3))
        self.assertTrue(real.equal(HOST.to_torch(out), real.full((2,), 4.0)))

    def test_returned_reference(self):
        self.assertIs(rpc.rpc_sync("worker0", t_echo, args=(t_double,)), t_double)

    def test_tutorial_remote_method_on_a_value(self):
        rref = HOST.make_rref(value=real.ones(2))
        out = rpc.rpc_sync(rref.owner(), t_call_method, args=[torch.add, rref, HOST.to_kit(real.ones(2))])
        self.assertTrue(real.equal(HOST.to_torch(out), real.full((2,), 2.0)))


class AsyncExecution(unittest.TestCase):
    def test_paths(self):
        self.assertIs(functions.async_execution, wasmrpc.async_execution)
        self.assertIs(rpc.functions.async_execution, wasmrpc.async_execution)
        import wasmrpc.rpc.functions as mod

        self.assertIs(mod, functions)
        from wasmrpc.rpc.functions import async_execution

        self.assertIs(async_execution, wasmrpc.async_execution)

    def test_functions_either_order(self):
        @remote
        @functions.async_execution
        def t_async_below(x):
            return x

        @functions.async_execution
        @remote
        def t_async_above(x):
            return x

        @remote
        def t_plain(x):
            return x

        self.assertTrue(_registry.functions["t_async_below"][1])
        self.assertTrue(_registry.functions["t_async_above"][1])
        self.assertFalse(_registry.functions["t_plain"][1])
        kinds = {n: k for n, k, _, _ in _registry.exports()}
        self.assertEqual(kinds["t_async_above"], "async-function")

    def test_static_and_class_methods_under_async_execution(self):
        @remote_class
        class TAsync:
            @staticmethod
            @rpc.functions.async_execution
            def s(to, x):
                return x

            @classmethod
            @functions.async_execution
            def c(cls, x):
                return x

            @functions.async_execution
            def m(self, x):
                return x

            @staticmethod
            def plain(x):
                return x

        self.assertEqual(_registry.functions["TAsync.s"][1:], (True, ["to", "x"]))
        self.assertEqual(_registry.functions["TAsync.c"][1:], (True, ["x"]))
        self.assertFalse(_registry.functions["TAsync.plain"][1])
        methods = _registry.classes["TAsync"][2]
        self.assertEqual({m: a for m, (a, _) in methods.items()}, {"s": True, "c": True, "m": True,
                                                                   "plain": False})
        kinds = {(c, n): k for n, k, c, _ in _registry.exports()}
        self.assertEqual(kinds[(None, "TAsync.s")], "async-function")
        self.assertEqual(kinds[("TAsync", "s")], "async-method")

    def test_wrong_order_is_refused_at_definition(self):
        for kind in (staticmethod, classmethod):
            with self.subTest(kind=kind.__name__), self.assertRaises(TypeError) as cm:
                class TWrong:  # noqa: F841 (the class body raises)
                    @functions.async_execution
                    @kind
                    def f(x):
                        return x
            msg = str(cm.exception)
            self.assertIn(f"put @{kind.__name__} above @rpc.functions.async_execution", msg)
            self.assertIn("TWrong.f", msg)
        self.assertNotIn("TWrong", _registry.classes)


class Then(unittest.TestCase):
    """`Future.then` as torch's: the callback is given the future."""

    def setUp(self):
        configure()

    def test_the_callback_is_given_the_completed_future(self):
        @remote
        def t_then_plus(fut, k):
            self.assertIsInstance(fut, rpc.Future)
            self.assertTrue(fut.done())
            return fut.wait() + k

        parent = rpc.Future()
        parent.set_result(2)
        self.assertEqual(parent.then(t_then_plus, 3).wait(), 5)
        self.assertEqual(parent.then("t_then_plus", 4).value(), 6)

    def test_a_callback_that_adds_to_the_future_fails_as_torchs(self):
        @remote
        def t_then_add_one(x):
            return x + 1

        parent = rpc.Future()
        parent.set_result(1)
        with self.assertRaisesRegex(RuntimeError, r"unsupported operand type\(s\) for \+: 'Future' and 'int'"):
            parent.then(t_then_add_one).wait()

    def test_a_failed_future_fails_the_chained_one_with_its_error(self):
        @remote
        def t_then_never(fut):
            raise AssertionError("the callback of a failed future ran")

        parent = rpc.Future()
        parent.set_exception(ValueError("parent failed"))
        with self.assertRaisesRegex(ValueError, "parent failed"):
            parent.then(t_then_never).wait()

    def test_refusals(self):
        parent = rpc.Future()
        parent.set_result(1)
        with self.assertRaisesRegex(TypeError, "incompatible function arguments"):
            parent.then(None)
        with self.assertRaisesRegex(AttributeError, "not a @remote function of this plugin"):
            parent.then("no_such_callback")
        with self.assertRaisesRegex(TypeError, "is not a registered function"):
            parent.then(lambda fut: fut)
        with self.assertRaisesRegex(ValueError, "names starting with `_wasmrpc` are the kit's own"):
            remote(name="_wasmrpc_then")(lambda v, c: v)
        # The trampoline itself, called as a remote caller could: it runs
        # only this plugin's own functions.
        with self.assertRaisesRegex(AttributeError, "no @remote function 'os.system'"):
            _registry.functions["_wasmrpc_then"][0](1, "os.system")


class ExportModule(unittest.TestCase):
    """`wasmrpc.export_module`: what a module defines is registered as the
    decorators would; what it imports is not; a taken name is refused."""

    def setUp(self):
        self.saved = (dict(_registry.functions), dict(_registry.classes))

    def tearDown(self):
        for table, saved in zip((_registry.functions, _registry.classes), self.saved):
            table.clear()
            table.update(saved)

    def module(self, name, source):
        import types

        m = types.ModuleType(name)
        sys.modules[name] = m
        self.addCleanup(sys.modules.pop, name, None)
        exec(source, m.__dict__)  # noqa: S102 (the test's own source)
        return m

    def test_defined_names_only(self):
        m = self.module("exported_mod", (
            "from functools import reduce\n"
            "import json\n"
            "def f(x):\n    return x\n"
            "def _helper(rref):\n    return rref.local_value()\n"
            "alias = f\n"
            "class Net:\n    def forward(self, x):\n        return x\n"
            "LIMIT = 3\n"
        ))
        self.assertEqual(wasmrpc.export_module(m), 3)
        self.assertIs(_registry.functions["f"][0], m.f)
        self.assertIs(_registry.functions["_helper"][0], m._helper)
        self.assertIn("Net", _registry.classes)
        self.assertEqual(m.Net.forward.__wasmrpc_ref__, "Net.forward")
        for imported in ("reduce", "json", "alias", "LIMIT"):
            self.assertNotIn(imported, _registry.functions)
        # Again, or by name: what is registered already stays as it is.
        self.assertEqual(wasmrpc.export_module("exported_mod"), 0)

    def test_a_taken_name_is_refused(self):
        self.module("first_mod", "def shared(x):\n    return x\n")
        wasmrpc.export_module("first_mod")
        second = self.module("second_mod", "def shared(x):\n    return -x\n")
        with self.assertRaisesRegex(ValueError, r"export_module\(second_mod\): `shared` is already "
                                    r"registered by first_mod\.shared"):
            wasmrpc.export_module(second)


class LocalValue(unittest.TestCase):
    def test_value_on_owner(self):
        rref = HOST.make_rref(value=3)
        self.assertEqual(rref.local_value(), 3)

    def test_object_on_owner(self):
        rref = HOST.make_rref(cls="seed_fns_py::Accumulator")
        with self.assertRaises(TypeError) as cm:
            rref.local_value()
        msg = str(cm.exception)
        for text in ("rref.local_value() on worker worker0, the RRef's owner",
                     "object of a plugin class", "never copied",
                     "only in a function of the same plugin that worker0 runs with this RRef",
                     "rref.rpc_sync().method(...)",
                     "The worker said: to_here() of RRef"):
            self.assertIn(text, msg)

    def test_object_of_this_instance(self):
        """Run beside its object, a function gets the object itself, and a
        proxy's call on it runs in place (queued behind this very call, it
        would wait for ever)."""
        from wasmrpc import _guest
        from wasmrpc.rpc import Future

        class Counter:
            def __init__(self):
                self.n = 0

            def add(self, k):
                self.n += k
                return self.n

            def fail(self):
                raise ValueError("counter says no")

        obj = Counter()
        _guest._objects[77] = (_scope.Scope(), obj)
        try:
            rref = HOST.make_rref(cls="test_refs::Counter", local=77)
            self.assertIs(rref.local_value(), obj)
            self.assertEqual(rref.rpc_sync().add(2), 2)
            fut = rref.rpc_async().add(3)
            self.assertIsInstance(fut, Future)
            self.assertEqual(fut.wait(), 5)
            with self.assertRaisesRegex(ValueError, "counter says no"):
                rref.rpc_sync().fail()
            self.assertEqual(obj.n, 5)
            # An id the instance does not hold (dropped meanwhile) is no
            # object: the worker's refusal to copy it stands.
            gone = HOST.make_rref(cls="test_refs::Counter", local=78)
            with self.assertRaisesRegex(TypeError, "never copied"):
                gone.local_value()
        finally:
            del _guest._objects[77]

    def test_functions_that_reach_objects(self):
        """The manifest names the functions that call `local_value`, read
        from their code (nested code included), so the owner runs them
        beside an object; the others run on any instance."""

        def call_method(method, rref, *args):
            return method(rref.local_value(), *args)

        def in_comprehension(rrefs):
            return [r.local_value() for r in rrefs]

        def through_a_lambda(rref):
            return (lambda: rref.local_value())()

        def remote_method(method, rref):
            return rpc.rpc_sync(rref.owner(), call_method, args=(method, rref))

        for fn, want in [(call_method, True), (in_comprehension, True), (through_a_lambda, True),
                         (remote_method, False), (functools.wraps(call_method)(lambda *a: 0), True)]:
            self.assertIs(_registry.reaches_objects(fn), want, fn)
        saved = dict(_registry.functions)
        configure()
        try:
            remote(call_method)
            remote(remote_method)
            self.assertIn("call_method", _registry.describe()["reaches_objects"])
            self.assertNotIn("remote_method", _registry.describe()["reaches_objects"])
        finally:
            _registry.functions.clear()
            _registry.functions.update(saved)

    def test_not_owner(self):
        rref = HOST.make_rref(value=3, owner="worker1")
        with self.assertRaisesRegex(RuntimeError, r"can't call local_value\(\) on user WorkerInfo\(id=0, "
                                    r"name=worker0\)\. Call it on owner WorkerInfo\(id=1, name=worker1\)"):
            rref.local_value()


class SeedPlugin(unittest.TestCase):
    """`plugins/python/seed-fns-py`'s function-reference helpers, named as
    the plugin is (`seed_fns_py::...`)."""

    @classmethod
    def setUpClass(cls):
        path = os.path.join(fakehost.ROOT, "plugins", "python", "seed-fns-py")
        sys.path.insert(0, path)
        try:
            cls.app = importlib.import_module("app")
        finally:
            sys.path.remove(path)

    def setUp(self):
        _registry.configure("seed-fns-py")

    def tearDown(self):
        configure()

    def test_call_function(self):
        app = self.app
        self.assertEqual(encode(app.my_function), ref_nodes("seed_fns_py::my_function"))
        self.assertEqual(rpc.rpc_sync("worker0", app.call_function, args=(app.my_function, 1, 2, 3)), 6)
        self.assertIs(rpc.rpc_sync("worker0", app.call_function,
                                   args=(app.MyClass.my_static_method, 11)), True)
        self.assertIs(rpc.rpc_sync("worker0", app.my_function_ref), app.my_function)
        self.assertEqual(app.call_function(decode(ref_nodes("seed_fns_py::Accumulator.add")),
                                           app.Accumulator(1), 2), 3)

    def test_remote_method(self):
        app = self.app
        rref = HOST.make_rref(value=real.ones(2))
        out = rpc.rpc_sync("worker0", app._remote_method, args=(torch.add, rref, HOST.to_kit(real.ones(2))))
        self.assertTrue(real.equal(HOST.to_torch(out), real.full((2,), 2.0)))
        obj = HOST.make_rref(cls="seed_fns_py::Accumulator")
        with self.assertRaisesRegex(TypeError, r"rref\.rpc_sync\(\)\.method"):
            rpc.rpc_sync("worker0", app._remote_method, args=(app.Accumulator.add, obj, 5))


if __name__ == "__main__":
    unittest.main()
