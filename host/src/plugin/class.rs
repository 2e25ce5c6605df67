//! Plugin classes on the agent: [`PluginClass`], a class's constructor as
//! a `remote()` target, and [`PluginObject`], an object held by an RRef on
//! its owner.
//!
//! An object lives in a wasm instance of its own ([`Object`]) and keeps one
//! guest host ([`GuestCall`]) for its whole life: the handles its fields
//! hold (tensors, RRefs) stay valid from the constructor to the
//! destructor, and per-worker locks it takes are released when it is
//! disposed (PL-3 at the scale of the object). That guest host holds the
//! agent, and the agent's RRef table holds the object: the cycle ends when
//! the owner forgets the value, at the latest when the agent shuts down
//! and clears its RRef context.

use std::sync::Arc;

use wasmrpc_wasm::{Called, GuestHost, Object, Plugin, Runtime};

use super::VersionScope;
use super::function::{PluginFunction, wasm_error};
use super::grant::PluginGrant;
use super::host_functions::GuestCall;
use super::module::ModuleInstance;
use crate::abi::{ErrorKind, Value, WorkerInfo};
use crate::agent::{CallContext, RpcAgent, RpcFunction};
use crate::error::{Error, Result};
use crate::rref::{RRef, RRefObject, can_keep_object, keep_object};
use crate::value::{Args, Payload};

/// A plugin class, registered as `namespace::Class`: `remote()` of it
/// constructs an object on the destination and the RRef holds it.
pub(crate) struct PluginClass {
    runtime: Runtime,
    plugin: Arc<Plugin>,
    namespace: String,
    class: String,
    /// What the plugin may do on this worker.
    grant: Arc<PluginGrant>,
    /// The version's state scope and use counts.
    scope: VersionScope,
    /// The one instance of a single-instance plugin on this worker, where
    /// its objects are made.
    module: Option<Arc<ModuleInstance>>,
}

impl PluginClass {
    pub(crate) fn new(
        runtime: Runtime,
        plugin: Arc<Plugin>,
        namespace: String,
        class: String,
        grant: Arc<PluginGrant>,
        scope: VersionScope,
        module: Option<Arc<ModuleInstance>>,
    ) -> Self {
        PluginClass {
            runtime,
            plugin,
            namespace,
            class,
            grant,
            scope,
            module,
        }
    }
}

#[async_trait::async_trait]
impl RpcFunction for PluginClass {
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload> {
        let agent = ctx.agent();
        let name = format!("{}::{}", self.namespace, self.class);
        if !can_keep_object() {
            // OBJ-1: only remote() has an owner to keep the object.
            return Err(Error::new(
                ErrorKind::TypeError,
                format!(
                    "{name} is a plugin class, called by rpc_sync/rpc_async from worker {} on \
                     worker {}: its objects stay on their owner and cannot be returned; create \
                     one with remote(\"{}\", \"{name}\", ...) and call its methods through the \
                     RRef's proxies (rref.rpc_sync().method(...))",
                    ctx.caller().name,
                    agent.name(),
                    agent.name()
                ),
            ));
        }
        let where_ = || {
            format!(
                "constructing {name} on worker {} for {}",
                agent.name(),
                ctx.caller().name
            )
        };
        let _in_flight = self.scope.usage.call();
        if let Some(module) = &self.module {
            let object = module.construct(&ctx, &self.class, args, where_).await?;
            keep_object(Arc::new(object))
                .map_err(|_| Error::runtime(format!("{}: no RRef to keep it", where_())))?;
            return Ok(Payload::none());
        }
        let host = Arc::new(GuestCall::new(
            agent.clone(),
            self.plugin.clone(),
            self.namespace.clone(),
            self.grant.clone(),
            self.scope.clone(),
        ));
        let call_args = host
            .handles()
            .import_args(args)
            .map_err(|e| Error::from(e).context_line(where_()))?;
        let guest: Arc<dyn GuestHost> = host.clone();
        let object = self
            .runtime
            .construct(&self.plugin, &self.class, call_args, guest)
            .await
            .map_err(|e| wasm_error(&e).context_line(where_()))?;
        let object = PluginObject::new(
            agent,
            &self.runtime,
            &self.namespace,
            host,
            object,
            &self.scope,
            None,
        );
        keep_object(Arc::new(object))
            .map_err(|_| Error::runtime(format!("{}: no RRef to keep it", where_())))?;
        Ok(Payload::none())
    }
}

