//! A guest's tensors: the ops it runs on them, and their dtypes and bytes
//! as the guest SDK sees them.

use std::time::Instant;

use tch::{Device, Kind, Tensor};
use wasmrpc_torch_sys::{
    OpError, call_method_gated, call_op_gated, op_value_from_abi, op_value_into_abi,
};
use wasmrpc_wasm::{CallArgs, DType, ErrorKind, HostResult, RemoteError, TensorMeta, Value};

use super::super::grant::PluginGate;
use super::{GuestCall, remote, tch_error};
use crate::ops::{in_budget, run_blocking};

impl GuestCall {
    /// A tensor op a guest names, under the worker's op policy and the
    /// plugin's grant, in the call's budget, recorded in a profiling scope.
    pub(super) async fn run_op(&self, name: &str, args: CallArgs) -> HostResult<Value> {
        let (positional, kwargs) = {
            let handles = self.handles();
            let mut lookup = |h: u32| handles.tensor(h).ok();
            let positional = args
                .args
                .iter()
                .map(|v| op_value_from_abi(v, &mut lookup))
                .collect::<Result<Vec<_>, _>>()?;
            let kwargs = args
                .kwargs
                .iter()
                .map(|(k, v)| Ok((k.clone(), op_value_from_abi(v, &mut lookup)?)))
                .collect::<Result<Vec<_>, OpError>>()?;
            (positional, kwargs)
        };
        let name = name.to_owned();
        let grad_enabled = self.autograd.grad_enabled();
        let recording = self.recording();
        let options = recording.as_ref().map(|r| r.config().record_options());
        let budget = self.budget.clone();
        let policy = self.agent.options().op_policy.clone();
        let worker = self.agent.name().to_owned();
        let grant = self.grant.clone();
        // OPS-1: a cheap op runs in place, any other on the blocking pool.
        // A bare name is a tensor method, the op of the same name.
        let cheap = if name.contains("::") || name.contains('.') {
            crate::ops::is_cheap(&name, &positional, &kwargs)
        } else {
            crate::ops::is_cheap(&format!("aten::{name}"), &positional, &kwargs)
        };
        let work = move || {
            // In place or on the pool, with the process's op thread count.
            crate::ops::adopt_intra_op_threads();
            // Grad mode is per thread: set it where the op runs.
            let _no_grad = (!grad_enabled).then(tch::no_grad_guard);
            // POL-1, GR-1: the worker's op policy, then the plugin's
            // grant, admit every op a guest names.
            let gate = PluginGate {
                policy: &policy,
                worker: &worker,
                grant: &grant,
            };
            // A bare name is a tensor method (`view`, `size`), as Python
            // calls it on a tensor.
            let run = || {
                in_budget(Some(&budget), &name, || {
                    if name.contains("::") || name.contains('.') {
                        call_op_gated(&name, &positional, &kwargs, &gate)
                    } else {
                        call_method_gated(&name, &positional, &kwargs, &gate)
                    }
                })
            };
            // In a profiling scope: every aten op libtorch runs for it,
            // nested ones included, as PyTorch's profiler lists them.
            let (out, ops) = crate::ops::profiled(options, run);
            (
                out,
                ops.map(|(start, ops)| (name, start, Instant::now(), ops)),
            )
        };
        let (outputs, ops) = if cheap {
            work()
        } else {
            run_blocking(work).await.map_err(remote)?
        };
        if let (Some(r), Some((name, start, end, ops))) = (recording, ops) {
            if ops.is_empty() {
                // Nothing went through the dispatcher (a Python builtin).
                r.add(name, start, end);
            }
            r.add_ops(ops, start);
        }
        let outputs = outputs.map_err(remote)?;
        let value = wasmrpc_torch_sys::OpValue::from_outputs(outputs);
        let mut handles = self.handles();
        Ok(op_value_into_abi(value, &mut |t| handles.insert_tensor(t)))
    }
}

pub(super) fn dtype_kind(dtype: DType) -> Kind {
    match dtype {
        DType::Float32 => Kind::Float,
        DType::Float64 => Kind::Double,
        DType::Float16 => Kind::Half,
        DType::BFloat16 => Kind::BFloat16,
        DType::Int64 => Kind::Int64,
        DType::Int32 => Kind::Int,
        DType::Int16 => Kind::Int16,
        DType::Int8 => Kind::Int8,
        DType::UInt8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
    }
}

fn kind_dtype(kind: Kind) -> HostResult<DType> {
    Ok(match kind {
        Kind::Float => DType::Float32,
        Kind::Double => DType::Float64,
        Kind::Half => DType::Float16,
        Kind::BFloat16 => DType::BFloat16,
        Kind::Int64 => DType::Int64,
        Kind::Int => DType::Int32,
        Kind::Int16 => DType::Int16,
        Kind::Int8 => DType::Int8,
        Kind::Uint8 => DType::UInt8,
        Kind::Bool => DType::Bool,
        other => {
            return Err(RemoteError::new(
                ErrorKind::TypeError,
                format!("plugins cannot read tensors of dtype {other:?}"),
            ));
        }
    })
}

pub(super) fn meta(t: &Tensor) -> HostResult<TensorMeta> {
    Ok(TensorMeta {
        dtype: kind_dtype(t.f_kind().map_err(tch_error)?)?,
        shape: t.size(),
        requires_grad: t.requires_grad(),
    })
}

/// A tensor's elements: dense, on the CPU, contiguous, little-endian.
pub(super) fn elements(t: &Tensor, dtype: DType) -> Result<Vec<u8>, tch::TchError> {
    let dense = if t.is_sparse() {
        t.f_to_dense(None, false)?
    } else {
        t.shallow_clone()
    };
    let cpu = if dense.device() == Device::Cpu {
        dense
    } else {
        dense.f_to_device(Device::Cpu)?
    };
    let contiguous = cpu.f_contiguous()?;
    let numel = contiguous.numel();
    let mut bytes = vec![0u8; numel * dtype.size()];
    if numel > 0 {
        contiguous.f_copy_data_u8(&mut bytes, numel)?;
    }
    Ok(bytes)
}
