//! Single-instance plugins (a Python plugin that calls
//! `wasmrpc.single_instance()`; the manifest's `SingleInstance` record):
//! every call of such a plugin on one worker runs in one instance, one at a
//! time, with one guest host, so its module-level state (a global object,
//! a cache, a counter) is shared by all of them, as in one Python process.
//!
//! What it owns: that instance ([`ModuleInstance`], made at the first call
//! on the worker), the plugin's objects made there (its classes'
//! constructors, and an object one of its functions hands to the
//! owner-side `remote()` that called it: [`offer`]). It leaves the objects'
//! methods and disposal to [`PluginObject`], which holds them as it holds
//! any object (they share the instance, and the guest host whose handles
//! their fields hold).
//!
//! A call that waits on a future serves the calls waiting for the
//! instance meanwhile (`wasmrpc_wasm`'s visits), as a Python process's
//! other threads run while one waits; a call that waits elsewhere (a
//! lock, a sleep) holds the instance, and a call of the same
//! plugin that it waits for on the same worker waits for it.

use std::cell::RefCell;
use std::sync::Arc;

use wasmrpc_wasm::{GuestHost, HostResult, Object, Plugin, RemoteError, Runtime};

use super::VersionScope;
use super::class::{PluginObject, function_value};
use super::function::wasm_error;
use super::grant::PluginGrant;
use super::host_functions::GuestCall;
use crate::abi::ErrorKind;
use crate::agent::CallContext;
use crate::error::{Error, Result};
use crate::rref::can_keep_object;
use crate::value::{Args, Payload};

tokio::task_local! {
    /// Set while a function of a single-instance plugin runs: the object
    /// it offered to keep ([`offer`]), if any.
    static OFFERED: RefCell<Option<(u32, String)>>;
    /// Set while any call of a single-instance plugin runs in its instance
    /// (a function, a constructor, a method): where `RRef(obj)` made in
    /// place keeps the object ([`rref_in_place`]).
    static RUNNING_IN: Arc<ModuleInstance>;
}

/// Runs `call` as a call of `module`'s instance: `RRef(obj)` in it keeps
/// the object in place ([`rref_in_place`]).
pub(super) async fn running_in<F: std::future::Future>(
    module: Arc<ModuleInstance>,
    call: F,
) -> F::Output {
    RUNNING_IN.scope(module, call).await
}

/// The instance a single-instance plugin runs in on one worker, made at
/// the first call there.
pub(crate) struct ModuleInstance {
    runtime: Runtime,
    plugin: Arc<Plugin>,
    namespace: String,
    grant: Arc<PluginGrant>,
    scope: VersionScope,
    instance: tokio::sync::OnceCell<(Object, Arc<GuestCall>)>,
}

impl ModuleInstance {
    pub(super) fn new(
        runtime: Runtime,
        plugin: Arc<Plugin>,
        namespace: String,
        grant: Arc<PluginGrant>,
        scope: VersionScope,
    ) -> Arc<ModuleInstance> {
        Arc::new(ModuleInstance {
            runtime,
            plugin,
            namespace,
            grant,
            scope,
            instance: tokio::sync::OnceCell::new(),
        })
    }

    async fn instance(&self, ctx: &CallContext) -> Result<&(Object, Arc<GuestCall>)> {
        self.instance
            .get_or_try_init(|| async {
                let host = Arc::new(GuestCall::new(
                    ctx.agent().clone(),
                    self.plugin.clone(),
                    self.namespace.clone(),
                    self.grant.clone(),
                    self.scope.clone(),
                ));
                let module = Object::module(&self.runtime, &self.plugin, host.folders())
                    .await
                    .map_err(|e| {
                        wasm_error(&e).context_line(format!(
                            "starting the one instance of plugin {} on worker {}",
                            self.namespace,
                            ctx.agent().name()
                        ))
                    })?;
                Ok((module, host))
            })
            .await
    }

    /// The instance, its guest host and `args` as its handles, once the
    /// RRefs this worker owns among `args` are created: a creation may be a
    /// call of this very plugin, waiting for the instance a call would hold.
    async fn enter(
        &self,
        ctx: &CallContext,
        args: Args,
        where_: &impl Fn() -> String,
    ) -> Result<(&Object, &Arc<GuestCall>, wasmrpc_wasm::CallArgs)> {
        super::class::created(&args.rrefs).await;
        let (module, host) = self.instance(ctx).await?;
        let call_args = host
            .handles()
            .import_args(args)
            .map_err(|e| Error::from(e).context_line(where_()))?;
        Ok((module, host, call_args))
    }