/// The value a function run in an object's instance gave; an object id
/// as its outcome is refused (only a constructor makes one so).
pub(super) fn function_value(called: Called, where_: &impl Fn() -> String) -> Result<Value> {
    match called {
        Called::Value(v) => Ok(v),
        Called::Object(id) => Err(Error::runtime(format!(
            "{}: the function returned its object {id} as an outcome, which only a constructor \
             does",
            where_()
        ))),
    }
}

/// The owner states of the RRefs among a call's `rrefs` that this worker
/// owns, once their creating functions have run. A call that reaches their
/// values waits for them before it takes an instance: the creation may
/// need that very instance (a single-instance plugin's, or an object's),
/// and would wait for the call that waits for it.
pub(super) async fn created(rrefs: &[crate::value::Handle]) -> Vec<Arc<crate::rref::OwnerState>> {
    let owned: Vec<_> = rrefs
        .iter()
        .filter_map(|h| {
            h.downcast_ref::<RRef>()
                .and_then(RRef::owner_state)
                .cloned()
        })
        .collect();
    for state in &owned {
        // The creating function's outcome; its error is the caller's to see
        // (through `local_value()`), not this wait's.
        let _ = state.value.wait().await;
    }
    owned
}

/// An object of a plugin class, held by an RRef on its owner. Dropping it
/// disposes of it (on the agent's runtime): the guest destructor runs and
/// releases what the object held.
pub(crate) struct PluginObject {
    tokio: tokio::runtime::Handle,
    runtime: Runtime,
    plugin: Arc<Plugin>,
    namespace: String,
    /// `namespace::Class`.
    type_name: String,
    host: Arc<GuestCall>,
    /// `Some` until dropped.
    object: Option<Object>,
    /// Counts the object on its version while it lives.
    _alive: super::versions::InUse,
    /// Its version's scope: static methods called through it run there.
    scope: VersionScope,
    /// The one instance of its single-instance plugin, where its static
    /// methods run too.
    module: Option<Arc<ModuleInstance>>,
}

impl PluginClass {
    /// Its plugin and the version scope it counts its objects in.
    pub(super) fn served(&self) -> (&Arc<Plugin>, &VersionScope) {
        (&self.plugin, &self.scope)
    }
}

impl PluginObject {
    /// The object `object` of `namespace`'s plugin, made with guest host
    /// `host`, counted on `scope` while it lives.
    pub(super) fn new(
        agent: &RpcAgent,
        runtime: &Runtime,
        namespace: &str,
        host: Arc<GuestCall>,
        object: Object,
        scope: &VersionScope,
        module: Option<Arc<ModuleInstance>>,
    ) -> PluginObject {
        PluginObject {
            tokio: agent.runtime_handle(),
            runtime: runtime.clone(),
            plugin: object.plugin().clone(),
            namespace: namespace.to_owned(),
            type_name: format!("{namespace}::{}", object.class()),
            host,
            object: Some(object),
            _alive: scope.usage.object(),
            scope: scope.clone(),
            module,
        }
    }

    fn class(&self) -> &str {
        self.object.as_ref().map_or("", Object::class)
    }

    /// The first object of `plugin` held by an RRef among a call's `rrefs`
    /// that this worker owns: a function that reaches objects runs beside
    /// it ([`PluginObject::call_beside`]). An RRef whose creation is still
    /// running is waited for, as the function's `local_value()` would.
    pub(super) async fn among(
        rrefs: &[crate::value::Handle],
        plugin: &Arc<Plugin>,
    ) -> Option<Arc<PluginObject>> {
        for state in created(rrefs).await {
            let Some(object) = state.object() else {
                continue;
            };
            let any: Arc<dyn std::any::Any + Send + Sync> = object.clone();
            if let Ok(object) = any.downcast::<PluginObject>()
                && Arc::ptr_eq(&object.plugin, plugin)
            {
                return Some(object);
            }
        }
        None
    }

