//! Component plugins: plugins built as WebAssembly components against the
//! WIT world `guest-sdk/wit/plugin.wit` (Python plugins built with
//! componentize-py), beside the core modules of Rust plugins.
//!
//! A component is one more kind of code in a [`Plugin`](crate::Plugin): it
//! is loaded, cached, pooled and limited exactly like a core module, and
//! every request of its `host` imports becomes the
//! [`HostCall`](wasmrpc_abi::protocol::HostCall) a Rust guest would have
//! sent, answered by the same host functions ([`crate::imports::dispatch`]).
//! This module owns what differs: the bindings of the world, the WASI
//! context (granting only the plugin's folders), and a live component instance
//! ([`ComponentWarm`]); `convert` holds the conversions between the world's
//! types and `wasmrpc_abi`'s, `requests` the world's `host` interface.
//!
//! # What a component may reach
//!
//! componentize-py's runtime (CPython) imports WASI 0.2. The linker
//! provides it over a context that grants nothing but the folders the
//! operator granted the plugin on the worker ([`crate::folders`], preopened
//! under their guest paths; read-only unless granted read-write without a
//! quota): no other files, no environment, no arguments, no stdin (stdout
//! and stderr are discarded), no sockets or name lookups (every address is
//! refused). The wall clock, the monotonic clock and random bytes are
//! real. Anything else a component imports fails to link.

use crate::Folders;
use crate::instance::{CallCtx, Fault, StoreData, new_store};
use crate::plugin::Target;
use std::sync::Arc;
use std::time::Duration;
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::{CallArgs, Outcome};
use wasmtime::Engine;
use wasmtime::component::{HasSelf, InstancePre, Linker, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// The bindings of the world `wasmrpc:plugin/plugin`.
mod bindings {
    wasmtime::component::bindgen!({
        path: "../../guest-sdk/wit",
        world: "plugin",
        imports: { default: async },
        exports: { default: async },
    });
}

mod convert;
mod requests;

use convert::{call_args_to_wit, manifest_exports, outcome_from_wit};

/// The WASI state of a store: a context granting nothing, and its table.
pub(crate) struct Wasi {
    ctx: WasiCtx,
    table: ResourceTable,
}

impl Wasi {
    /// A context with no files, environment, arguments, stdin or sockets;
    /// the clocks are the host's (the time of day and a monotonic clock are
    /// no secrets, and logs and timeouts need them).
    pub(crate) fn deny_all() -> Wasi {
        Self::build(WasiCtx::builder())
    }

    /// [`deny_all`](Self::deny_all) with `folders` preopened under their
    /// guest paths (FG-2, FG-4).
    pub(crate) fn with_folders(folders: &Folders) -> wasmtime::Result<Wasi> {
        let mut builder = WasiCtx::builder();
        folders.preopen(&mut builder)?;
        Ok(Self::build(builder))
    }

    fn build(mut builder: wasmtime_wasi::WasiCtxBuilder) -> Wasi {
        builder
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .socket_addr_check(|_, _| Box::pin(async { false }));
        Wasi {
            ctx: builder.build(),
            table: ResourceTable::new(),
        }
    }
}

impl WasiView for StoreData {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi.ctx,
            table: &mut self.wasi.table,
        }
    }
}

/// The linker of component plugins: WASI 0.2 over [`Wasi::deny_all`], and
/// the world's `host` interface.
pub(crate) fn linker(engine: &Engine) -> wasmtime::Result<Linker<StoreData>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    bindings::Plugin::add_to_linker::<StoreData, HasSelf<StoreData>>(&mut linker, |d| d)?;
    Ok(linker)
}

/// Whether `bytes` start like a component (rather than a core module).
pub(crate) fn is_component(bytes: &[u8]) -> bool {
    bytes.get(..8) == Some(b"\0asm\x0d\0\x01\0".as_slice())
}

/// A live component instance, ready to run any export of its plugin.
pub(crate) struct ComponentWarm {
    store: wasmtime::Store<StoreData>,
    plugin: bindings::Plugin,
}