    /// Runs `function` in the instance. An object the function offered to
    /// keep ([`offer`]) is handed to the owner-side `remote()` that called
    /// it, in place of its value.
    pub(super) async fn call(
        self: &Arc<Self>,
        ctx: &CallContext,
        function: &str,
        args: Args,
        where_: impl Fn() -> String,
    ) -> Result<Payload> {
        let (module, host, call_args) = self.enter(ctx, args, &where_).await?;
        let guest: Arc<dyn GuestHost> = host.clone();
        let offered = RefCell::new(None);
        let (called, offered) = running_in(
            self.clone(),
            OFFERED.scope(offered, async {
                let called = module.call_function(function, call_args, guest, None).await;
                (called, OFFERED.with(|o| o.borrow_mut().take()))
            }),
        )
        .await;
        let called = called.map_err(|e| wasm_error(&e).context_line(where_()))?;
        let value = function_value(called, &where_)?;
        let payload = host
            .handles()
            .take_payload(value)
            .map_err(|e| Error::from(e).context_line(where_()))?;
        if let Some((id, class)) = offered {
            let object = PluginObject::new(
                ctx.agent(),
                &self.runtime,
                &self.namespace,
                host.clone(),
                module.sibling(&class, id),
                &self.scope,
                Some(self.clone()),
            );
            crate::rref::keep_object(Arc::new(object))
                .map_err(|_| Error::runtime(format!("{}: no RRef to keep it", where_())))?;
        }
        Ok(payload)
    }

    /// Constructs an object of `class` in the instance.
    pub(super) async fn construct(
        self: &Arc<Self>,
        ctx: &CallContext,
        class: &str,
        args: Args,
        where_: impl Fn() -> String,
    ) -> Result<PluginObject> {
        let (module, host, call_args) = self.enter(ctx, args, &where_).await?;
        let guest: Arc<dyn GuestHost> = host.clone();
        let object = running_in(self.clone(), module.construct(class, call_args, guest))
            .await
            .map_err(|e| wasm_error(&e).context_line(where_()))?;
        Ok(PluginObject::new(
            ctx.agent(),
            &self.runtime,
            &self.namespace,
            host.clone(),
            object,
            &self.scope,
            Some(self.clone()),
        ))
    }
}

/// The guest's offer to have the owner-side `remote()` its function serves
/// keep its object `object` of class `class`: accepted (`true`) only in a
/// single-instance plugin's function called by such a `remote()`; refused
/// with `TypeError` for a class the plugin does not export.
pub(super) fn offer(plugin: &Plugin, object: u32, class: &str) -> HostResult<bool> {
    if plugin.manifest().constructor(class).is_none() {
        return Err(RemoteError::new(
            ErrorKind::TypeError,
            format!(
                "plugin {} offered an object of class `{class}` to keep, which it does not export",
                plugin.name()
            ),
        ));
    }
    if !can_keep_object() {
        return Ok(false);
    }
    Ok(OFFERED
        .try_with(|o| *o.borrow_mut() = Some((object, class.to_owned())))
        .is_ok())
}

/// `RRef(obj)` made in place by the running call of a single-instance
/// plugin: an RRef `agent` owns holding the instance's object `object` of
/// class `class` itself (OBJ-6), whose methods run in the instance, queued
/// with its calls. Refused with `TypeError` outside such a call (a pooled
/// or an object's own instance cannot keep a second object: it is shared
/// or discarded), and for a class the plugin does not export.
pub(super) fn rref_in_place(
    plugin: &Plugin,
    agent: &crate::agent::RpcAgent,
    object: u32,
    class: &str,
) -> HostResult<crate::rref::RRef> {
    if plugin.manifest().constructor(class).is_none() {
        return Err(RemoteError::new(
            ErrorKind::TypeError,
            format!(
                "plugin {} asked for an RRef to an object of class `{class}`, which it does not \
                 export",
                plugin.name()
            ),
        ));
    }
    let module = RUNNING_IN.try_with(Arc::clone).ok();
    let in_place = module.as_ref().and_then(|m| {
        let (instance, host) = m.instance.get()?;
        Some((m, instance, host))
    });
    let Some((module, instance, host)) = in_place else {
        return Err(RemoteError::new(
            ErrorKind::TypeError,
            format!(
                "RRef(obj) of an object of class `{class}` on worker {}: plugin {} runs each \
                 call in an instance of its own, so the object would not outlive the call; \
                 make it with rpc.remote(worker, {class}, args=...), or call \
                 wasmrpc.single_instance() at the plugin's module level so that its objects \
                 stay in the worker's one instance",
                agent.name(),
                plugin.name()
            ),
        ));
    };
    let object = PluginObject::new(
        agent,
        &module.runtime,
        &module.namespace,
        host.clone(),
        instance.sibling(class, object),
        &module.scope,
        Some(module.clone()),
    );
    Ok(crate::rref::RRef::holding_object(agent, Arc::new(object)))
}
