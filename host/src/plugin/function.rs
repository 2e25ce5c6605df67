//! [`PluginFunction`]: one exported function of a loaded plugin as an
//! [`RpcFunction`] of the agent.

use std::sync::Arc;

use wasmrpc_wasm::{GuestHost, Plugin, Runtime};

use super::VersionScope;
use super::class::PluginObject;
use super::grant::PluginGrant;
use super::host_functions::GuestCall;
use super::module::ModuleInstance;
use crate::agent::{CallContext, RpcFunction};
use crate::error::{Error, Result};
use crate::value::{Args, Payload};

/// A plugin's function (plain or `async_execution`), called through the
/// agent: the call's arguments become guest handles, the guest runs on a
/// pooled instance with a [`GuestCall`] as its host, and its result (for an
/// async function, its future's value) comes back as a payload.
pub(crate) struct PluginFunction {
    runtime: Runtime,
    plugin: Arc<Plugin>,
    namespace: String,
    function: String,
    /// What the plugin may do on this worker.
    grant: Arc<PluginGrant>,
    /// The version's state scope and use counts.
    scope: VersionScope,
    /// The one instance of a single-instance plugin on this worker, where
    /// every call runs.
    module: Option<Arc<ModuleInstance>>,
}

impl PluginFunction {
    pub(crate) fn new(
        runtime: Runtime,
        plugin: Arc<Plugin>,
        namespace: String,
        function: String,
        grant: Arc<PluginGrant>,
        scope: VersionScope,
        module: Option<Arc<ModuleInstance>>,
    ) -> Self {
        PluginFunction {
            runtime,
            plugin,
            namespace,
            function,
            grant,
            scope,
            module,
        }
    }
}

impl PluginFunction {
    /// Its plugin and the version scope it counts its calls in.
    pub(super) fn served(&self) -> (&Arc<Plugin>, &VersionScope) {
        (&self.plugin, &self.scope)
    }
}

/// A runtime error as a host error: the guest's own kind and message for an
/// error it raised, else the runtime's kind and text (which name the plugin
/// and the function).
pub(crate) fn wasm_error(e: &wasmrpc_wasm::Error) -> Error {
    Error::from(e.to_remote())
}

#[async_trait::async_trait]
impl RpcFunction for PluginFunction {
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload> {
        let where_ = || {
            format!(
                "running plugin function {}::{} on worker {} for {}",
                self.namespace,
                self.function,
                ctx.agent().name(),
                ctx.caller().name
            )
        };
        // Counted on its version until it ends (what draining waits for).
        let _in_flight = self.scope.usage.call();
        if let Some(module) = &self.module {
            return module.call(&ctx, &self.function, args, where_).await;
        }
        // OBJ-4: a function that reaches objects, called with an RRef to an
        // object of this plugin that lives here, runs beside it, where
        // `rref.local_value()` is the object itself.
        if self.plugin.manifest().reaches_objects(&self.function)
            && let Some(object) = PluginObject::among(&args.rrefs, &self.plugin).await
        {
            let timeout = ctx.agent().get_rpc_timeout();
            let wait = (!timeout.is_zero()).then_some(timeout);
            return object.call_beside(&self.function, args, wait, where_).await;
        }
        // The call records into the scope it is served in, if any, from
        // wherever its requests run (`crate::profiler`).
        let host = Arc::new(
            GuestCall::new(
                ctx.agent().clone(),
                self.plugin.clone(),
                self.namespace.clone(),
                self.grant.clone(),
                self.scope.clone(),
            )
            .profiled_by(crate::profiler::Recording::active()),
        );
        let call_args = host
            .handles()
            .import_args(args)
            .map_err(|e| Error::from(e).context_line(where_()))?;
        let guest: Arc<dyn GuestHost> = host.clone();
        let value = self
            .runtime
            .call(&self.plugin, &self.function, call_args, guest)
            .await
            .map_err(|e| wasm_error(&e).context_line(where_()))?;
        host.handles()
            .take_payload(value)
            .map_err(|e| Error::from(e).context_line(where_()))
    }
}
