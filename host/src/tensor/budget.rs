//! Tensor memory budgets of a worker: how much CPU tensor memory the work a
//! worker does for its peers and its plugins may hold, in all and per call.
//!
//! What this module owns: [`TensorMemoryBudget`] (the limits, as
//! [`RpcBackendOptions`](crate::RpcBackendOptions) and the `wasmrpc`
//! command's `--tensor-memory` flags set them, with defaults sized to the
//! machine), [`WorkerBudget`] (a worker's budget and the per-call budgets
//! made under it), and the errors a refusal becomes. Charging and refusing
//! allocations is `wasmrpc_torch_sys::MemoryBudget`'s.
//!
//! What is charged (BUDGET-1): every CPU tensor allocation libtorch makes
//! while a worker runs a builtin op for a peer (RRef proxies' tensor
//! methods included) or for one of its plugins,
//! while a plugin creates a tensor from its own bytes, and while a frame's
//! tensors are received from a peer. The worker's budget holds until the
//! memory is freed, so tensors a peer keeps alive on the worker (in RRefs,
//! plugin globals, distributed autograd contexts) keep counting; a call's
//! budget bounds what one call holds at once.
//!
//! Refusals are errors of the call that asked, never of the worker
//! (BUDGET-2): the op or the frame fails with a `RuntimeError` "worker1:
//! tensor memory budget of N bytes exceeded by aten::zeros (asked M bytes)"
//! and the worker serves on.
//!
//! Not charged: tensors the worker's own Rust code creates outside those
//! paths (native functions its operator registered, the distributed autograd
//! engine, the optimizer), CUDA memory, and wasm memories (each plugin
//! instance has its own `max_memory`).

use std::sync::Arc;

use wasmrpc_torch_sys::{BudgetRefusal, MemoryBudget};

use crate::error::Error;

/// A worker's tensor memory limits, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMemoryBudget {
    /// What all the worker's charged tensors may hold at once.
    pub per_worker: u64,
    /// What one call (a builtin op a peer asked for, a plugin function
    /// with every op it runs, a received message) may hold at once.
    pub per_call: u64,
}

impl Default for TensorMemoryBudget {
    /// Half of the machine's memory for the worker (see [`machine_memory`])
    /// and a quarter for one call.
    fn default() -> Self {
        TensorMemoryBudget::for_memory(machine_memory())
    }
}

impl TensorMemoryBudget {
    /// The default limits for a worker that may use `memory` bytes: half
    /// for the worker, a quarter for one call. A launcher running `n`
    /// workers on one machine gives each `machine_memory() / n`.
    pub fn for_memory(memory: u64) -> TensorMemoryBudget {
        TensorMemoryBudget {
            per_worker: memory / 2,
            per_call: memory / 4,
        }
    }
}

/// The memory this process may use: the machine's physical memory, or the
/// cgroup's limit when the process runs in a smaller container (Kubernetes,
/// Docker). 8 GiB when neither can be read.
pub fn machine_memory() -> u64 {
    const FALLBACK: u64 = 8 << 30;
    let physical = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        });
    // cgroup v2, then v1; "max" (v2) or a huge number (v1) mean no limit.
    let cgroup = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|path| {
        std::fs::read_to_string(path)
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    });
    match (physical, cgroup) {
        (Some(p), Some(c)) => p.min(c),
        (Some(p), None) => p,
        (None, Some(c)) => c,
        (None, None) => FALLBACK,
    }
}

