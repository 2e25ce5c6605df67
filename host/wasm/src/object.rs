//! [`Object`]: an instance of a plugin class (a seed's Python class held
//! in an RRef), living in an instance of its own whose method calls run one
//! at a time (actor semantics).

use crate::instance::CallCtx;
use crate::plugin::{Target, Warm};
use crate::runtime::finish;
use crate::{Error, GuestHost, Plugin, Result, Runtime};
use std::sync::Arc;
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::{CallArgs, ExportKind};

/// An object of a plugin class, made by [`Runtime::construct`].
///
/// Method calls queue on the object: one runs at a time, in arrival order
/// (tokio's fair mutex). A method that calls back into the same object
/// therefore waits for itself; use functions for re-entrant work. An
/// `async_execution` method releases the object as soon as it returns its
/// future. A trap breaks the object: later calls fail with
/// [`Error::ObjectBroken`]. Dispose of an object with [`Object::dispose`]:
/// dropping it frees its instance without running the guest's destructor,
/// so the handles its fields hold stay in the host's tables.
pub struct Object {
    runtime: Runtime,
    plugin: Arc<Plugin>,
    class: String,
    id: u32,
    instance: tokio::sync::Mutex<Option<Warm>>,
}

impl std::fmt::Debug for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Object")
            .field("plugin", &self.plugin.name())
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl Object {
    pub(crate) fn new(
        runtime: Runtime,
        plugin: Arc<Plugin>,
        class: &str,
        id: u32,
        warm: Warm,
    ) -> Object {
        Object {
            runtime,
            plugin,
            class: class.to_owned(),
            id,
            instance: tokio::sync::Mutex::new(Some(warm)),
        }
    }

    /// The class name.
    pub fn class(&self) -> &str {
        &self.class
    }

    /// The id the guest's constructor gave the object (what its methods are
    /// called on).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The plugin the class belongs to.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// Calls `method` on the object.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown method, [`Error::ObjectBroken`]
    /// after a trap, else as [`Runtime::call`].
    pub async fn call_method(
        &self,
        method: &str,
        args: CallArgs,
        host: Arc<dyn GuestHost>,
    ) -> Result<Value> {
        let Some(entry) = self
            .plugin
            .entry(&format!("method:{}.{method}", self.class))
            .cloned()
        else {
            return Err(Error::NotFound {
                plugin: self.plugin.name().to_owned(),
                what: "method",
                name: format!("{}.{method}", self.class),
            });
        };
        let outcome = {
            let mut slot = self.instance.lock().await;
            // Taken out while the method runs: if this future is dropped
            // mid-call, the object is left broken rather than half-updated.
            let Some(mut warm) = slot.take() else {
                return Err(self.broken());
            };
            let ctx = CallCtx::new(host.clone(), self.plugin.clone(), self.runtime.clone());
            let target = Target::Method {
                object: self.id,
                class: &self.class,
                method,
            };
            let outcome = warm.invoke(ctx, target, &args).await;
            if outcome.is_ok() {
                *slot = Some(warm);
            }
            outcome
        };
        match outcome {
            Ok(outcome) => {
                let is_async = entry.kind == ExportKind::AsyncMethod;
                finish(self.plugin.name(), method, is_async, outcome, &host).await
            }
            Err(fault) => Err(fault.into_error(self.plugin.name(), method)),
        }
    }

    /// Runs the plugin's function `function` in the object's instance,
    /// queued with its methods, so the function sees the object as the
    /// instance's own (a Python plugin's `rref.local_value()` gives it).
    /// The host decides when a call runs beside its object; the guest runs
    /// it as it runs any function, with the object's handles in reach.
    ///
    /// It waits for the object at most `wait` (`None`: as long as it
    /// takes): a call that waits for another call that needs the same
    /// object would otherwise wait for itself for ever.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown function, [`Error::ObjectBusy`]
    /// when the object stayed busy for `wait`, [`Error::ObjectBroken`]
    /// after a trap, else as [`Runtime::call`].
    pub async fn call_function(
        &self,
        function: &str,
        args: CallArgs,
        host: Arc<dyn GuestHost>,
        wait: Option<std::time::Duration>,
    ) -> Result<Value> {
        let entry = self
            .plugin
            .entry(function)
            .filter(|e| matches!(e.kind, ExportKind::Function | ExportKind::AsyncFunction));
        let Some(entry) = entry else {
            return Err(Error::NotFound {
                plugin: self.plugin.name().to_owned(),
                what: "function",
                name: function.to_owned(),
            });
        };
        let is_async = entry.kind == ExportKind::AsyncFunction;
        let outcome = {
            let mut slot = match wait {
                None => self.instance.lock().await,
                Some(wait) => tokio::time::timeout(wait, self.instance.lock())
                    .await
                    .map_err(|_| Error::ObjectBusy {
                        plugin: self.plugin.name().to_owned(),
                        class: self.class.clone(),
                        function: function.to_owned(),
                        waited: wait,
                    })?,
            };
            let Some(mut warm) = slot.take() else {
                return Err(self.broken());
            };
            let ctx = CallCtx::new(host.clone(), self.plugin.clone(), self.runtime.clone());
            let outcome = warm.invoke(ctx, Target::Function(function), &args).await;
            if outcome.is_ok() {
                *slot = Some(warm);
            }
            outcome
        };
        match outcome {
            Ok(outcome) => finish(self.plugin.name(), function, is_async, outcome, &host).await,
            Err(fault) => Err(fault.into_error(self.plugin.name(), function)),
        }
    }

    /// Destroys the object: runs its Rust destructor in the guest (which
    /// releases the handles it held), then frees the instance.
    ///
    /// # Errors
    /// [`Error::ObjectBroken`] after a trap, or the destructor's trap.
    pub async fn dispose(self, host: Arc<dyn GuestHost>) -> Result<()> {
        let Some(mut warm) = self.instance.lock().await.take() else {
            return Err(self.broken());
        };
        let ctx = CallCtx::new(host, self.plugin.clone(), self.runtime.clone());
        let target = Target::Drop {
            object: self.id,
            class: &self.class,
        };
        warm.invoke(ctx, target, &CallArgs::default())
            .await
            .map(drop)
            .map_err(|fault| {
                fault.into_error(self.plugin.name(), &format!("{}.__del__", self.class))
            })
    }

    fn broken(&self) -> Error {
        Error::ObjectBroken {
            plugin: self.plugin.name().to_owned(),
            class: self.class.clone(),
        }
    }
}
