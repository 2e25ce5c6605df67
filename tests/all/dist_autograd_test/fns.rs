//! Native stand-ins for `dist_autograd_test`'s Python functions, the
//! builtin ops it runs locally (workers serve them by name themselves,
//! under the default op policy), and its helpers (`_verify_backwards`,
//! `_all_contexts_cleaned_up`, the per-worker `rpc_done` globals).

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use tokio::sync::Notify;
use wasmrpc::testing::{Cluster, ClusterBuilder, worker_name};
use wasmrpc::{
    Args, CallContext, Error, FunctionRegistry, Payload, Result, RpcAgent, args, dist_autograd,
};

/// Runs builtin `name` on `args` here, through libtorch's operator
/// registry (what a callee does for a builtin RPC).
///
/// # Errors
/// No matching schema, or the op's own error.
pub(super) fn call_builtin(name: &str, args: Args) -> Result<Payload> {
    let Args {
        positional,
        kwargs,
        tensors,
        ..
    } = args;
    let mut out = Vec::new();
    let value = wasmrpc_torch_sys::call_op_values(
        name,
        &positional,
        &kwargs,
        &mut |i| tensors.get(i as usize).map(Tensor::shallow_clone),
        &mut |t| {
            out.push(t);
            (out.len() - 1) as u32
        },
    )
    .map_err(|e| Error::new(e.kind(), e.to_string()))?;
    Ok(Payload {
        value,
        tensors: out,
        rrefs: Vec::new(),
    })
}

/// Per worker: the seeds' `rpc_done`, `ctx_ids` and `known_context_ids`.
#[derive(Default)]
pub(super) struct RpcDone {
    state: Mutex<([bool; 4], [i64; 4], HashSet<i64>)>,
    notify: Notify,
}

impl RpcDone {
    /// `_set_rpc_done(ctx_id, rank_distance)`.
    pub(super) fn set(&self, ctx_id: i64, d: usize) {
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.0[d] = true;
            st.1[d] = ctx_id;
            st.2.insert(ctx_id);
        }
        self.notify.notify_waiters();
    }

    /// `_check_rpc_done(d)`: waits until `rpc_done[d]`.
    pub(super) async fn wait(&self, d: usize) {
        loop {
            let n = self.notify.notified();
            if self.state.lock().unwrap_or_else(|p| p.into_inner()).0[d] {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), n).await;
        }
    }

    /// `ctx_ids[d]`.
    pub(super) fn ctx_id(&self, d: usize) -> i64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1[d]
    }

    /// `known_context_ids`.
    pub(super) fn known(&self) -> Vec<i64> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .2
            .iter()
            .copied()
            .collect()
    }
}

/// The seeds' module-global `requires_grad_tensor`, per worker.
pub(super) struct RequiresGradTensor(pub Mutex<Tensor>);

