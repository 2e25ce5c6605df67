//! A guest's files: the folders its operator granted it on this worker
//! (`wasmrpc_wasm::folders`), and tensor files in them.
//!
//! The file system work is `Folders`' (capability-safe paths, regular files
//! only, quotas, atomic writes); the formats are `wasmrpc-tensor-files`'
//! (safetensors, `.npy`, `.npz`; never a pickle). This file joins them to
//! the call: it finds the plugin's folders, bounds every read by the
//! call's tensor memory budget before the file is read, makes tensors in
//! that budget, and does the blocking work off the async threads.

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::Tensor;
use wasmrpc_tensor_files::TensorBytes;
use wasmrpc_wasm::{ErrorKind, FileCall, Folders, HostResult, RemoteError, Value};

use super::{GuestCall, dtype_kind, elements, meta, remote, tch_error};

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> HostResult<T> + Send + 'static,
) -> HostResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        RemoteError::new(
            ErrorKind::RuntimeError,
            format!("a file request did not complete: {e}"),
        )
    })?
}

fn format_error(e: &wasmrpc_tensor_files::FileError) -> RemoteError {
    let kind = if e.is_value_error() {
        ErrorKind::ValueError
    } else {
        ErrorKind::RuntimeError
    };
    RemoteError::new(kind, e.to_string())
}

impl GuestCall {
    /// The folders the operator granted this plugin here (FG-1): a
    /// deployed plugin gets only the grants marked for deployed plugins.
    pub(super) fn granted_folders(&self) -> Option<Arc<Folders>> {
        let deployed = self.grant.trust() == crate::plugin::PluginTrust::Deployed;
        self.agent
            .options()
            .plugin_folders
            .for_plugin(&self.namespace, deployed)
    }

    fn folders_or_refuse(&self, path: &str) -> HostResult<Arc<Folders>> {
        self.granted_folders().ok_or_else(|| {
            RemoteError::new(
                ErrorKind::RuntimeError,
                format!(
                    "cannot open {path}: plugin {} has no folder granted on {} (the operator \
                     grants one with --grant-dir {}:/GUEST=HOST)",
                    self.namespace,
                    self.agent.name(),
                    self.namespace
                ),
            )
        })
    }

    /// The most bytes one read may take: the call's tensor memory budget.
    fn read_limit(&self) -> u64 {
        self.agent.tensor_budget().per_call()
    }

    /// Runs a file request ([`FileCall`]).
    pub(super) async fn run_file(&self, call: FileCall) -> HostResult<Value> {
        match call {
            FileCall::Read(path) => {
                let folders = self.folders_or_refuse(&path)?;
                let limit = self.read_limit();
                let bytes = blocking(move || folders.read(&path, limit)).await?;
                Ok(Value::Bytes(bytes))
            }
            FileCall::Write { path, data } => {
                let folders = self.folders_or_refuse(&path)?;
                blocking(move || folders.write(&path, &data)).await?;
                Ok(Value::None)
            }
            FileCall::List(path) => {
                let folders = self.folders_or_refuse(&path)?;
                let entries = blocking(move || folders.list(&path)).await?;
                Ok(Value::List(
                    entries
                        .into_iter()
                        .map(|e| {
                            Value::Tuple(vec![
                                Value::Str(e.name),
                                Value::Bool(e.is_dir),
                                Value::Int(i64::try_from(e.size).unwrap_or(i64::MAX)),
                            ])
                        })
                        .collect(),
                ))
            }
            FileCall::Remove(path) => {
                let folders = self.folders_or_refuse(&path)?;
                blocking(move || folders.remove(&path)).await?;
                Ok(Value::None)
            }
            FileCall::SaveTensors {
                path,
                tensors,
                metadata,
            } => self.save_tensors(path, tensors, metadata).await,
            FileCall::LoadTensors(path) => self.load_tensors(path).await,
        }
    }

    async fn save_tensors(
        &self,
        path: String,
        tensors: Vec<(String, u32)>,
        metadata: Vec<(String, String)>,
    ) -> HostResult<Value> {
        let folders = self.folders_or_refuse(&path)?;
        let named = {
            let handles = self.handles();
            tensors
                .into_iter()
                .map(|(name, h)| Ok((name, handles.tensor(h)?)))
                .collect::<HostResult<Vec<_>>>()?
        };
        blocking(move || {
            let mut contents = Vec::with_capacity(named.len());
            for (name, t) in named {
                let m = meta(&t)?;
                let data = elements(&t.detach(), m.dtype).map_err(tch_error)?;
                contents.push((
                    name,
                    TensorBytes {
                        dtype: m.dtype,
                        shape: m.shape,
                        data,
                    },
                ));
            }
            let metadata: BTreeMap<String, String> = metadata.into_iter().collect();
            let bytes = wasmrpc_tensor_files::write_safetensors(&path, &contents, &metadata)
                .map_err(|e| format_error(&e))?;
            folders.write(&path, &bytes)
        })
        .await?;
        Ok(Value::None)
    }

    async fn load_tensors(&self, path: String) -> HostResult<Value> {
        let folders = self.folders_or_refuse(&path)?;
        let limit = self.read_limit();
        let (tensors, metadata) = blocking(move || {
            // Refused before it is read when over the call's budget; the
            // decoded tensors are held to it as well (an .npz inflates).
            let bytes = folders.read(&path, limit)?;
            wasmrpc_tensor_files::read_with_metadata(&path, &bytes, limit)
                .map_err(|e| format_error(&e))
        })
        .await?;
        let what = format!("a tensor file loaded by plugin {}", self.namespace);
        let mut loaded = Vec::with_capacity(tensors.len());
        for (name, t) in tensors {
            let (made, refused) = self.budget.run(&what, || {
                Tensor::f_from_data_size(&t.data, &t.shape, dtype_kind(t.dtype))
            });
            if let Some(e) = refused {
                return Err(remote(e));
            }
            loaded.push((name, made.map_err(tch_error)?));
        }
        let mut handles = self.handles();
        let tensors = loaded
            .into_iter()
            .map(|(name, t)| (Value::Str(name), Value::Tensor(handles.insert_tensor(t))))
            .collect();
        let metadata = metadata
            .into_iter()
            .map(|(k, v)| (Value::Str(k), Value::Str(v)))
            .collect();
        Ok(Value::Tuple(vec![
            Value::Dict(tensors),
            Value::Dict(metadata),
        ]))
    }
}
