//! Port of PyTorch's `remote_module_test.py` (seed `remote_module_test`):
//! `RemoteModule` over plugin classes. The module classes are the seed-fns
//! wasm plugin's `MyModule` and `BadModule`; the seeds' RPC handler
//! functions (`remote_module_attributes`, `remote_forward`, ...) are native
//! functions registered as `remote_module_test::<name>`. As in the seed,
//! every test body runs on rank 0 only; the other ranks host modules.
//!
//! Adapted:
//! - the `*_script` tests call the module through the seed's typed
//!   interfaces (`MyModuleInterface`, `RemoteMyModuleInterface`), written
//!   here as Rust traits over [`RemoteModule`]: TorchScript's role, typed
//!   code that knows the module only by its interface, is the Rust
//!   caller's (`is_scriptable` stays false);
//! - `test_send_remote_module_with_a_new_attribute_not_pickled_over_the_wire`:
//!   `setattr` is [`RemoteModule::set_attribute`], an attribute of the
//!   handle that its wire form leaves out;
//! - `test_get_module_rref` copies the module with `to_here()`: a plugin
//!   object's copy is its state (`MyModule.__getstate__`, as pickling
//!   copies a module's `__dict__`), whose `_parameters` it compares;
//! - `test_valid_device`'s `module_rref.local_value()` on the owner is the
//!   module's state too.
//!
//! The CUDA tests need a GPU and skip without one, except
//! `test_invalid_devices`: its errors are raised before any CUDA call (the
//! bad ordinal by the owner's device count check), so it runs everywhere.
//!
//! `test_remote_module_py_pickle_not_supported` checks that serde (the
//! counterpart of `torch.save`'s pickler) refuses a handle. Not ported (see
//! `tests/support/not_applicable.tsv`):
//! `test_remote_module_py_pickle_not_supported_script` and
//! `test_send_remote_module_over_the_wire_script_not_supported`
//! (TorchScript modules).

use anyhow::{Context, ensure};
use tch::{Device, Tensor};
use wasmrpc::testing::{Cluster, ClusterBuilder, Worker};
use wasmrpc::{Args, ErrorKind, Payload, PluginHost, RemoteModule, RpcAgent, args};
use wasmrpc_tests::{dist_with, expect_err, expect_tensor, ones, register_all, require_gpus};

const MY_MODULE: &str = "seed_fns::MyModule";

/// The seed's `args=(1,)`, `kwargs={"first_kwarg": 2}`.
fn ctor_args() -> Args {
    args![1].kwarg("first_kwarg", 2)
}

fn forward_args() -> Args {
    args![ones(&[1]), 2, "3"]
}

/// `("3", 2, ones(1))`.
fn expect_forward_result(p: &Payload) -> anyhow::Result<()> {
    let items = p.items()?;
    ensure!(items.len() == 3, "forward returned {p:?}");
    ensure!(items[0].as_str()? == "3", "word {:?}", items[0]);
    ensure!(items[1].as_int()? == 2, "number {:?}", items[1]);
    expect_tensor(&items[2], &ones(&[1]))
}

