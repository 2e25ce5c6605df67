//! `rpc_test` area N: distributed autograd through RRefs
//! (`RRef.backward`). The parameter-server test is in the skip notes of
//! the report: it needs `@async_execution` static methods of a class held
//! in an RRef.

use anyhow::ensure;
use tch::{Device, Kind, Tensor};
use wasmrpc::autograd::{self, RREF_BACKWARD_NOT_TENSOR};
use wasmrpc::testing::{Cluster, ClusterBuilder, Worker};
use wasmrpc::{Args, ErrorKind, FunctionRegistry, Payload, RRef, args};
use wasmrpc_tests::{dist_with, expect_err, register_all};

const ADD: &str = "aten::add";

/// The suite's functions plus `RpcTest._sum` and `RpcTest._identity`.
fn cluster() -> ClusterBuilder {
    Cluster::builder(wasmrpc_tests::WORLD_SIZE).functions(|r: &FunctionRegistry| {
        register_all(r);
        r.register_native("seed::RpcTest._sum", |_c, a: Args| async move {
            Ok(a.get(0)?.as_tensor()?.f_sum(None)?.into())
        });
        r.register_native(
            "seed::RpcTest._identity",
            |_c, a: Args| async move { a.get(0) },
        );
    })
}

fn rand_rg(size: &[i64]) -> Tensor {
    Tensor::rand(size, (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

#[test]
fn test_owner_rref_backward() {
    dist_with(cluster(), |w: Worker| async move {
        let a = w.agent.clone();
        let dst = w.dst();
        let t1 = rand_rg(&[10, 10]);
        let rref = RRef::new(&a, t1.sum(None) + t1.sum(None));
        rref.backward(&a, None, false).await?;
        let expected_grad = t1.ones_like() * 2;
        ensure!(t1.grad().equal(&expected_grad), "local backward");

        let a2 = a.clone();
        let (t, d) = (t1.shallow_clone(), dst.clone());
        autograd::context(&a, |ctx| async move {
            let a = a2;
            let t2 = a
                .rpc_sync(d, ADD, args![t.shallow_clone(), t.shallow_clone()])
                .await?
                .as_tensor()?;
            let rref = RRef::new(&a, t2.sum(None));
            rref.backward(&a, Some(ctx), false).await?;
            let g = autograd::get_gradients(&a, ctx)?;
            ensure!(g.get(&t).is_some_and(|g| g.equal(&(t.ones_like() * 2))));
            anyhow::Ok(())
        })
        .await??;

        let a2 = a.clone();
        let t = t1.shallow_clone();
        autograd::context(&a, |ctx| async move {
            let a = a2;
            let t2 = a
                .rpc_sync(dst, ADD, args![t.shallow_clone(), t.shallow_clone()])
                .await?
                .as_tensor()?;
            let rref = RRef::new(&a, t2.sum(None));
            rref.backward(&a, Some(ctx), true).await?;
            rref.backward(&a, Some(ctx), false).await?;
            let g = autograd::get_gradients(&a, ctx)?;
            ensure!(g.get(&t).is_some_and(|g| g.equal(&(t.ones_like() * 4))));
            anyhow::Ok(())
        })
        .await??;

        let r = RRef::new(&a, Tensor::rand([10], (Kind::Float, Device::Cpu)));
        expect_err(
            r.backward(&a, None, false).await,
            ErrorKind::RuntimeError,
            "tensors does not require grad and does not have a grad_fn",
        )?;
        let r = RRef::new(&a, rand_rg(&[10]));
        expect_err(
            r.backward(&a, None, false).await,
            ErrorKind::RuntimeError,
            "grad can be implicitly created only for scalar outputs",
        )?;
        let r = RRef::new(&a, rand_rg(&[10]).sum(None));
        expect_err(
            r.backward(&a, Some(100), false).await,
            ErrorKind::RuntimeError,
            "Could not find autograd context with id: 100",
        )?;
        let r = RRef::new(&a, Payload::from("foo"));
        expect_err(
            r.backward(&a, None, false).await,
            ErrorKind::RuntimeError,
            RREF_BACKWARD_NOT_TENSOR,
        )?;
        Ok(())
    });
}

#[test]
fn test_user_rref_backward() {
    dist_with(cluster(), |w: Worker| async move {
        let a = w.agent.clone();
        let dst = w.dst();
        let t = rand_rg(&[10]);
        let a2 = a.clone();
        let (t_, d) = (t.shallow_clone(), dst.clone());
        autograd::context(&a, |ctx| async move {
            let a = a2;
            let rref = a.remote(d, "seed::RpcTest._sum", args![t_.shallow_clone()])?;
            rref.backward(&a, Some(ctx), true).await?;
            rref.backward(&a, Some(ctx), false).await?;
            let g = autograd::get_gradients(&a, ctx)?;
            ensure!(g.get(&t_).is_some_and(|g| g.equal(&(t_.ones_like() * 2))));
            anyhow::Ok(())
        })
        .await??;

        let a2 = a.clone();
        autograd::context(&a, |ctx| async move {
            let a = a2;
            let rref = a.remote(dst, "seed::RpcTest._identity", args!["foo"])?;
            expect_err(
                rref.backward(&a, Some(ctx), false).await,
                ErrorKind::RuntimeError,
                RREF_BACKWARD_NOT_TENSOR,
            )?;
            expect_err(
                rref.backward(&a, None, false).await,
                ErrorKind::RuntimeError,
                "User RRefs require 'dist_autograd_ctx_id' to be specified",
            )?;
            anyhow::Ok(())
        })
        .await??;
        Ok(())
    });
}
