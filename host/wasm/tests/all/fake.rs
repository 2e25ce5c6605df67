//! A fake worker: a [`GuestHost`] that computes with plain `Vec<f32>`s,
//! runs "RPCs" in-process (aten ops directly, plugin functions by calling
//! the runtime again), and counts live handles so tests can check that
//! guests release what they own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
use tokio::sync::{Semaphore, watch};
use wasmrpc_wasm::{
    CallArgs, DType, ErrorKind, GuestHost, HandleKind, HostResult, LogLevel, Plugin, RemoteError,
    Runtime, TensorMeta, Value, WorkerInfo,
};

/// A tensor: float32 elements and a shape. Shared by every handle to it.
#[derive(Debug)]
pub(crate) struct FakeTensor {
    pub(crate) shape: Vec<i64>,
    pub(crate) data: Mutex<Vec<f32>>,
}

impl FakeTensor {
    pub(crate) fn new(shape: Vec<i64>, data: Vec<f32>) -> Arc<FakeTensor> {
        Arc::new(FakeTensor {
            shape,
            data: Mutex::new(data),
        })
    }
    pub(crate) fn values(&self) -> Vec<f32> {
        self.data.lock().unwrap().clone()
    }
}

/// A value with its handles resolved to the objects: what the fake keeps
/// in globals, futures and RRefs.
#[derive(Debug, Clone)]
pub(crate) enum Held {
    Leaf(Value),
    Tensor(Arc<FakeTensor>),
    RRef(Arc<FakeRRef>),
    List(Vec<Held>),
    Tuple(Vec<Held>),
}

type Slot = Option<HostResult<Held>>;

#[derive(Debug)]
pub(crate) struct FakeRRef {
    value: watch::Sender<Slot>,
}

#[derive(Debug)]
pub(crate) struct FakeFuture {
    value: watch::Sender<Slot>,
}

async fn wait_slot(tx: &watch::Sender<Slot>) -> HostResult<Held> {
    let mut rx = tx.subscribe();
    let v = rx
        .wait_for(Option::is_some)
        .await
        .map_err(|_| err("future dropped"))?;
    v.clone().unwrap_or_else(|| Err(err("future has no value")))
}

struct Table<T> {
    next: u32,
    map: HashMap<u32, T>,
}

impl<T: Clone> Table<T> {
    fn new() -> Self {
        Table {
            next: 1,
            map: HashMap::new(),
        }
    }
    fn insert(&mut self, v: T) -> u32 {
        let h = self.next;
        self.next += 1;
        self.map.insert(h, v);
        h
    }
    fn get(&self, h: u32, what: &str) -> HostResult<T> {
        self.map
            .get(&h)
            .cloned()
            .ok_or_else(|| err(format!("no {what} with handle {h}")))
    }
}

pub(crate) fn err(message: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorKind::RuntimeError, message)
}

/// The fake worker.
pub(crate) struct FakeHost {
    me: WorkerInfo,
    peers: Vec<WorkerInfo>,
    tensors: Mutex<Table<Arc<FakeTensor>>>,
    rrefs: Mutex<Table<Arc<FakeRRef>>>,
    futures: Mutex<Table<Arc<FakeFuture>>>,
    globals: Mutex<HashMap<String, Held>>,
    locks: Mutex<HashMap<String, Arc<Semaphore>>>,
    pub(crate) logs: Mutex<Vec<String>>,
    pub(crate) rpcs: AtomicUsize,
    runtime: OnceLock<(Runtime, Arc<Plugin>)>,
    this: Weak<FakeHost>,
}

impl FakeHost {
    /// A worker `worker0` (id 0) that also answers for `worker1`..`worker3`.
    pub(crate) fn new() -> Arc<FakeHost> {
        Arc::new_cyclic(|this| FakeHost {
            me: WorkerInfo {
                id: 0,
                name: "worker0".into(),
            },
            peers: (0..4)
                .map(|i| WorkerInfo {
                    id: i,
                    name: format!("worker{i}"),
                })
                .collect(),
            tensors: Mutex::new(Table::new()),
            rrefs: Mutex::new(Table::new()),
            futures: Mutex::new(Table::new()),
            globals: Mutex::new(HashMap::new()),
            locks: Mutex::new(HashMap::new()),
            logs: Mutex::new(Vec::new()),
            rpcs: AtomicUsize::new(0),
            runtime: OnceLock::new(),
            this: this.clone(),
        })
    }