/// The seed's RPC handler functions, run on the callee.
fn register_handlers(r: &wasmrpc::FunctionRegistry) {
    // `remote_module.__dict__` on the receiver: the attributes that arrived
    // on the wire, in the order they arrived (read from the payload itself,
    // not from a handle rebuilt from it, which would keep only the fields it
    // knows), then the generated methods unpickling installs, and the plain
    // attributes' values.
    r.register_native(
        "remote_module_test::remote_module_attributes",
        |_ctx, args: Args| async move {
            let arrived = args.get(0)?;
            let mut keys: Vec<Payload> = arrived.entries()?.into_iter().map(|(k, _)| k).collect();
            let m = RemoteModule::from_payload(&arrived)?;
            // The methods the rebuilt handle serves, as unpickling
            // installs them in the receiver's `__dict__`.
            keys.extend(
                m.generated_methods()
                    .iter()
                    .map(|g| Payload::from(g.as_str())),
            );
            let on = match m.on() {
                wasmrpc::remote_module::RemoteOn::Name(n) => Payload::from(n.clone()),
                wasmrpc::remote_module::RemoteOn::Rank(r) => Payload::from(i64::from(*r)),
            };
            Ok(Payload::tuple([
                Payload::list(keys),
                on,
                Payload::from(m.device().to_owned()),
                Payload::from(m.is_device_map_set()),
                Payload::from(m.is_scriptable()),
            ]))
        },
    );
    r.register_native(
        "remote_module_test::remote_forward",
        |ctx, args: Args| async move {
            let m = RemoteModule::from_payload(&args.get(0)?)?;
            let call = Args::new();
            let call = args.get(1)?.items()?.into_iter().fold(call, Args::arg);
            m.forward(ctx.agent(), call).await
        },
    );
    r.register_native(
        "remote_module_test::remote_forward_async",
        |ctx, args: Args| async move {
            let m = RemoteModule::from_payload(&args.get(0)?)?;
            let call = args
                .get(1)?
                .items()?
                .into_iter()
                .fold(Args::new(), Args::arg);
            m.forward_async(ctx.agent(), call).wait().await
        },
    );
    r.register_native(
        "remote_module_test::get_remote_training_arg",
        |ctx, args: Args| async move {
            let rref = args.get(0)?.as_rref()?;
            rref.rpc_sync(ctx.agent(), None)
                .call("training", args![])
                .await
        },
    );
    // The seed's `remote_device(module_rref)`: the device of the first
    // parameter of `module_rref.local_value()` (the module's state, its
    // `_parameters`), on the owner.
    r.register_native(
        "remote_module_test::remote_device",
        |ctx, args: Args| async move {
            let module = args.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
            let params = module
                .get("_parameters")?
                .ok_or_else(|| wasmrpc::Error::runtime("the module has no _parameters"))?
                .entries()?;
            let (_, param) = params
                .first()
                .ok_or_else(|| wasmrpc::Error::runtime("the module has no parameters"))?;
            let device = wasmrpc::device::Device::from_tch(param.as_tensor()?.device())?;
            Ok(Payload::from(device.to_string()))
        },
    );
    r.register_native(
        "remote_module_test::init_from_module_rref",
        |_ctx, args: Args| async move {
            let device = args.get(0)?.as_str()?.to_owned();
            let m = RemoteModule::init_from_module_rref(&device, args.get(1)?.as_rref()?)?;
            Ok(m.to_payload())
        },
    );
}

fn module_cluster(world_size: u32) -> ClusterBuilder {
    let host = PluginHost::shared().expect("the process's plugin host starts");
    let plugin = host
        .load_file(wasmrpc_plugins::SEED_FNS)
        .expect("the seed-fns plugin loads");
    Cluster::builder(world_size).functions(move |r| {
        register_all(r);
        register_handlers(r);
        host.register(&plugin, r);
    })
}

/// Runs `body` on rank 0 of a `world_size` cluster (the seeds' `if
/// self.rank != 0: return`).
fn on_rank0<F, Fut>(world_size: u32, body: F)
where
    F: Fn(Worker) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let body = std::sync::Arc::new(body);
    dist_with(module_cluster(world_size), move |w| {
        let body = body.clone();
        async move {
            if w.rank != 0 {
                return Ok(());
            }
            body(w).await
        }
    });
}

// ------------------------------------------------------ RemoteModuleTest

#[test]
fn test_bad_module() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1/cpu", "seed_fns::BadModule", ctor_args())?;
        for _ in 0..2 {
            expect_err(
                m.forward(&w.agent, args![]).await,
                ErrorKind::ValueError,
                "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>,",
            )?;
        }
        Ok(())
    });
}

#[test]
fn test_forward_async() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let p = m.forward_async(&w.agent, forward_args()).wait().await?;
        expect_forward_result(&p)
    });
}

/// The seed's `@torch.jit.interface MyModuleInterface` and
/// `RemoteMyModuleInterface`: the typed signature a caller that knows the
/// module only by its interface uses (the `*_script` tests' TorchScript
/// functions).
trait RemoteMyModuleInterface {
    fn forward_async(
        &self,
        agent: &RpcAgent,
        tensor: &Tensor,
        number: i64,
        word: &str,
    ) -> wasmrpc::Future;
}