impl Default for RequiresGradTensor {
    fn default() -> Self {
        RequiresGradTensor(Mutex::new(
            Tensor::ones([3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
        ))
    }
}

/// `SimulateBackwardError._simulate_error`, per worker.
pub(super) struct SimulateError(pub AtomicBool);

impl Default for SimulateError {
    fn default() -> Self {
        SimulateError(AtomicBool::new(true))
    }
}

/// The text `SimulateBackwardError` raises.
pub(super) const SIMULATE_ERROR: &str = "Simulate error on backward pass";

/// `SimulateBackwardError.apply(t)`: identity forward; the backward fails
/// while the worker's flag is set.
///
/// # Errors
/// No current context.
pub(super) fn simulate_backward_error(agent: &RpcAgent, t: &Tensor) -> Result<Tensor> {
    let flag = agent.state::<SimulateError>();
    let out = dist_autograd::apply_function(
        agent,
        &[t.shallow_clone()],
        |xs| Ok(vec![xs[0].shallow_clone()]),
        move |grads| {
            if flag.0.load(Ordering::Acquire) {
                Err(Error::runtime(SIMULATE_ERROR))
            } else {
                Ok(grads
                    .iter()
                    .map(|g| g.as_ref().map(Tensor::shallow_clone))
                    .collect())
            }
        },
    )?;
    out.into_iter()
        .next()
        .ok_or_else(|| Error::runtime("no output"))
}

fn t(args: &Args, i: usize) -> Result<Tensor> {
    args.get(i)?.as_tensor()
}

/// `my_py_add`.
pub(super) fn my_py_add(t1: &Tensor, t2: &Tensor) -> Result<Tensor> {
    Ok(t1.f_add(t2)?)
}

/// `_nested_python_udf` without the RPC: what it computes locally.
pub(super) fn nested_python_local(t1: &Tensor, t2: &Tensor) -> Result<Tensor> {
    let t3 = t1.f_mul(t2)?;
    let t4 = t1.f_add(t2)?;
    let res = t3.f_add(&t4)?;
    Ok(t1.f_mul(t2)?.f_mul(&t3)?.f_mul(&t4)?.f_mul(&res)?)
}

/// `_complex_python_udf`.
pub(super) fn complex_python_udf(t1: &Tensor, t2: &Tensor) -> Result<Tensor> {
    let t3 = t1.f_linear::<Tensor>(t2, None)?;
    let t4 = t2.f_linear::<Tensor>(&t3, None)?;
    let t5 = t3.f_linear::<Tensor>(&t4, None)?;
    Ok(Tensor::f_linalg_multi_dot(&[t1, t2, &t3, &t4, &t5])?)
}

/// `_mixed_requires_grad_operaton`.
pub(super) fn mixed_requires_grad(t1: &Tensor, t2: &Tensor) -> Result<Tensor> {
    if t2.requires_grad() {
        Ok(t1.f_sub(t2)?)
    } else {
        Ok(t1.f_mul(t2)?)
    }
}

fn python_udf_with_backward_error(agent: &RpcAgent, t1: &Tensor, t2: &Tensor) -> Result<Tensor> {
    let t3 = t1.f_add(t2)?;
    let t4 = simulate_backward_error(agent, &t3)?;
    Ok(Tensor::f_linalg_multi_dot(&[t1, t2, &t3, &t4])?)
}

async fn rpc_tensor(agent: &RpcAgent, to: String, f: &str, a: Args) -> Result<Tensor> {
    agent.rpc_sync(to, f, a).await?.as_tensor()
}

/// Registers everything the suite calls.
pub(crate) fn register(r: &FunctionRegistry) {
    crate_support::register_all(r);
    super::optim::register(r);
    r.register_native("seed::my_py_add", |_c, a| async move {
        Ok(my_py_add(&t(&a, 0)?, &t(&a, 1)?)?.into())
    });
    r.register_native("seed::my_script_add", |_c, a| async move {
        Ok(my_py_add(&t(&a, 0)?, &t(&a, 1)?)?.into())
    });
    r.register_native("seed::my_scalar_add", |_c, a| async move {
        Ok(Payload::from(a.get(0)?.as_int()? + a.get(1)?.as_int()?))
    });
    r.register_native("seed::_set_rpc_done", |c: CallContext, a| async move {
        let ctx_id = a.get(0)?;
        let ctx_id = if ctx_id.is_none() {
            -1
        } else {
            ctx_id.as_int()?
        };
        let d = usize::try_from(a.get(1)?.as_int()?).map_err(|_| Error::value("bad distance"))?;
        c.agent().state::<RpcDone>().set(ctx_id, d.min(3));
        Ok(Payload::none())
    });
    r.register_native("seed::ret_requires_grad", |c: CallContext, _a| async move {
        let g = c.agent().state::<RequiresGradTensor>();
        let t =
            g.0.lock()
                .unwrap_or_else(|p| p.into_inner())
                .shallow_clone();
        Ok(t.into())
    });
    r.register_native("seed::my_py_nested_call", |c: CallContext, a| async move {
        let (t1, t2) = (t(&a, 0)?, t(&a, 1)?);
        let dst = a.get(2)?.as_int()?;
        let ws = a.get(3)?.as_int()?;
        let hops = a.get(4)?.as_int()?;
        let next = (dst + 1) % ws;
        let to = worker_name(next as u32);
        if hops > 0 {
            let r = rpc_tensor(
                c.agent(),
                to,
                "seed::my_py_nested_call",
                args![t1, t2, next, ws, hops - 1],
            )
            .await?;
            Ok(r.into())
        } else {
            Ok(rpc_tensor(c.agent(), to, "seed::my_py_add", args![t1, t2])
                .await?
                .into())
        }
    });
    r.register_native("seed::_nested_python_udf", |c: CallContext, a| async move {
        let (t1, t2) = (t(&a, 0)?, t(&a, 1)?);
        let dst = a.get(2)?.as_int()?;
        let t3 = t1.f_mul(&t2)?;
        let t4 = t1.f_add(&t2)?;
        let res = rpc_tensor(
            c.agent(),
            worker_name(dst as u32),
            "seed::my_py_add",
            args![t3.shallow_clone(), t4.shallow_clone()],
        )
        .await?;
        Ok(t1.f_mul(&t2)?.f_mul(&t3)?.f_mul(&t4)?.f_mul(&res)?.into())
    });
    r.register_native("seed::_complex_python_udf", |_c, a| async move {
        Ok(complex_python_udf(&t(&a, 0)?, &t(&a, 1)?)?.into())
    });
    r.register_native("seed::_mixed_requires_grad_operaton", |_c, a| async move {
        Ok(mixed_requires_grad(&t(&a, 0)?, &t(&a, 1)?)?.into())
    });
    r.register_native(
        "seed::_python_udf_with_backward_error",
        |c: CallContext, a| async move {
            Ok(python_udf_with_backward_error(c.agent(), &t(&a, 0)?, &t(&a, 1)?)?.into())
        },
    );
    r.register_native(
        "seed::_nested_rpc_call_backward_error",
        |c: CallContext, a| async move {
            let (t1, t2) = (t(&a, 0)?, t(&a, 1)?);
            let dst = a.get(2)?.as_int()?;
            let t1 = t1.f_mul(&t2)?;
            let t2 = t1.f_add(&t2)?;
            let res = rpc_tensor(
                c.agent(),
                worker_name(dst as u32),
                "seed::_python_udf_with_backward_error",
                args![t1.shallow_clone(), t2.shallow_clone()],
            )
            .await?;
            Ok(Tensor::f_linalg_multi_dot(&[&t1, &t2, &res])?.into())
        },
    );
    r.register_native("seed::_torch_ones", |_c, a| async move {
        let rg = a
            .kwarg_value("requires_grad")
            .map(|v| v.as_bool())
            .transpose()?
            .unwrap_or(false);
        Ok(Tensor::ones([3, 3], (Kind::Float, Device::Cpu))
            .set_requires_grad(rg)
            .into())
    });
    r.register_native("seed::my_rref_add", |c: CallContext, a| async move {
        let v = a
            .get(0)?
            .as_rref()?
            .local_value(c.agent())
            .await?
            .as_tensor()?;
        Ok(v.f_add(&t(&a, 1)?)?.into())
    });
    r.register_native("seed::my_nested_rref_add", |c: CallContext, a| async move {
        let dst = a.get(0)?.as_str()?.to_string();
        let r = c
            .agent()
            .rpc_sync(dst, "seed::my_rref_add", args![a.get(1)?, t(&a, 2)?])
            .await?;
        Ok(r)
    });
    r.register_native(
        "seed::_compare_owner_value",
        |c: CallContext, a| async move {
            let ctx = a.get(0)?.as_int()?;
            let v = a
                .get(1)?
                .as_rref()?
                .local_value(c.agent())
                .await?
                .as_tensor()?;
            let want = t(&a, 2)?;
            let grads = dist_autograd::get_gradients(c.agent(), ctx)?;
            let got = grads
                .get(&v)
                .ok_or_else(|| Error::runtime("no gradient for the owner's value"))?;
            // Both sparse or both dense; sparse ones compare densified.
            if got.is_sparse() != want.is_sparse() {
                return Ok(Payload::from(false));
            }
            let dense = |x: &Tensor| {
                if x.is_sparse() {
                    x.to_dense(None, false)
                } else {
                    x.shallow_clone()
                }
            };
            Ok(Payload::from(dense(&got).equal(&dense(&want))))
        },
    );
    register_area_g(r);
    r.register_native(
        "seed::_set_simulate_error",
        |c: CallContext, a| async move {
            c.agent()
                .state::<SimulateError>()
                .0
                .store(a.get(0)?.as_bool()?, Ordering::Release);
            Ok(Payload::none())
        },
    );
}

/// The functions of the RRef / parameter-server tests (area G) and the
/// remote `EmbeddingBag` (area F).
fn register_area_g(r: &FunctionRegistry) {
    r.register_native("seed::create_tensor", |_c, _a| async move {
        Ok(Tensor::ones([3, 3], (Kind::Float, Device::Cpu))
            .set_requires_grad(true)
            .into())
    });
    r.register_native("seed::create_torchscript_tensor", |_c, _a| async move {
        Ok(Tensor::ones([3, 3], (Kind::Float, Device::Cpu))
            .set_requires_grad(true)
            .into())
    });
    r.register_native("seed::build_sparse_tensor", |_c, a| async move {
        // build_sparse_tensor(coalesce=False, requires_grad=True)
        let coalesce = a
            .param(0, "coalesce")
            .map(|p| p.as_bool())
            .unwrap_or(Ok(false))?;
        let rg = a
            .param(1, "requires_grad")
            .map(|p| p.as_bool())
            .unwrap_or(Ok(true))?;
        let s = build_sparse_tensor(false, Kind::Float);
        let s = if coalesce { s.coalesce() } else { s };
        Ok(s.set_requires_grad(rg).into())
    });
    r.register_native("seed::_check_rpc_done", |c: CallContext, a| async move {
        let d = usize::try_from(a.get(0)?.as_int()?).map_err(|_| Error::value("bad distance"))?;
        c.agent().state::<RpcDone>().wait(d.min(3)).await;
        Ok(Payload::none())
    });
    r.register_native("seed::my_script_ref_add", |c: CallContext, a| async move {
        let v = a
            .get(0)?
            .as_rref()?
            .to_here(c.agent(), None)
            .await?
            .as_tensor()?;
        Ok(v.f_add(&t(&a, 1)?)?.into())
    });
    r.register_native("seed::_run_trainer", |c: CallContext, a| async move {
        run_trainer(c.agent().clone(), a, "seed::my_rref_add").await
    });
    r.register_native(
        "seed::_run_trainer_torchscript",
        |c: CallContext, a| async move {
            run_trainer(c.agent().clone(), a, "seed::my_script_ref_add").await
        },
    );
    r.register_native("seed::DistAutogradTest._slow_add", |_c, a| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok(t(&a, 0)?.f_add(&t(&a, 1)?)?.set_requires_grad(true).into())
    });
    // `torch.nn.EmbeddingBag(16, 16, mode="sum", sparse=True)`: the module's
    // state is its weight, which the RRef holds.
    r.register_native("seed::EmbeddingBag", |_c, a| async move {
        let n = a.get(0)?.as_int()?;
        let d = a.get(1)?.as_int()?;
        Ok(Tensor::randn([n, d], (Kind::Float, Device::Cpu))
            .set_requires_grad(true)
            .into())
    });
    r.register_native(
        "seed::DistAutogradTest._call_remote_embedding",
        |c: CallContext, a| async move {
            let weight = a
                .get(0)?
                .as_rref()?
                .local_value(c.agent())
                .await?
                .as_tensor()?;
            Ok(embedding_bag_sum(&weight, &t(&a, 1)?, &t(&a, 2)?, &t(&a, 3)?)?.into())
        },
    );
    r.register_native(
        "seed::DistAutogradTest._get_grad",
        |c: CallContext, a| async move {
            let weight = a
                .get(0)?
                .as_rref()?
                .local_value(c.agent())
                .await?
                .as_tensor()?;
            let grads = dist_autograd::get_gradients(c.agent(), a.get(1)?.as_int()?)?;
            Ok(grads
                .get(&weight)
                .ok_or_else(|| Error::runtime("no gradient for the embedding's weight"))?
                .into())
        },
    );
}

/// `EmbeddingBag(mode="sum", sparse=True)(input, offsets, per_sample_weights)`.
pub(super) fn embedding_bag_sum(
    weight: &Tensor,
    input: &Tensor,
    offsets: &Tensor,
    per_sample_weights: &Tensor,
) -> Result<Tensor> {
    Ok(Tensor::f_embedding_bag(
        weight,
        input,
        offsets,
        false,
        0,
        true,
        Some(per_sample_weights),
        false,
    )?
    .0)
}

/// `_run_trainer(rref_t1, t2, ps, rank_diff, sparse)` (and its TorchScript
/// twin, with `add` naming the function the trainer calls on the PS).
async fn run_trainer(agent: RpcAgent, a: Args, add: &'static str) -> Result<Payload> {
    let rref_t1 = a.get(0)?;
    let t2 = t(&a, 1)?;
    let ps = a.get(2)?.as_str()?.to_string();
    let rank_diff = a.get(3)?.as_int()?;
    let ag = agent.clone();
    dist_autograd::context(&agent, |ctx| async move {
        let agent = ag;
        let ret = agent
            .rpc_sync(ps.as_str(), add, args![rref_t1, t2])
            .await?
            .as_tensor()?;
        dist_autograd::backward(&agent, ctx, &[loss_of(&ret)], false).await?;
        // Holds the context until the PS has checked it.
        agent
            .rpc_sync(ps.as_str(), "seed::_set_rpc_done", args![ctx, rank_diff])
            .await?;
        agent
            .rpc_sync(ps.as_str(), "seed::_check_rpc_done", args![0i64])
            .await?;
        Ok::<_, Error>(())
    })
    .await??;
    Ok(Payload::none())
}

use wasmrpc_tests as crate_support;

/// A 4-worker cluster with the suite's functions.
pub(super) fn cluster() -> ClusterBuilder {
    Cluster::builder(crate_support::WORLD_SIZE).functions(register)
}

/// The seeds' `build_sparse_tensor(coalesce=False, requires_grad=True, dtype)`.
pub(super) fn build_sparse_tensor(requires_grad: bool, kind: Kind) -> Tensor {
    let i = Tensor::from_slice2(&[[0i64, 1, 1], [2, 0, 2]]);
    let v = Tensor::from_slice(&[3.2f32, 4.1, 5.3]).to_kind(kind);
    Tensor::sparse_coo_tensor_indices_size(&i, &v, [3, 3], (kind, Device::Cpu), false)
        .set_requires_grad(requires_grad)
}

/// `x.sum()`, or `torch.sparse.sum(x)` for a sparse tensor.
pub(super) fn loss_of(x: &Tensor) -> Tensor {
    if x.is_sparse() {
        x.internal_sparse_sum()
    } else {
        x.sum(None)
    }
}

/// Compares two tensors as `assertEqual` does (dense or sparse).
pub(super) fn close(a: &Tensor, b: &Tensor) -> bool {
    let a = if a.is_sparse() {
        a.to_dense(None, false)
    } else {
        a.shallow_clone()
    };
    let b = if b.is_sparse() {
        b.to_dense(None, false)
    } else {
        b.shallow_clone()
    };
    a.size() == b.size()
        && a.to_kind(Kind::Double)
            .allclose(&b.to_kind(Kind::Double), 1.3e-6, 1e-5, false)
}

/// `_all_contexts_cleaned_up`: every context id this worker heard of is
/// gone within 10 s.
pub(super) async fn all_contexts_cleaned_up(agent: &RpcAgent) -> bool {
    let ids = agent.state::<RpcDone>().known();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if ids
            .iter()
            .all(|id| dist_autograd::retrieve_context(agent, *id).is_err())
        {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
