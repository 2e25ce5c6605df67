//! `dist_autograd_test.py`'s checks of when a context keeps a leaf's
//! gradient buffer as the backward produced it (stolen, the same
//! `data_ptr`) and when it copies it: `test_no_grad_copy` and
//! `test_grad_copy_sparse_indices_extra_ref`. The seeds' custom
//! `autograd.Function`s are [`dist_autograd::apply_function`]s whose
//! backward records the gradient's `data_ptr` (the seeds' `static_grad_ptr`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, ensure};
use tch::{Device, Kind, Tensor};
use wasmrpc::{RpcAgent, dist_autograd};
use wasmrpc_tests::dist_with;

use super::fns::cluster;

/// Where a recorded `data_ptr` lives (the seeds' `static_grad_ptr`).
type Ptr = Arc<AtomicUsize>;

fn ptr_of(t: &Tensor) -> usize {
    t.data_ptr() as usize
}

/// The seed's `MyFunc`: `inp1 + inp2`; its backward records the gradient's
/// `data_ptr` and returns the gradient for both inputs.
fn my_func(agent: &RpcAgent, a: &Tensor, b: &Tensor, ptr: &Ptr) -> anyhow::Result<Tensor> {
    let ptr = ptr.clone();
    let out = dist_autograd::apply_function(
        agent,
        &[a.shallow_clone(), b.shallow_clone()],
        |x| Ok(vec![&x[0] + &x[1]]),
        move |g| {
            let g = g[0].as_ref().map(Tensor::shallow_clone);
            if let Some(g) = &g {
                ptr.store(ptr_of(g), Ordering::SeqCst);
            }
            Ok(vec![g.as_ref().map(Tensor::shallow_clone), g])
        },
    )?;
    out.into_iter().next().context("MyFunc returned no output")
}

/// The seed's `MyFuncSingleGrad`: the identity; its backward records the
/// gradient's `data_ptr` and returns it.
fn my_func_single_grad(agent: &RpcAgent, a: &Tensor, ptr: &Ptr) -> anyhow::Result<Tensor> {
    let ptr = ptr.clone();
    let out = dist_autograd::apply_function(
        agent,
        &[a.shallow_clone()],
        |x| Ok(vec![x[0].shallow_clone()]),
        move |g| {
            if let Some(g) = &g[0] {
                ptr.store(ptr_of(g), Ordering::SeqCst);
            }
            Ok(vec![g[0].as_ref().map(Tensor::shallow_clone)])
        },
    )?;
    out.into_iter()
        .next()
        .context("MyFuncSingleGrad returned no output")
}

/// The seed's `NonContGradFunc`: `tensor([1.])`; its backward returns
/// `ones(1).expand(size)`, a gradient that is not contiguous.
fn non_cont_grad_func(agent: &RpcAgent, inp: &Tensor) -> anyhow::Result<Tensor> {
    let size = inp.size();
    let out = dist_autograd::apply_function(
        agent,
        &[inp.shallow_clone()],
        |_| Ok(vec![Tensor::from_slice(&[1f32])]),
        move |_| {
            let g = Tensor::ones([1], (Kind::Float, Device::Cpu)).expand(size.as_slice(), false);
            Ok(vec![Some(g)])
        },
    )?;
    out.into_iter()
        .next()
        .context("NonContGradFunc returned no output")
}

fn grad_of(agent: &RpcAgent, ctx: i64, t: &Tensor) -> anyhow::Result<Tensor> {
    dist_autograd::get_gradients(agent, ctx)?
        .get(t)
        .context("no gradient for the tensor")
}

