//! The seeds' classes (`MyClass`, `TensorWrapper`, `MyModule`, ...),
//! served as remote classes.

use wasmrpc_guest::{
    AnyValue, FromValue, Future, IntoValue, RRef, Result, Tensor, Value, global, remote,
    remote_class, rpc_async, set_global, sleep,
};

use crate::Num;

/// A second handle to a number (a tensor's handle is duplicated).
fn dup_num(n: &Num) -> Result<Num> {
    Ok(match n {
        Num::Int(i) => Num::Int(*i),
        Num::Float(f) => Num::Float(*f),
        Num::Tensor(t) => Num::Tensor(t.try_clone()?),
    })
}

/// `MyClass(a, delay=False)`: `a` is a number or a tensor.
pub struct MyClass {
    a: Num,
}

#[remote_class]
impl MyClass {
    /// `MyClass(a, delay=False)`: with `delay`, the constructor sleeps a
    /// second.
    #[constructor]
    fn new(a: Num, delay: Option<bool>) -> Result<MyClass> {
        if delay.unwrap_or(false) {
            sleep(1.0)?;
        }
        Ok(MyClass { a })
    }

    /// `self.a + my_instance_arg`.
    fn my_instance_method(&self, my_instance_arg: Num) -> Result<Num> {
        self.a.add(&my_instance_arg)
    }

    /// `@classmethod my_class_method(cls, d, e)`: `d + e`.
    fn my_class_method(d: Num, e: Num) -> Result<Num> {
        d.add(&e)
    }

    /// `@staticmethod my_static_method(f)`: `f > 10`.
    fn my_static_method(f: i64) -> bool {
        f > 10
    }

    /// `self.a += increment`.
    fn increment_value(&mut self, increment: Num) -> Result<()> {
        self.a = self.a.add(&increment)?;
        Ok(())
    }

    /// `self.a`.
    fn get_value(&self) -> Result<Num> {
        dup_num(&self.a)
    }

    /// `my_slow_method(t)`: sleeps 5 s (the seed's), then `self.a + t`.
    fn my_slow_method(&self, my_tensor_arg: Tensor) -> Result<Num> {
        sleep(5.0)?;
        self.a.add(&Num::Tensor(my_tensor_arg))
    }

    /// Reads `a`, sleeps `seconds` (the guest is suspended), then writes
    /// `a + by`: two overlapping calls would lose an update.
    fn slow_increment(&mut self, by: i64, seconds: f64) -> Result<Num> {
        let before = dup_num(&self.a)?;
        sleep(seconds)?;
        self.a = before.add(&Num::Int(by))?;
        dup_num(&self.a)
    }

    /// `self.a + rref.to_here()`: an RRef argument of a method.
    fn add_from_rref(&self, rref: RRef) -> Result<Num> {
        self.a.add(&rref.to_here::<Num>()?)
    }

    /// A method that panics, to check that a broken object reports it.
    fn explode(&self) -> i64 {
        match &self.a {
            Num::Int(a) => panic!("MyClass exploded with a = {a}"),
            Num::Float(a) => panic!("MyClass exploded with a = {a}"),
            Num::Tensor(_) => panic!("MyClass exploded with a tensor"),
        }
    }

    /// `@async_execution bound_async_add(to, x, y)`: `rpc_async(add) + a`.
    #[async_execution]
    fn bound_async_add(&self, to: String, x: Tensor, y: Tensor) -> Result<Future> {
        rpc_async(&to, "aten::add", (x, y))?.then("_add_then", (dup_num(&self.a)?,))
    }
}

/// A class that holds a tensor, so destroying it must release the handle.
pub struct TensorWrapper {
    tensor: Tensor,
}

#[remote_class]
impl TensorWrapper {
    /// `TensorWrapper(t)`.
    #[constructor]
    fn new(t: Tensor) -> TensorWrapper {
        TensorWrapper { tensor: t }
    }

    /// `self.t += v`.
    fn increase(&mut self, v: f64) -> Result<()> {
        self.tensor = self.tensor.add(v)?;
        Ok(())
    }

    /// `self.t.sum()`.
    fn sum(&self) -> Result<Tensor> {
        self.tensor.sum()
    }
}

/// `AsyncExecutionClass()`: `async_execution` static, class and bound
/// methods. Called by name, the static and class methods are
/// `seed_fns::AsyncExecutionClass.static_async_add` and
/// `seed_fns::AsyncExecutionClass.class_async_add`.
pub struct AsyncExecutionClass;

#[remote_class]
impl AsyncExecutionClass {
    /// `AsyncExecutionClass()`.
    #[constructor]
    fn new() -> AsyncExecutionClass {
        AsyncExecutionClass
    }

    /// `@staticmethod @async_execution static_async_add(to, x, y, z)`:
    /// `rpc_async(to, add, (x, y)).then(+ z)`.
    #[async_execution]
    fn static_async_add(to: String, x: Tensor, y: Num, z: Num) -> Result<Future> {
        rpc_async(&to, "aten::add", (x, y))?.then("_add_then", (z,))
    }