    /// Lets "RPCs" to plugin functions run `plugin` on `runtime`.
    pub(crate) fn serve(&self, runtime: Runtime, plugin: Arc<Plugin>) {
        let _ = self.runtime.set((runtime, plugin));
    }

    pub(crate) fn arc(&self) -> Arc<dyn GuestHost> {
        self.this
            .upgrade()
            .expect("the host is alive while it is used")
    }

    /// Live tensor handles.
    pub(crate) fn live_tensors(&self) -> usize {
        self.tensors.lock().unwrap().map.len()
    }
    /// Live tensor handles once `then` tasks still finishing have released
    /// theirs: waits up to 10 s for the count to reach `expected`, then
    /// returns it (whatever it is).
    pub(crate) async fn settled_tensors(&self, expected: usize) -> usize {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.live_tensors() != expected && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        self.live_tensors()
    }
    /// Live future handles.
    pub(crate) fn live_futures(&self) -> usize {
        self.futures.lock().unwrap().map.len()
    }

    /// A new tensor handle (owned by whoever receives it).
    pub(crate) fn tensor(&self, shape: &[i64], data: Vec<f32>) -> Value {
        Value::Tensor(
            self.tensors
                .lock()
                .unwrap()
                .insert(FakeTensor::new(shape.to_vec(), data)),
        )
    }
    pub(crate) fn ones(&self, shape: &[i64]) -> Value {
        let n = shape.iter().product::<i64>() as usize;
        self.tensor(shape, vec![1.0; n])
    }

    /// Reads a tensor handle's elements and releases the handle.
    pub(crate) fn take_tensor(&self, v: &Value) -> (Vec<i64>, Vec<f32>) {
        let Value::Tensor(h) = v else {
            panic!("expected a tensor, got {v:?}")
        };
        let t = self
            .tensors
            .lock()
            .unwrap()
            .map
            .remove(h)
            .expect("a live tensor handle");
        (t.shape.clone(), t.values())
    }

    fn get_tensor(&self, h: u32) -> HostResult<Arc<FakeTensor>> {
        self.tensors.lock().unwrap().get(h, "tensor")
    }

    fn resolve(&self, v: &Value) -> HostResult<Held> {
        Ok(match v {
            Value::Tensor(h) => Held::Tensor(self.get_tensor(*h)?),
            Value::RRef(h) => Held::RRef(self.rrefs.lock().unwrap().get(*h, "rref")?),
            Value::List(items) => Held::List(
                items
                    .iter()
                    .map(|i| self.resolve(i))
                    .collect::<HostResult<_>>()?,
            ),
            Value::Tuple(items) => Held::Tuple(
                items
                    .iter()
                    .map(|i| self.resolve(i))
                    .collect::<HostResult<_>>()?,
            ),
            other => Held::Leaf(other.clone()),
        })
    }

    fn materialize(&self, h: &Held) -> Value {
        match h {
            Held::Leaf(v) => v.clone(),
            Held::Tensor(t) => Value::Tensor(self.tensors.lock().unwrap().insert(t.clone())),
            Held::RRef(r) => Value::RRef(self.rrefs.lock().unwrap().insert(r.clone())),
            Held::List(items) => Value::List(items.iter().map(|i| self.materialize(i)).collect()),
            Held::Tuple(items) => Value::Tuple(items.iter().map(|i| self.materialize(i)).collect()),
        }
    }

    /// Gives the callee of an RPC its own copies of the handles.
    fn copy_args(&self, args: &CallArgs) -> HostResult<CallArgs> {
        let mut out = CallArgs::default();
        for a in &args.args {
            out.args.push(self.materialize(&self.resolve(a)?));
        }
        for (k, v) in &args.kwargs {
            out.kwargs
                .push((k.clone(), self.materialize(&self.resolve(v)?)));
        }
        Ok(out)
    }

    fn check_worker(&self, to: &str) -> HostResult<()> {
        if self.peers.iter().any(|w| w.name == to) {
            Ok(())
        } else {
            Err(err(format!("Unknown destination worker {to}")))
        }
    }

