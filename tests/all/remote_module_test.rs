//! Port of PyTorch's `remote_module_test.py` (seed `remote_module_test`):
//! `RemoteModule` over plugin classes. The module classes are the seed-fns
//! wasm plugin's `MyModule` and `BadModule`; the seeds' RPC handler
//! functions (`remote_module_attributes`, `remote_forward`, ...) are native
//! functions registered as `remote_module_test::<name>`. As in the seed,
//! every test body runs on rank 0 only; the other ranks host modules.
//!
//! Not ported, with the reason:
//! - `MODULE_CTOR_WITH_INTERFACE` (TorchScript interfaces) and the
//!   `*_script` tests, `test_remote_module_py_pickle_not_supported*`,
//!   `test_send_remote_module_with_a_new_attribute_not_pickled_over_the_wire`,
//!   `test_send_remote_module_over_the_wire_script_not_supported`:
//!   python-only (TorchScript, pickle, open Python objects);
//! - `test_unsupported_methods`: the Rust handle has no `nn.Module` API to
//!   refuse;
//! - the CUDA tests (`test_valid_device`, `test_invalid_devices`,
//!   `test_input_moved_to_cuda_device*`): modules are placed on the CPU
//!   only for now; `remote_device` parsing with the seed's error texts is
//!   unit-tested in `wasmrpc::remote_module`.

use anyhow::ensure;
use wasmrpc::testing::{Cluster, ClusterBuilder, Worker};
use wasmrpc::{Args, ErrorKind, Payload, PluginHost, RemoteModule, args};
use wasmrpc_tests::{dist_with, expect_err, expect_tensor, ones, register_all};

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
    // `remote_module.__dict__` as received: the wire attributes in order,
    // then the generated methods, and the plain attributes' values.
    r.register_native(
        "remote_module_test::remote_module_attributes",
        |_ctx, args: Args| async move {
            let p = args.get(0)?;
            let m = RemoteModule::from_payload(&p)?;
            let mut keys: Vec<Payload> = p.entries()?.into_iter().map(|(k, _)| k).collect();
            for method in ["forward_async", "forward"] {
                keys.push(Payload::from(method));
            }
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
        // The seed copies the module with `to_here()`; plugin objects stay
        // on their owner, so its parameters are read through the handle.
        expect_err(
            rref.to_here(&w.agent, None).await,
            ErrorKind::TypeError,
            "objects stay on their owner",
        )?;
        ensure!(rref.get_type(&w.agent, None).await? == MY_MODULE);
        for p in m.remote_parameters(&w.agent, true).await? {
            expect_tensor(&p.to_here(&w.agent, None).await?, &ones(&[1]))?;
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
        ensure!(
            keys == [
                "on",
                "device",
                "is_device_map_set",
                "is_scriptable",
                "generated_methods",
                "module_rref",
                "forward_async",
                "forward"
            ],
            "{keys:?}"
        );
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