impl ComponentWarm {
    /// Instantiates `pre` in a new store with the given limits.
    pub(crate) async fn new(
        engine: &Engine,
        pre: &InstancePre<StoreData>,
        max_memory: usize,
        time_limit: Option<Duration>,
        folders: Option<&Folders>,
    ) -> wasmtime::Result<ComponentWarm> {
        let mut store = new_store(engine, max_memory, time_limit);
        if let Some(folders) = folders {
            store.data_mut().wasi = Wasi::with_folders(folders)?;
        }
        let instance = pre.instantiate_async(&mut store).await?;
        let plugin = bindings::Plugin::new(&mut store, &instance)?;
        Ok(ComponentWarm { store, plugin })
    }

    /// The manifest the component describes itself with.
    pub(crate) async fn describe(&mut self) -> Result<Vec<wasmrpc_abi::manifest::Export>, Fault> {
        self.store.data_mut().begin(None);
        self.store.set_epoch_deadline(1);
        let guest = self.plugin.wasmrpc_plugin_guest();
        match guest.call_describe(&mut self.store).await {
            Ok(m) => Ok(manifest_exports(m)),
            Err(e) => Err(self.store.data_mut().fault(&e)),
        }
    }

    /// Runs `target` with `args` and returns its outcome.
    pub(crate) async fn invoke(
        &mut self,
        ctx: Arc<CallCtx>,
        target: Target<'_>,
        args: &CallArgs,
    ) -> Result<Outcome, Fault> {
        self.store.data_mut().begin(Some(ctx));
        self.store.set_epoch_deadline(1);
        let guest = self.plugin.wasmrpc_plugin_guest();
        let store = &mut self.store;
        let result = match target {
            Target::Function(name) | Target::Constructor(name) => guest
                .call_call(&mut *store, name, &call_args_to_wit(args))
                .await
                .map(Some),
            Target::Method {
                object,
                class,
                method,
            } => guest
                .call_call_method(&mut *store, object, class, method, &call_args_to_wit(args))
                .await
                .map(Some),
            Target::Drop { object, class } => guest
                .call_drop_object(&mut *store, object, class)
                .await
                .map(|()| None),
        };
        match result {
            Ok(Some(outcome)) => outcome_from_wit(outcome).map_err(Fault::Abi),
            Ok(None) => Ok(Outcome::Return(Value::None)),
            Err(e) => Err(self.store.data_mut().fault(&e)),
        }
    }

    /// The call in progress, if any (to release what it holds).
    pub(crate) fn take_ctx(&mut self) -> Option<Arc<CallCtx>> {
        let data = self.store.data_mut();
        // VIS-4: visits the guest left unfinished fail now; the call's own
        // context is the outermost one they saved.
        if let Some(outer) = data.visits.first_mut() {
            data.ctx = outer.saved_ctx.take();
        }
        data.visits.clear();
        data.ctx.take()
    }
}

#[cfg(test)]
mod python_component {
    /// What componentize-py's runtime (CPython) imports: WASI 0.2's io,
    /// clocks, random, cli, filesystem and sockets (linked over a context
    /// that grants nothing), and the plugin world. Anything new here must
    /// be looked at before the linker grants it.
    #[test]
    fn a_python_component_imports_only_wasi_and_the_plugin_world() {
        let engine = wasmtime::Engine::default();
        let bytes = std::fs::read(wasmrpc_plugins::SEED_FNS_PY).expect("the Python plugin");
        let component = wasmtime::component::Component::new(&engine, &bytes).expect("compiles");
        let allowed = [
            "wasi:io/",
            "wasi:clocks/monotonic-clock@",
            "wasi:clocks/wall-clock@",
            "wasi:random/",
            "wasi:cli/",
            "wasi:filesystem/",
            "wasi:sockets/",
            "wasmrpc:plugin/types@",
            "wasmrpc:plugin/host@",
        ];
        let imports: Vec<String> = component
            .component_type()
            .imports(&engine)
            .map(|(name, _)| name.to_owned())
            .collect();
        assert!(
            imports
                .iter()
                .any(|i| i.starts_with("wasmrpc:plugin/host@"))
        );
        for import in &imports {
            assert!(
                allowed.iter().any(|a| import.starts_with(a)),
                "the Python component imports {import}"
            );
        }
    }
}