    /// Runs `function` "on" `to`: aten ops here, plugin functions through
    /// the runtime (a nested call into the same runtime). The result's
    /// handles are resolved, as if it came over the wire.
    async fn run_remote(
        self: Arc<Self>,
        to: String,
        function: String,
        args: CallArgs,
    ) -> HostResult<Held> {
        self.check_worker(&to)?;
        self.rpcs.fetch_add(1, Ordering::Relaxed);
        let value = if function.starts_with("aten::") {
            // Ops borrow their arguments: release the callee's copies.
            let result = self.op(&function, args.clone()).await;
            args.args
                .iter()
                .chain(args.kwargs.iter().map(|(_, v)| v))
                .for_each(|v| self.release(v));
            result?
        } else {
            let (runtime, plugin) = self
                .runtime
                .get()
                .ok_or_else(|| err("no plugin is served"))?
                .clone();
            runtime
                .call(&plugin, &function, args, self.arc())
                .await
                .map_err(RemoteError::from)?
        };
        let held = self.resolve(&value);
        self.release(&value);
        held
    }

    fn release(&self, v: &Value) {
        match v {
            Value::Tensor(h) => {
                self.tensors.lock().unwrap().map.remove(h);
            }
            Value::RRef(h) => {
                self.rrefs.lock().unwrap().map.remove(h);
            }
            Value::List(items) | Value::Tuple(items) => items.iter().for_each(|i| self.release(i)),
            _ => {}
        }
    }

    fn new_slot(&self) -> (u32, Arc<FakeFuture>) {
        let fut = Arc::new(FakeFuture {
            value: watch::channel(None).0,
        });
        (self.futures.lock().unwrap().insert(fut.clone()), fut)
    }

    fn scalar(v: &Value) -> Option<f32> {
        match v {
            Value::Int(i) => Some(*i as f32),
            Value::Float(f) => Some(*f as f32),
            _ => None,
        }
    }

    fn elementwise(&self, args: &[Value], f: fn(f32, f32) -> f32) -> HostResult<Value> {
        let (a, b) = match args {
            [a, b] => (a, b),
            _ => return Err(err("expected 2 arguments")),
        };
        if let (Some(x), Some(y)) = (Self::scalar(a), Self::scalar(b)) {
            return Ok(match (a, b) {
                (Value::Int(_), Value::Int(_)) => Value::Int(f(x, y) as i64),
                _ => Value::Float(f64::from(f(x, y))),
            });
        }
        let Value::Tensor(ha) = a else {
            return Err(err("expected a tensor"));
        };
        let ta = self.get_tensor(*ha)?;
        let xs = ta.values();
        let out: Vec<f32> = match b {
            Value::Tensor(hb) => {
                let tb = self.get_tensor(*hb)?;
                let ys = tb.values();
                if ys.len() == xs.len() {
                    xs.iter().zip(&ys).map(|(x, y)| f(*x, *y)).collect()
                } else if ys.len() == 1 {
                    xs.iter().map(|x| f(*x, ys[0])).collect()
                } else {
                    return Err(err(format!(
                        "The size of tensor a ({}) must match the size of tensor b ({})",
                        xs.len(),
                        ys.len()
                    )));
                }
            }
            other => {
                let y = Self::scalar(other).ok_or_else(|| err("expected a number"))?;
                xs.iter().map(|x| f(*x, y)).collect()
            }
        };
        Ok(self.tensor(&ta.shape, out))
    }

    fn in_place(&self, args: &[Value], f: fn(f32, f32) -> f32) -> HostResult<Value> {
        let [Value::Tensor(h), other] = args else {
            return Err(err("expected a tensor and an operand"));
        };
        let y = Self::scalar(other).ok_or_else(|| err("expected a number"))?;
        let t = self.get_tensor(*h)?;
        t.data
            .lock()
            .unwrap()
            .iter_mut()
            .for_each(|x| *x = f(*x, y));
        Ok(Value::Tensor(self.tensors.lock().unwrap().insert(t)))
    }
}