impl RemoteMyModuleInterface for RemoteModule {
    fn forward_async(
        &self,
        agent: &RpcAgent,
        tensor: &Tensor,
        number: i64,
        word: &str,
    ) -> wasmrpc::Future {
        RemoteModule::forward_async(self, agent, args![tensor, number, word])
    }
}

/// The interface's return type, `Tuple[str, int, Tensor]`.
fn typed_result(p: &Payload) -> anyhow::Result<(String, i64, Tensor)> {
    let items = p.items()?;
    ensure!(items.len() == 3, "forward returned {p:?}");
    Ok((
        items[0].as_str()?.to_owned(),
        items[1].as_int()?,
        items[2].as_tensor()?,
    ))
}

/// The seed's `@torch.jit.script run_forward_async(scripted_remote_module:
/// RemoteMyModuleInterface)` (and `run_forward`: the same, waited).
async fn run_forward_async(
    agent: &RpcAgent,
    m: &impl RemoteMyModuleInterface,
) -> anyhow::Result<(String, i64, Tensor)> {
    let fut = m.forward_async(agent, &ones(&[1]), 2, "3");
    typed_result(&fut.wait().await?)
}

#[test]
fn test_forward_async_script() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let (word, number, tensor) = run_forward_async(&w.agent, &m).await?;
        ensure!(word == "3" && number == 2, "({word}, {number}, _)");
        expect_tensor(&Payload::from(&tensor), &ones(&[1]))
    });
}

#[test]
fn test_forward_sync() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        expect_forward_result(&m.forward(&w.agent, forward_args()).await?)
    });
}

#[test]
fn test_forward_with_kwargs() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let call = || args![ones(&[1]), 2].kwarg("word", "3");
        let p = m.forward_async(&w.agent, call()).wait().await?;
        expect_forward_result(&p)?;
        expect_forward_result(&m.forward(&w.agent, call()).await?)
    });
}

#[test]
fn test_remote_module_py_pickle_not_supported() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        // `torch.save(remote_module, fname)`: serde is the serializer
        // outside RPC.
        let dir = tempfile::tempdir()?;
        let file = std::fs::File::create(dir.path().join("remote_module.json"))?;
        let e = serde_json::to_writer(file, &m).unwrap_err().to_string();
        ensure!(
            e.contains(
                "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled \
                 when using RPC"
            ),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn test_remote_parameters() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let params = m.remote_parameters(&w.agent, true).await?;
        ensure!(params.len() == 1, "{} parameters", params.len());
        ensure!(params[0].owner_name() == "worker1");
        let p = params[0].to_here(&w.agent, None).await?;
        expect_tensor(&p, &ones(&[1]))
    });
}

#[test]
fn test_get_module_rref() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let rref = m.get_module_rref().clone();
        ensure!(rref.ptr_eq(m.get_module_rref()) && rref.id() == m.get_module_rref().id());
        // `rref.to_here().parameters()`: the copy is the module's state
        // (`MyModule.__getstate__`), its parameters under `_parameters`.
        let module = rref.to_here(&w.agent, None).await?;
        let params = module
            .get("_parameters")?
            .context("the copied module has no _parameters")?
            .entries()?;
        ensure!(params.len() == 1, "{params:?}");
        for (_, p) in &params {
            expect_tensor(p, &ones(&[1]))?;
        }
        Ok(())
    });
}

#[test]
fn test_train_eval() {
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let training = |w: Worker, m: RemoteModule| async move {
            let p = w
                .agent
                .rpc_sync(
                    "worker1",
                    "remote_module_test::get_remote_training_arg",
                    args![m.get_module_rref()],
                )
                .await?;
            anyhow::Ok(p.as_bool()?)
        };
        m.train(&w.agent, true).await?;
        ensure!(
            training(w.clone(), m.clone()).await?,
            "not training after train()"
        );
        m.eval(&w.agent).await?;
        ensure!(
            !training(w.clone(), m.clone()).await?,
            "training after eval()"
        );
        Ok(())
    });
}