    /// `@classmethod @async_execution class_async_add(cls, to, x, y, z)`:
    /// returns a `Future()` it completes by hand with `add(x, y) + z`.
    #[async_execution]
    fn class_async_add(to: String, x: Tensor, y: Num, z: Num) -> Result<Future> {
        let done = Future::new()?;
        let sum: Tensor = rpc_async(&to, "aten::add", (x, y))?.wait()?;
        done.set_result(Num::Tensor(sum).add(&z)?)?;
        Ok(done)
    }

    /// `@async_execution bound_async_add(self, to, x, y, z)`:
    /// `rpc_async(to, add, (x, y)).then(+ z)`.
    #[async_execution]
    fn bound_async_add(&self, to: String, x: Tensor, y: Num, z: Num) -> Result<Future> {
        rpc_async(&to, "aten::add", (x, y))?.then("_add_then", (z,))
    }
}

/// `Tracked(key)`: an object whose destructor counts itself in the
/// per-worker global `key`, so tests can see when its owner disposed of it.
pub struct Tracked {
    key: String,
}

#[remote_class]
impl Tracked {
    /// `Tracked(key)`.
    #[constructor]
    fn new(key: String) -> Tracked {
        Tracked { key }
    }

    /// The key it counts itself in.
    fn key(&self) -> String {
        self.key.clone()
    }

    /// `@staticmethod disposed(key)`: how many `Tracked(key)` objects this
    /// worker disposed of.
    fn disposed(key: String) -> Result<i64> {
        Ok(global::<i64>(&key)?.unwrap_or(0))
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let n = global::<i64>(&self.key).ok().flatten().unwrap_or(0);
        let _ = set_global(&self.key, n + 1);
    }
}

/// `MyModule(first_arg, first_kwarg=-1)` of `remote_module_test.py`: one
/// parameter, `ones(1)`; `forward(tensor, number, word="default")` returns
/// `(word, number, tensor)`. `word` takes any value, as in Python
/// (`test_input_moved_to_cuda_device` passes a tensor).
pub struct MyModule {
    param1: Tensor,
    training: bool,
}

#[remote_class]
impl MyModule {
    /// `MyModule(first_arg, first_kwarg=-1)`.
    #[constructor]
    fn new(first_arg: i64, first_kwarg: Option<i64>) -> Result<MyModule> {
        let _ = (first_arg, first_kwarg);
        Ok(MyModule {
            param1: Tensor::ones(&[1])?,
            training: true,
        })
    }

    /// `forward(tensor, number, word="default")`: the arguments reversed.
    fn forward(
        &self,
        tensor: Tensor,
        number: i64,
        word: Option<AnyValue>,
    ) -> Result<(AnyValue, i64, Tensor)> {
        let word = match word {
            Some(w) => w,
            None => AnyValue::from_value(Value::Str("default".to_owned()))?,
        };
        Ok((word, number, tensor))
    }

    /// `parameters(recurse=True)`: `[param1]`.
    fn parameters(&self, recurse: Option<bool>) -> Result<Vec<Tensor>> {
        let _ = recurse;
        Ok(vec![self.param1.try_clone()?])
    }

    /// `train(mode=True)`.
    fn train(&mut self, mode: Option<bool>) {
        self.training = mode.unwrap_or(true);
    }

    /// `training`.
    fn training(&self) -> bool {
        self.training
    }

    /// What copying the module out of its owner takes (`to_here()` of its
    /// RRef), as pickling a module copies its `__dict__`: `{"training":
    /// bool, "_parameters": {"param1": tensor}}`.
    fn __getstate__(&self) -> Result<Value> {
        Ok(Value::Dict(vec![
            (Value::from("training"), Value::Bool(self.training)),
            (
                Value::from("_parameters"),
                Value::Dict(vec![(
                    Value::from("param1"),
                    self.param1.try_clone()?.into_value(),
                )]),
            ),
        ]))
    }
}

/// `BadModule(first_arg, first_kwarg=-1)`: constructs, but is not a
/// module (no `forward`).
pub struct BadModule;

#[remote_class]
impl BadModule {
    /// `BadModule(first_arg, first_kwarg=-1)`.
    #[constructor]
    fn new(first_arg: i64, first_kwarg: Option<i64>) -> BadModule {
        let _ = (first_arg, first_kwarg);
        BadModule
    }
}

/// Creates `MyClass(a)` on `dst` from inside a plugin and drives it
/// through its proxies: `increment_value(1)` (sync), `my_instance_method(10)`
/// (async), `get_value()` (remote). Returns `(owner name, (is_owner,
/// confirmed_by_owner), a + 1 + 10, a + 1)`.
#[remote]
fn drive_my_class(dst: String, a: i64) -> Result<(String, (bool, bool), i64, i64)> {
    let obj = remote(&dst, "MyClass", (a,))?;
    obj.rpc_sync().call::<()>("increment_value", (1,))?;
    let sum: i64 = obj.rpc_async().call("my_instance_method", (10,))?.wait()?;
    let value: i64 = obj
        .remote()
        .timeout(30.0)
        .call("get_value", ())?
        .to_here()?;
    Ok((
        obj.owner_name()?,
        (obj.is_owner()?, obj.confirmed_by_owner()?),
        sum,
        value,
    ))
}