/// Parses a byte count as the `wasmrpc` command takes it: `1073741824`,
/// `512MiB`, `4GiB`, `1.5G`, `100M`, `64KiB` (K, M, G and T are powers of
/// 1024, with or without `iB`/`B`).
///
/// # Errors
/// A text that is not such a count, or one over `u64::MAX` bytes.
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB or TiB)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a number of bytes (e.g. 4GiB, 512MiB, 1048576)"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !(0.0..=u64::MAX as f64).contains(&bytes) {
        return Err(format!("{text:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// A worker's budget and the limit of each call's budget under it.
#[derive(Clone, Debug)]
pub(crate) struct WorkerBudget {
    worker: Arc<str>,
    budget: MemoryBudget,
    per_call: u64,
}

impl WorkerBudget {
    /// The budget of worker `worker` with `limits`.
    pub(crate) fn new(worker: &str, limits: TensorMemoryBudget) -> WorkerBudget {
        WorkerBudget {
            worker: worker.into(),
            budget: MemoryBudget::new(limits.per_worker),
            per_call: limits.per_call.min(limits.per_worker),
        }
    }

    /// The worker-wide budget (for received frames).
    pub(crate) fn worker(&self) -> &MemoryBudget {
        &self.budget
    }

    /// The most bytes one call's tensors may hold.
    pub(crate) fn per_call(&self) -> u64 {
        self.per_call
    }

    /// A fresh budget for one call, charged to the worker's as well.
    pub(crate) fn call(&self) -> CallBudget {
        CallBudget {
            worker: self.worker.clone(),
            budget: self.budget.child(self.per_call),
        }
    }
}

/// The budget of one call on a worker.
#[derive(Clone, Debug)]
pub(crate) struct CallBudget {
    worker: Arc<str>,
    budget: MemoryBudget,
}

impl CallBudget {
    /// Runs `f` (synchronous tensor work for `what`, e.g. `aten::zeros`) in
    /// this call's budget; the error is set when an allocation inside it
    /// was refused (BUDGET-2), and then replaces whatever error `f` gave.
    pub(crate) fn run<R>(&self, what: &str, f: impl FnOnce() -> R) -> (R, Option<Error>) {
        let (out, refusal) = self.budget.run(f);
        (
            out,
            refusal.map(|r| refusal_error(&self.worker, what, r, true)),
        )
    }
}

/// The error for `refusal` of work `what` on `worker`; `under_call`: the
/// work ran in a call's budget (depth 0) under the worker's (depth 1).
pub(crate) fn refusal_error(
    worker: &str,
    what: &str,
    refusal: BudgetRefusal,
    under_call: bool,
) -> Error {
    let which = if under_call && refusal.depth == 0 {
        "per-call tensor memory budget"
    } else {
        "tensor memory budget"
    };
    Error::runtime(format!(
        "{worker}: {which} of {} bytes exceeded by {what} (asked {} bytes)",
        refusal.limit, refusal.asked
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn byte_counts_parse_with_binary_units() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("1.5G"), Ok(3 << 29));
        assert_eq!(parse_bytes("64 kb"), Ok(64 << 10));
        assert!(parse_bytes("lots").is_err());
        assert!(
            parse_bytes("4 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(
            parse_bytes("99999999999T")
                .unwrap_err()
                .contains("out of range")
        );
    }

    #[test]
    fn defaults_follow_the_machine() {
        let memory = machine_memory();
        assert!(memory >= 256 << 20, "{memory}");
        let d = TensorMemoryBudget::default();
        assert_eq!(d, TensorMemoryBudget::for_memory(memory));
        assert!(d.per_call <= d.per_worker);
    }

    #[test]
    fn refusals_name_the_worker_the_work_and_the_budget() {
        let worker = WorkerBudget::new(
            "worker1",
            TensorMemoryBudget {
                per_worker: 8 << 20,
                per_call: 2 << 20,
            },
        );
        let call = worker.call();
        let (r, e) = call.run("aten::zeros", || {
            Tensor::f_zeros([1 << 20], (Kind::Float, Device::Cpu))
        });
        assert!(r.is_err());
        assert_eq!(
            e.expect("refused").to_string(),
            "RuntimeError: worker1: per-call tensor memory budget of 2097152 bytes exceeded by \
             aten::zeros (asked 4194304 bytes)"
        );
        // Two calls within their own limits add up to more than the worker's.
        let held: Vec<Tensor> = (0..4)
            .map(|_| {
                let (t, e) = worker.call().run("aten::ones", || {
                    Tensor::ones([1 << 19], (Kind::Float, Device::Cpu))
                });
                assert!(e.is_none());
                t
            })
            .collect();
        let (_, e) = worker.call().run("aten::ones", || {
            Tensor::f_ones([1 << 10], (Kind::Float, Device::Cpu))
        });
        assert_eq!(
            e.expect("the worker is full").to_string(),
            "RuntimeError: worker1: tensor memory budget of 8388608 bytes exceeded by aten::ones \
             (asked 4096 bytes)"
        );
        drop(held);
        assert_eq!(worker.worker().used(), 0);
    }
}