#[test]
fn test_send_remote_module_with_a_new_attribute_not_pickled_over_the_wire() {
    on_rank0(2, |w| async move {
        let mut m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        m.set_attribute("new_attr", Payload::from(1));
        ensure!(m.attribute("new_attr").map(|v| v.as_int()).transpose()? == Some(1));
        let attrs = w
            .agent
            .rpc_sync(
                "worker1",
                "remote_module_test::remote_module_attributes",
                args![m.to_payload()],
            )
            .await?
            .items()?;
        let keys: Vec<String> = attrs[0]
            .items()?
            .iter()
            .map(|k| k.as_str().map(ToOwned::to_owned))
            .collect::<wasmrpc::Result<_>>()?;
        ensure!(!keys.iter().any(|k| k == "new_attr"), "{keys:?}");
        let mut want: Vec<&str> = wasmrpc::remote_module::REMOTE_MODULE_PICKLED_ATTRIBUTES.to_vec();
        want.extend(["forward_async", "forward"]);
        ensure!(keys == want, "{keys:?}");
        Ok(())
    });
}

// ------------------------------------------ ThreeWorkersRemoteModuleTest

#[test]
fn test_send_remote_module_over_the_wire() {
    on_rank0(3, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let attrs = w
            .agent
            .rpc_sync(
                "worker2",
                "remote_module_test::remote_module_attributes",
                args![m.to_payload()],
            )
            .await?
            .items()?;
        let keys: Vec<String> = attrs[0]
            .items()?
            .iter()
            .map(|k| k.as_str().map(ToOwned::to_owned))
            .collect::<wasmrpc::Result<_>>()?;
        // `expected_unpickled_attrs`: the pickled attributes, then the
        // generated methods.
        let mut want: Vec<&str> = wasmrpc::remote_module::REMOTE_MODULE_PICKLED_ATTRIBUTES.to_vec();
        want.extend(["forward_async", "forward"]);
        ensure!(keys == want, "{keys:?}");
        ensure!(attrs[1].as_str()? == "worker1");
        ensure!(attrs[2].as_str()? == "cpu");
        ensure!(!attrs[3].as_bool()?);
        ensure!(!attrs[4].as_bool()?);
        // The forward runs on worker1, asked by worker2.
        let a = Payload::tuple([Payload::from(&ones(&[1])), 2.into(), "3".into()]);
        for f in [
            "remote_module_test::remote_forward",
            "remote_module_test::remote_forward_async",
        ] {
            let p = w
                .agent
                .rpc_sync("worker2", f, args![m.to_payload(), a.clone()])
                .await?;
            expect_forward_result(&p)?;
        }
        Ok(())
    });
}

#[test]
fn test_create_remote_module_from_module_rref() {
    on_rank0(3, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1", MY_MODULE, ctor_args())?;
        let m2 = w
            .agent
            .rpc_sync(
                "worker2",
                "remote_module_test::init_from_module_rref",
                args!["worker2", m.get_module_rref()],
            )
            .await?;
        let m2 = RemoteModule::from_payload(&m2)?;
        ensure!(m2.on() == &wasmrpc::remote_module::RemoteOn::Name("worker2".into()));
        let a = Payload::tuple([Payload::from(&ones(&[1])), 2.into(), "3".into()]);
        let ret1 = w
            .agent
            .rpc_sync(
                "worker1",
                "remote_module_test::remote_forward",
                args![m.to_payload(), a.clone()],
            )
            .await?;
        let ret2 = w
            .agent
            .rpc_sync(
                "worker2",
                "remote_module_test::remote_forward",
                args![m2.to_payload(), a],
            )
            .await?;
        ensure!(ret1.equal(&ret2), "{ret1:?} != {ret2:?}");
        expect_forward_result(&ret1)?;
        // Both handles name the same module, owned by worker1.
        ensure!(m2.get_module_rref().owner_name() == "worker1");
        Ok(())
    });
}

// -------------------------------------------------- CudaRemoteModuleTest

#[test]
fn test_valid_device() {
    if !require_gpus(1) {
        return;
    }
    on_rank0(2, |w| async move {
        for remote_device in ["worker1/cuda:0", "rank:1/cuda:0"] {
            let m = RemoteModule::new(&w.agent, remote_device, MY_MODULE, ctor_args())?;
            let device = w
                .agent
                .rpc_sync(
                    "worker1",
                    "remote_module_test::remote_device",
                    args![m.get_module_rref()],
                )
                .await?;
            ensure!(device.as_str()? == "cuda:0", "{remote_device}: {device:?}");
        }
        Ok(())
    });
}