    /// Runs `function` of the object's plugin in the object's instance,
    /// queued with its methods and with the object's guest host: the
    /// function sees the object as its instance's own (OBJ-4).
    ///
    /// It waits for the object at most `wait` (the agent's RPC timeout):
    /// past it, the call fails with `TimeoutError` instead of waiting for
    /// ever on a call of its own chain that holds the object.
    pub(super) async fn call_beside(
        &self,
        function: &str,
        args: Args,
        wait: Option<std::time::Duration>,
        where_: impl Fn() -> String,
    ) -> Result<Payload> {
        let instance = self
            .object
            .as_ref()
            .ok_or_else(|| Error::runtime(format!("{}: the object is gone", where_())))?;
        let call_args = self
            .host
            .handles()
            .import_args(args)
            .map_err(|e| Error::from(e).context_line(where_()))?;
        let guest: Arc<dyn GuestHost> = self.host.clone();
        let called = instance
            .call_function(function, call_args, guest, wait)
            .await
            .map_err(|e| wasm_error(&e).context_line(where_()));
        let value = function_value(called?, &where_)?;
        self.host
            .handles()
            .take_payload(value)
            .map_err(|e| Error::from(e).context_line(where_()))
    }

    /// The id of the object `rref` holds if it lives in the instance whose
    /// guest host is `host` (a function running beside it), else `None`.
    pub(super) fn local_to(rref: &RRef, host: &GuestCall) -> Option<u32> {
        let object = rref.owner_state()?.object()?;
        let any: &dyn std::any::Any = object.as_ref();
        let this = any.downcast_ref::<PluginObject>()?;
        if std::ptr::eq(Arc::as_ptr(&this.host), host) {
            this.object.as_ref().map(Object::id)
        } else {
            None
        }
    }
}

impl Drop for PluginObject {
    fn drop(&mut self) {
        let Some(object) = self.object.take() else {
            return;
        };
        let host: Arc<dyn GuestHost> = self.host.clone();
        let name = self.type_name.clone();
        // Without a runtime (the agent's is gone) the object is dropped
        // without its destructor; its instance is freed all the same.
        drop(self.tokio.spawn(async move {
            if let Err(e) = object.dispose(host).await {
                tracing::warn!(class = %name, "disposing of a plugin object failed: {e}");
            }
        }));
    }
}

#[async_trait::async_trait]
impl RRefObject for PluginObject {
    fn type_name(&self) -> &str {
        &self.type_name
    }

    fn has_method(&self, method: &str) -> bool {
        self.plugin
            .manifest()
            .method(self.class(), method)
            .is_some()
    }

    fn to_device(&self, device: crate::device::Device) -> Result<()> {
        self.host
            .handles()
            .move_tensors(device.to_tch())
            .map_err(|e| {
                Error::from(e).context_line(format!(
                    "moving the tensors of {} to {device}",
                    self.type_name
                ))
            })
    }

    async fn call_method(
        &self,
        agent: &RpcAgent,
        caller: &WorkerInfo,
        method: &str,
        args: Args,
    ) -> Result<Payload> {
        let class = self.class();
        let manifest = self.plugin.manifest();
        let where_ = || {
            format!(
                "calling {}.{method} on worker {} for {}",
                self.type_name,
                agent.name(),
                caller.name
            )
        };
        if manifest.method(class, method).is_none() {
            // Static and class methods are the plugin's functions
            // `Class.method`: called through an instance as in Python.
            let function = format!("{class}.{method}");
            if manifest.function(&function).is_some() {
                let f = PluginFunction::new(
                    self.runtime.clone(),
                    self.plugin.clone(),
                    self.namespace.clone(),
                    function.clone(),
                    self.host.grant(),
                    self.scope.clone(),
                    self.module.clone(),
                );
                let ctx = CallContext::new(
                    agent.clone(),
                    caller.clone(),
                    format!("{}::{function}", self.namespace),
                    Default::default(),
                );
                return f.call(ctx, args).await;
            }
            return Err(Error::new(
                ErrorKind::AttributeError,
                format!("'{class}' object has no attribute '{method}'"),
            ));
        }
        let object = self
            .object
            .as_ref()
            .ok_or_else(|| Error::runtime(format!("{}: the object is gone", where_())))?;
        // As a function's (`created`): the RRefs' values first.
        created(&args.rrefs).await;
        let call_args = self
            .host
            .handles()
            .import_args(args)
            .map_err(|e| Error::from(e).context_line(where_()))?;
        let guest: Arc<dyn GuestHost> = self.host.clone();
        let call = object.call_method(method, call_args, guest);
        let value = match &self.module {
            Some(module) => super::module::running_in(module.clone(), call).await,
            None => call.await,
        }
        .map_err(|e| wasm_error(&e).context_line(where_()))?;
        self.host
            .handles()
            .take_payload(value)
            .map_err(|e| Error::from(e).context_line(where_()))
    }
}