#[async_trait::async_trait]
impl GuestHost for FakeHost {
    async fn op(&self, name: &str, args: CallArgs) -> HostResult<Value> {
        let a = &args.args;
        match name {
            "aten::add" => self.elementwise(a, |x, y| x + y),
            "aten::sub" => self.elementwise(a, |x, y| x - y),
            "aten::mul" => self.elementwise(a, |x, y| x * y),
            "aten::div" => self.elementwise(a, |x, y| x / y),
            "aten::mul_" => self.in_place(a, |x, y| x * y),
            "aten::div_" => self.in_place(a, |x, y| x / y),
            "aten::ones" | "aten::zeros" => {
                let Some(Value::List(dims)) = a.first() else {
                    return Err(err("expected a shape"));
                };
                let shape: Vec<i64> = dims
                    .iter()
                    .filter_map(|d| {
                        if let Value::Int(i) = d {
                            Some(*i)
                        } else {
                            None
                        }
                    })
                    .collect();
                let n = shape.iter().product::<i64>() as usize;
                let fill = if name == "aten::ones" { 1.0 } else { 0.0 };
                Ok(self.tensor(&shape, vec![fill; n]))
            }
            "aten::sum" => {
                let [Value::Tensor(h)] = a.as_slice() else {
                    return Err(err("expected a tensor"));
                };
                let s = self.get_tensor(*h)?.values().iter().sum();
                Ok(self.tensor(&[], vec![s]))
            }
            other => Err(RemoteError::new(
                ErrorKind::RuntimeError,
                format!("unknown op {other}"),
            )),
        }
    }

    async fn tensor_new(&self, dtype: DType, shape: Vec<i64>, data: Vec<u8>) -> HostResult<u32> {
        if dtype != DType::Float32 {
            return Err(RemoteError::new(
                ErrorKind::TypeError,
                "the fake only has float32",
            ));
        }
        let values = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(self
            .tensors
            .lock()
            .unwrap()
            .insert(FakeTensor::new(shape, values)))
    }

    async fn tensor_meta(&self, tensor: u32) -> HostResult<TensorMeta> {
        let t = self.get_tensor(tensor)?;
        Ok(TensorMeta {
            dtype: DType::Float32,
            shape: t.shape.clone(),
            requires_grad: false,
        })
    }

    async fn tensor_data(&self, tensor: u32) -> HostResult<(TensorMeta, Vec<u8>)> {
        let t = self.get_tensor(tensor)?;
        let bytes = t.values().iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok((
            TensorMeta {
                dtype: DType::Float32,
                shape: t.shape.clone(),
                requires_grad: false,
            },
            bytes,
        ))
    }

    async fn dup(&self, kind: HandleKind, handle: u32) -> HostResult<u32> {
        match kind {
            HandleKind::Tensor => {
                let t = self.get_tensor(handle)?;
                Ok(self.tensors.lock().unwrap().insert(t))
            }
            HandleKind::RRef => {
                let mut rrefs = self.rrefs.lock().unwrap();
                let r = rrefs.get(handle, "rref")?;
                Ok(rrefs.insert(r))
            }
            HandleKind::Future => {
                let mut futures = self.futures.lock().unwrap();
                let f = futures.get(handle, "future")?;
                Ok(futures.insert(f))
            }
        }
    }

    async fn drop_handle(&self, kind: HandleKind, handle: u32) -> HostResult<()> {
        let gone = match kind {
            HandleKind::Tensor => self.tensors.lock().unwrap().map.remove(&handle).is_some(),
            HandleKind::RRef => self.rrefs.lock().unwrap().map.remove(&handle).is_some(),
            HandleKind::Future => self.futures.lock().unwrap().map.remove(&handle).is_some(),
        };
        if gone {
            Ok(())
        } else {
            Err(err(format!("no {kind:?} handle {handle}")))
        }
    }

    async fn rpc_sync(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        _timeout: Option<f64>,
    ) -> HostResult<Value> {
        self.check_worker(to)?;
        let args = self.copy_args(&args)?;
        let me = self.this.upgrade().ok_or_else(|| err("host gone"))?;
        let held = me
            .run_remote(to.to_owned(), function.to_owned(), args)
            .await?;
        Ok(self.materialize(&held))
    }

    async fn rpc_async(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        _timeout: Option<f64>,
    ) -> HostResult<u32> {
        self.check_worker(to)?;
        let args = self.copy_args(&args)?;
        let me = self.this.upgrade().ok_or_else(|| err("host gone"))?;
        let (handle, fut) = self.new_slot();
        let (to, function) = (to.to_owned(), function.to_owned());
        tokio::spawn(async move {
            let r = me.run_remote(to, function, args).await;
            fut.value.send_replace(Some(r));
        });
        Ok(handle)
    }