#[test]
fn test_no_grad_copy() {
    dist_with(cluster(), |w| async move {
        let agent = w.agent.clone();
        let randn = || Tensor::randn([5, 6], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (a, b) = (randn(), randn());
        let my_func_ptr: Ptr = Arc::default();
        let single_ptr: Ptr = Arc::default();

        // A non-contiguous gradient, given to both inputs: copied for each.
        let (ag, a2, b2, p) = (
            agent.clone(),
            a.shallow_clone(),
            b.shallow_clone(),
            my_func_ptr.clone(),
        );
        dist_autograd::context(&agent, |ctx| async move {
            let root = non_cont_grad_func(&ag, &my_func(&ag, &a2, &b2, &p)?)?;
            dist_autograd::backward(&ag, ctx, &[root], false).await?;
            let static_ptr = p.load(Ordering::SeqCst);
            ensure!(static_ptr != 0, "MyFunc's backward did not run");
            ensure!(
                ptr_of(&grad_of(&ag, ctx, &a2)?) != static_ptr,
                "a's gradient was not copied"
            );
            ensure!(
                ptr_of(&grad_of(&ag, ctx, &b2)?) != static_ptr,
                "b's gradient was not copied"
            );
            anyhow::Ok(())
        })
        .await??;

        // A contiguous gradient for one input only: stolen, no copy.
        let (ag, a2, p) = (agent.clone(), a.shallow_clone(), single_ptr.clone());
        dist_autograd::context(&agent, |ctx| async move {
            let root = my_func_single_grad(&ag, &a2, &p)?.get(1).get(0);
            dist_autograd::backward(&ag, ctx, &[root], false).await?;
            let p_g = p.load(Ordering::SeqCst);
            let p_a = ptr_of(&grad_of(&ag, ctx, &a2)?);
            ensure!(p_a == p_g, "a's gradient was copied: {p_a:#x} vs {p_g:#x}");
            anyhow::Ok(())
        })
        .await??;

        // One gradient for two inputs: each gets a copy of its own.
        let (ag, a2, b2, p) = (
            agent.clone(),
            a.shallow_clone(),
            b.shallow_clone(),
            my_func_ptr.clone(),
        );
        dist_autograd::context(&agent, |ctx| async move {
            let root = my_func(&ag, &a2, &b2, &p)?.get(1).get(0);
            dist_autograd::backward(&ag, ctx, &[root], false).await?;
            let p_g = p.load(Ordering::SeqCst);
            let p_a = ptr_of(&grad_of(&ag, ctx, &a2)?);
            let p_b = ptr_of(&grad_of(&ag, ctx, &b2)?);
            ensure!(p_a != p_b, "a and b share a gradient buffer");
            ensure!(p_a != p_g, "a's gradient was not copied");
            ensure!(p_b != p_g, "b's gradient was not copied");
            anyhow::Ok(())
        })
        .await??;
        Ok(())
    });
}

#[test]
fn test_grad_copy_sparse_indices_extra_ref() {
    dist_with(cluster(), |w| async move {
        let agent = w.agent.clone();
        let a = Tensor::randn([10, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let input = Tensor::from_slice(&[1i64, 2, 4, 5, 4, 3, 2, 9]);
        let offsets = Tensor::from_slice(&[0i64, 4]);
        let static_ptr: Ptr = Arc::default();
        // The seed's `static_grad_indices_ref` and `static_grad_values_ref`:
        // views of the gradient's indices and values, kept past backward.
        let refs: Arc<Mutex<Option<(Tensor, Tensor)>>> = Arc::default();
        let (ag, a2) = (agent.clone(), a.shallow_clone());
        dist_autograd::context(&agent, |ctx| async move {
            let (p, r) = (static_ptr.clone(), refs.clone());
            let emb_matrix = dist_autograd::apply_function(
                &ag,
                &[a2.shallow_clone()],
                |x| Ok(vec![x[0].shallow_clone()]),
                move |g| {
                    if let Some(g) = &g[0] {
                        p.store(ptr_of(&g.internal_values()), Ordering::SeqCst);
                        *r.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((g.internal_indices(), g.internal_values()));
                    }
                    Ok(vec![g[0].as_ref().map(Tensor::shallow_clone)])
                },
            )?
            .into_iter()
            .next()
            .context("MyFunc returned no output")?;
            let loss = Tensor::f_embedding_bag(
                &emb_matrix,
                &input,
                &offsets,
                false,
                0,
                true,
                None::<Tensor>,
                false,
            )?
            .0
            .sum(None);
            dist_autograd::backward(&ag, ctx, &[loss], true).await?;
            let p_g = static_ptr.load(Ordering::SeqCst);
            let grad = grad_of(&ag, ctx, &a2)?;
            ensure!(grad.is_sparse(), "a's gradient is dense");
            let p_a = ptr_of(&grad.internal_values());
            let kept = refs.lock().unwrap_or_else(|e| e.into_inner());
            ensure!(kept.is_some(), "MyFunc's backward kept no views");
            // The views do not hold the gradient: it is stolen.
            ensure!(p_g == p_a, "a's gradient was copied: {p_a:#x} vs {p_g:#x}");
            anyhow::Ok(())
        })
        .await??;
        Ok(())
    });
}
