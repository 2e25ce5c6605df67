//! [`FunctionRegistry`]: the functions a worker lets its peers call, by
//! qualified name.
//!
//! A name is looked up among the functions registered one by one first, then
//! asked of the registry's [`FunctionResolver`]s in order: families of
//! functions too large to list (every aten op libtorch registers, through
//! [`Builtins`], the resolver of [`crate::ops`]' builtin ops, which every
//! registry has unless made with [`FunctionRegistry::without_builtins`]). An explicitly registered
//! function therefore always wins over a resolved one of the same name.
//! Resolving a builtin op is not running it: the worker's op policy decides
//! that when it is called (`crate::ops::policy`, POL-1).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, RwLock};

use futures::FutureExt;

use super::RpcAgent;
use super::message::{Fields, field};
use crate::abi::{Value, WorkerInfo};
use crate::error::{Error, Result};
use crate::value::{Args, Payload};

/// What a called function knows about its call.
#[derive(Clone, Debug)]
pub struct CallContext {
    agent: RpcAgent,
    caller: WorkerInfo,
    function: String,
    fields: Arc<Fields>,
}

impl CallContext {
    /// The context of a call of `function` by `caller` on `agent`, which
    /// came with `fields` (a feature forwarding a call passes them on).
    pub fn new(agent: RpcAgent, caller: WorkerInfo, function: String, fields: Arc<Fields>) -> Self {
        CallContext {
            agent,
            caller,
            function,
            fields,
        }
    }

    /// The agent running the call, for nested calls and worker state.
    pub fn agent(&self) -> &RpcAgent {
        &self.agent
    }

    /// The worker that made the call.
    pub fn caller(&self) -> &WorkerInfo {
        &self.caller
    }

    /// The qualified name the function was called by.
    pub fn function(&self) -> &str {
        &self.function
    }

    /// What the features sent with the call.
    pub fn fields(&self) -> &Arc<Fields> {
        &self.fields
    }

    /// The field `feature` sent with the call, if any (what
    /// `crate::dist_autograd` reads its envelope from).
    pub fn field(&self, feature: &str) -> Option<&[u8]> {
        field(&self.fields, feature)
    }
}

/// A function peers can call: a builtin op, a wasm export, or native Rust.
///
/// `call` runs as a tokio task of the callee; it may make nested calls
/// (including back to the caller) through `ctx.agent()` and await them.
#[async_trait::async_trait]
pub trait RpcFunction: std::any::Any + Send + Sync {
    /// Runs the function.
    ///
    /// # Errors
    /// Whatever the function raises; the kind and message reach the caller.
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload>;

    /// Whether, in a profiling scope, the function is the aten ops
    /// libtorch runs for it (a builtin op): the callee of a profiled call
    /// then lists those ops, not an event of its own for the call
    /// (`crate::profiler`), as PyTorch lists `aten::add` for
    /// `rpc_sync(to, torch.add, ...)`.
    fn profiled_as_ops(&self) -> bool {
        false
    }

    /// The function this one runs for its caller, when it carries another
    /// (the RRef feature's `remote()` runs the one its arguments name):
    /// what a served call is reported as
    /// ([`IncomingCall::runs`](super::IncomingCall)).
    fn runs<'a>(&self, _args: &'a Args) -> Option<&'a str> {
        None
    }
}

struct Native<F>(F);

/// A native function that runs, for its caller, the function named by its
/// positional argument `at` ([`FunctionRegistry::register_carrier`]).
struct Carrier<F> {
    at: usize,
    native: Native<F>,
}

#[async_trait::async_trait]
impl<F, Fut> RpcFunction for Carrier<F>
where
    F: Fn(CallContext, Args) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Payload>> + Send + 'static,
{
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload> {
        self.native.call(ctx, args).await
    }

    fn runs<'a>(&self, args: &'a Args) -> Option<&'a str> {
        match args.positional.get(self.at) {
            Some(Value::Str(name)) => Some(name),
            _ => None,
        }
    }
}

#[async_trait::async_trait]
impl<F, Fut> RpcFunction for Native<F>
where
    F: Fn(CallContext, Args) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Payload>> + Send + 'static,
{
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload> {
        (self.0)(ctx, args).await
    }
}

/// Resolves names that were not registered one by one to functions, e.g.
/// every aten op by its schema name ([`crate::ops::BuiltinOps`]).
pub trait FunctionResolver: Send + Sync + 'static {
    /// The function `name` stands for, or `None` if this resolver does not
    /// know it. Called on every lookup that misses the registered
    /// functions, so it should be cheap (cache what is expensive).
    fn resolve(&self, name: &str) -> Option<Arc<dyn RpcFunction>>;
}