#[test]
fn test_invalid_devices() {
    on_rank0(2, |w| async move {
        // `[m.forward() for m in _create_remote_module_iter(remote_device)]`:
        // creation errors raise locally, the owner's on first use.
        let create_and_forward = |remote_device: &'static str| {
            let w = w.clone();
            async move {
                let m = RemoteModule::new(&w.agent, remote_device, MY_MODULE, ctor_args())?;
                m.forward(&w.agent, args![]).await
            }
        };
        let cases: [(&str, ErrorKind, &str); 7] = [
            (
                "worker1/foo",
                ErrorKind::RuntimeError,
                "device type at start of device string",
            ),
            (
                "worker1/cuda:100",
                ErrorKind::RuntimeError,
                "CUDA error: invalid device ordinal",
            ),
            (
                "worker1/cpu2",
                ErrorKind::RuntimeError,
                "Invalid device string: 'cpu2'",
            ),
            (
                "worker1/",
                ErrorKind::RuntimeError,
                "Device string must not be empty",
            ),
            (
                "worker1/cuda:0/cuda:1",
                ErrorKind::ValueError,
                "Could not parse remote_device: worker1/cuda:0/cuda:1. The valid format is '<workername>/<device>'",
            ),
            (
                "/",
                ErrorKind::ValueError,
                "Could not parse remote_device: /. The valid format is '<workername>/<device>'",
            ),
            (
                "/cuda:0",
                ErrorKind::ValueError,
                "Could not parse remote_device: /cuda:0. The valid format is '<workername>/<device>'",
            ),
        ];
        for (remote_device, kind, text) in cases {
            let e = expect_err(create_and_forward(remote_device).await, kind, text)?;
            if remote_device == "worker1/foo" {
                ensure!(
                    e.message().starts_with("Expected one of cpu, cuda, "),
                    "{}",
                    e.message()
                );
            }
        }
        Ok(())
    });
}

/// `test_input_moved_to_cuda_device`'s checks: `(t2, 2, t1)`, the tensors
/// back on the CPU (no device map toward the owner).
fn expect_moved_back(p: &Payload, t1: &Tensor, t2: &Tensor) -> anyhow::Result<()> {
    let items = p.items()?;
    ensure!(items.len() == 3, "forward returned {p:?}");
    expect_tensor(&items[0], t2)?;
    ensure!(items[1].as_int()? == 2, "number {:?}", items[1]);
    expect_tensor(&items[2], t1)?;
    for i in [0, 2] {
        let d = items[i].as_tensor()?.device();
        ensure!(d == Device::Cpu, "result {i} on {d:?}");
    }
    Ok(())
}

#[test]
fn test_input_moved_to_cuda_device() {
    if !require_gpus(1) {
        return;
    }
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1/cuda:0", MY_MODULE, ctor_args())?;
        ensure!(!m.is_device_map_set());
        // `t1 = ones(1)`, `t2 = t1 * 2`; `args=(t1, 2)`, `kwargs={"word": t2}`.
        let t1 = || ones(&[1]);
        let t2 = || ones(&[1]) * 2;
        let call = || args![t1(), 2].kwarg("word", t2());
        let p = m.forward_async(&w.agent, call()).wait().await?;
        expect_moved_back(&p, &t1(), &t2())?;
        let p = m.forward(&w.agent, call()).await?;
        expect_moved_back(&p, &t1(), &t2())
    });
}

#[test]
fn test_input_moved_to_cuda_device_script() {
    if !require_gpus(1) {
        return;
    }
    on_rank0(2, |w| async move {
        let m = RemoteModule::new(&w.agent, "worker1/cuda:0", MY_MODULE, ctor_args())?;
        let (word, number, tensor) = run_forward_async(&w.agent, &m).await?;
        ensure!(word == "3" && number == 2, "({word}, {number}, _)");
        ensure!(tensor.device() == Device::Cpu, "{:?}", tensor.device());
        expect_tensor(&Payload::from(&tensor), &ones(&[1]))
    });
}
