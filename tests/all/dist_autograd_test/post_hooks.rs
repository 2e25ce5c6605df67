//! `dist_autograd_test.py`'s `test_post_hooks`: post hooks on the
//! `AccumulateGrad` nodes of `a = t + t` ([`Node::register_hook`]) run
//! once each when a distributed backward computes `t`'s gradient.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context as _, ensure};
use tch::{Device, Kind, Tensor};
use wasmrpc::dist_autograd::{self, Node, PostHookHandle};
use wasmrpc_tests::dist_with;

use super::fns::cluster;

/// A post hook that adds `n` to `calls` (the seed's `post_hook_add_one`,
/// `post_hook_add_two`).
fn add(node: &Node, calls: &Arc<AtomicUsize>, n: usize) -> wasmrpc::Result<PostHookHandle> {
    let calls = calls.clone();
    node.register_hook(move |_output_grads, _input_grads| {
        calls.fetch_add(n, Ordering::SeqCst);
        Ok(())
    })
}

#[test]
fn test_post_hooks() {
    dist_with(cluster(), |w| async move {
        let hook_called_times = Arc::new(AtomicUsize::new(0));
        let t = Tensor::rand([10, 10], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let a = &t + &t;
        let next = Node::grad_fn(&a)
            .context("a has no grad_fn")?
            .next_functions();
        let accumulate_grad_0 = next[0].0.clone().context("no next function 0")?;
        let accumulate_grad_1 = next[1].0.clone().context("no next function 1")?;
        let _hooks = [
            add(&accumulate_grad_0, &hook_called_times, 1)?,
            add(&accumulate_grad_0, &hook_called_times, 2)?,
            add(&accumulate_grad_1, &hook_called_times, 2)?,
        ];
        let agent = w.agent.clone();
        let (t2, calls) = (t.shallow_clone(), hook_called_times.clone());
        dist_autograd::context(&w.agent, |ctx| async move {
            let loss = a.sum(None);
            dist_autograd::backward(&agent, ctx, &[loss], false).await?;
            let n = calls.load(Ordering::SeqCst);
            ensure!(n == 5, "hook_called_times {n}");
            let grads = dist_autograd::get_gradients(&agent, ctx)?;
            ensure!(grads.len() == 1, "{grads:?}");
            ensure!(grads.contains(&t2), "t has no gradient");
            anyhow::Ok(())
        })
        .await??;
        Ok(())
    });
}