/// Qualified name → function. Shared behind an `Arc`; registering and
/// looking up are thread-safe.
///
/// `FunctionRegistry::new()` (and `default()`) resolves builtin ops
/// (`aten::add`, ...) with [`crate::ops::BuiltinOps`];
/// [`without_builtins`](Self::without_builtins) makes one that serves only
/// what is registered.
pub struct FunctionRegistry {
    functions: RwLock<HashMap<String, Arc<dyn RpcFunction>>>,
    resolvers: RwLock<Vec<Arc<dyn FunctionResolver>>>,
}

impl Default for FunctionRegistry {
    fn default() -> Self {
        let r = Self::without_builtins();
        r.add_resolver(Arc::new(Builtins));
        r
    }
}

impl std::fmt::Debug for FunctionRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FunctionRegistry")
            .field("functions", &self.names())
            .finish()
    }
}

impl FunctionRegistry {
    /// A registry with no functions of its own that resolves builtin ops.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry that serves only the functions registered in it: no
    /// builtin ops, no resolvers.
    pub fn without_builtins() -> Self {
        FunctionRegistry {
            functions: RwLock::new(HashMap::new()),
            resolvers: RwLock::new(Vec::new()),
        }
    }

    /// Adds a resolver, asked after the registered functions and after the
    /// resolvers added before it.
    pub fn add_resolver(&self, resolver: Arc<dyn FunctionResolver>) {
        self.resolvers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(resolver);
    }

    /// Registers `function` under `name`, replacing any previous one (which
    /// is returned).
    pub fn register(
        &self,
        name: impl Into<String>,
        function: Arc<dyn RpcFunction>,
    ) -> Option<Arc<dyn RpcFunction>> {
        self.functions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.into(), function)
    }

    /// Registers an async closure as a native function:
    /// `registry.register_native("seed::add", |ctx, args| async move { ... })`.
    pub fn register_native<F, Fut>(
        &self,
        name: impl Into<String>,
        f: F,
    ) -> Option<Arc<dyn RpcFunction>>
    where
        F: Fn(CallContext, Args) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Payload>> + Send + 'static,
    {
        self.register(name, Arc::new(Native(f)))
    }

    /// Registers an async closure as a native function that runs, for its
    /// caller, the function its positional argument `at` names
    /// ([`RpcFunction::runs`]).
    pub fn register_carrier<F, Fut>(
        &self,
        name: impl Into<String>,
        at: usize,
        f: F,
    ) -> Option<Arc<dyn RpcFunction>>
    where
        F: Fn(CallContext, Args) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Payload>> + Send + 'static,
    {
        self.register(
            name,
            Arc::new(Carrier {
                at,
                native: Native(f),
            }),
        )
    }

    /// Removes `name`; returns the function it named.
    pub fn unregister(&self, name: &str) -> Option<Arc<dyn RpcFunction>> {
        self.functions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
    }

    /// The function registered as `name`, else the first resolver's
    /// answer for it.
    pub fn get(&self, name: &str) -> Option<Arc<dyn RpcFunction>> {
        let registered = self
            .functions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned();
        registered.or_else(|| self.resolve(name))
    }

    /// The first resolver's answer for `name`, leaving the registered
    /// functions aside.
    pub fn resolve(&self, name: &str) -> Option<Arc<dyn RpcFunction>> {
        let resolvers = self
            .resolvers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        resolvers.iter().find_map(|r| r.resolve(name))
    }

    /// Every registered name, sorted (names a resolver serves are not
    /// listed).
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .functions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }
}

/// The resolver of builtin op names ([`crate::ops::BuiltinOps`]): a call
/// runs the op under the worker's op policy, in the call's tensor memory
/// budget.
#[derive(Debug, Clone, Copy, Default)]
pub struct Builtins;

impl FunctionResolver for Builtins {
    fn resolve(&self, name: &str) -> Option<Arc<dyn RpcFunction>> {
        let builtin =
            !name.starts_with(super::INTERNAL_PREFIX) && crate::ops::BuiltinOps::knows(name);
        builtin.then(|| Arc::new(BuiltinOp) as Arc<dyn RpcFunction>)
    }
}

/// A builtin op called by name; the name comes from the call's context.
struct BuiltinOp;

#[async_trait::async_trait]
impl RpcFunction for BuiltinOp {
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload> {
        let agent = ctx.agent();
        let name = ctx.function();
        let budget = agent.tensor_budget().call();
        crate::ops::run_builtin(
            &agent.options().op_policy,
            agent.name(),
            name,
            args,
            Some(budget),
        )
        .await
        .map_err(|e| e.context_line(format!("running {name} on worker {}", agent.name())))
    }

    fn profiled_as_ops(&self) -> bool {
        true
    }
}

/// Runs `f`, turning a panic into a `RuntimeError` naming the function.
pub(crate) async fn call_guarded(
    f: Arc<dyn RpcFunction>,
    ctx: CallContext,
    args: Args,
) -> Result<Payload> {
    let name = ctx.function().to_string();
    match AssertUnwindSafe(f.call(ctx, args)).catch_unwind().await {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::runtime(format!("function {name} panicked: {msg}")))
        }
    }
}