    async fn remote(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        _timeout: Option<f64>,
    ) -> HostResult<u32> {
        self.check_worker(to)?;
        let args = self.copy_args(&args)?;
        let me = self.this.upgrade().ok_or_else(|| err("host gone"))?;
        let rref = Arc::new(FakeRRef {
            value: watch::channel(None).0,
        });
        let handle = self.rrefs.lock().unwrap().insert(rref.clone());
        let (to, function) = (to.to_owned(), function.to_owned());
        tokio::spawn(async move {
            let r = me.run_remote(to, function, args).await;
            rref.value.send_replace(Some(r));
        });
        Ok(handle)
    }

    async fn rref_to_here(&self, rref: u32) -> HostResult<Value> {
        let r = self.rrefs.lock().unwrap().get(rref, "rref")?;
        Ok(self.materialize(&wait_slot(&r.value).await?))
    }

    async fn rref_owner(&self, rref: u32) -> HostResult<WorkerInfo> {
        self.rrefs.lock().unwrap().get(rref, "rref")?;
        Ok(self.me.clone())
    }

    async fn rref_new(&self, value: Value) -> HostResult<u32> {
        let held = self.resolve(&value)?;
        let rref = Arc::new(FakeRRef {
            value: watch::channel(Some(Ok(held))).0,
        });
        Ok(self.rrefs.lock().unwrap().insert(rref))
    }

    async fn future_new(&self) -> HostResult<u32> {
        Ok(self.new_slot().0)
    }

    async fn future_set(&self, future: u32, result: HostResult<Value>) -> HostResult<()> {
        let f = self.futures.lock().unwrap().get(future, "future")?;
        let held = match result {
            Ok(v) => Ok(self.resolve(&v)?),
            Err(e) => Err(e),
        };
        let mut set = false;
        f.value.send_if_modified(|slot| {
            if slot.is_none() {
                *slot = Some(held);
                set = true;
            }
            set
        });
        if set {
            Ok(())
        } else {
            Err(err("Future can only be marked completed once."))
        }
    }

    async fn future_wait(&self, future: u32) -> HostResult<Value> {
        let f = self.futures.lock().unwrap().get(future, "future")?;
        Ok(self.materialize(&wait_slot(&f.value).await?))
    }

    async fn future_done(&self, future: u32) -> HostResult<bool> {
        let f = self.futures.lock().unwrap().get(future, "future")?;
        Ok(f.value.borrow().is_some())
    }

    async fn worker_info(&self, name: Option<&str>) -> HostResult<WorkerInfo> {
        match name {
            None => Ok(self.me.clone()),
            Some(n) => self
                .peers
                .iter()
                .find(|w| w.name == n)
                .cloned()
                .ok_or_else(|| err(format!("unknown worker {n}"))),
        }
    }

    async fn global_get(&self, key: &str) -> HostResult<Value> {
        let held = self.globals.lock().unwrap().get(key).cloned();
        Ok(held.map(|h| self.materialize(&h)).unwrap_or(Value::None))
    }

    async fn global_set(&self, key: &str, value: Value) -> HostResult<()> {
        if value == Value::None {
            self.globals.lock().unwrap().remove(key);
        } else {
            let held = self.resolve(&value)?;
            self.globals.lock().unwrap().insert(key.to_owned(), held);
        }
        Ok(())
    }

    async fn lock(&self, key: &str) -> HostResult<()> {
        let sem = self
            .locks
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(1)))
            .clone();
        sem.acquire()
            .await
            .map_err(|_| err("lock closed"))?
            .forget();
        Ok(())
    }

    async fn unlock(&self, key: &str) -> HostResult<()> {
        let sem = self
            .locks
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .ok_or_else(|| err("not locked"))?;
        if sem.available_permits() > 0 {
            return Err(err(format!("lock {key} is not held")));
        }
        sem.add_permits(1);
        Ok(())
    }

    async fn log(&self, _level: LogLevel, message: &str) -> HostResult<()> {
        self.logs.lock().unwrap().push(message.to_owned());
        Ok(())
    }

    async fn sleep(&self, duration: Duration) -> HostResult<()> {
        tokio::time::sleep(duration).await;
        Ok(())
    }
}
