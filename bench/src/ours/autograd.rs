//! One distributed autograd step as the bench measures it, and where its
//! time went (forward call, local sum, backward pass).

use std::time::{Duration, Instant};

use tch::Tensor;
use wasmrpc::{Payload, RpcAgent, args};

use crate::stats::Stat;

/// Where one distributed autograd step's time went, as its row's note:
/// the remote matmul (the forward call), the local sum, and the backward
/// pass across both workers. A profile of the step starts here.
pub(super) struct StepPhases {
    forward: Duration,
    loss: Duration,
    backward: Duration,
}

impl StepPhases {
    /// The median of each phase over `steps`.
    pub(super) fn medians(steps: &[StepPhases]) -> String {
        let median = |phase: fn(&StepPhases) -> Duration| {
            let samples: Vec<Duration> = steps.iter().map(phase).collect();
            crate::report::fmt_micros(Stat::latencies(&samples).median)
        };
        format!(
            "(phase medians: remote matmul {}, local sum {}, backward {})",
            median(|p| p.forward),
            median(|p| p.loss),
            median(|p| p.backward)
        )
    }
}

/// One step as the torch side does it: in a fresh context, a remote matmul,
/// a local sum, backward across both workers, and the context's gradients
/// (both leaves must have one). Its phases go to `phases`.
pub(super) async fn autograd_step(
    agent: &RpcAgent,
    dst: &str,
    a: &Tensor,
    b: &Tensor,
    phases: &std::cell::RefCell<Vec<StepPhases>>,
) -> wasmrpc::Result<Payload> {
    let (a, b) = (a.shallow_clone(), b.shallow_clone());
    wasmrpc::dist_autograd::context(agent, |ctx| async move {
        let started = Instant::now();
        let product = agent
            .rpc_sync(
                dst,
                "aten::matmul",
                args![a.shallow_clone(), b.shallow_clone()],
            )
            .await?
            .as_tensor()?;
        let returned = Instant::now();
        let loss = product.sum(None);
        let summed = Instant::now();
        wasmrpc::dist_autograd::backward(agent, ctx, &[loss], false).await?;
        phases.borrow_mut().push(StepPhases {
            forward: returned - started,
            loss: summed - returned,
            backward: summed.elapsed(),
        });
        let grads = wasmrpc::dist_autograd::get_gradients(agent, ctx)?;
        if !(grads.contains(&a) && grads.contains(&b)) {
            return Err(wasmrpc::Error::runtime(format!(
                "context {ctx} has gradients for {} of the 2 leaves",
                grads.len()
            )));
        }
        Ok(Payload::none())
    })
    .await?
}
