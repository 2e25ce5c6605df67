//! [`Object`]: an instance of a plugin class (a seed's Python class held
//! in an RRef), living in an instance of its own whose method calls run one
//! at a time (actor semantics).

use crate::instance::CallCtx;
use crate::plugin::{Target, Warm};
use crate::runtime::finish;
use crate::visit::{self, Entered, Inbox, VisitTarget};
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
    /// Its own instance, or the one it shares with the other objects of a
    /// single-instance plugin on this worker ([`Object::module`]).
    instance: Arc<tokio::sync::Mutex<Option<Warm>>>,
    /// A single-instance plugin's: the calls waiting for the instance,
    /// which a call of it that waits on a future runs meanwhile
    /// ([`crate::visit`]).
    inbox: Option<Arc<Inbox>>,
}

/// What a function run in an object's instance gave.
#[derive(Debug)]
pub enum Called {
    /// A value (an async function's: its future's).
    Value(Value),
    /// An object it made in the instance, with this id (a single-instance
    /// plugin's function returning one of its objects to an owner-side
    /// `remote()`): [`Object::sibling`] holds it.
    Object(u32),
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
            instance: Arc::new(tokio::sync::Mutex::new(Some(warm))),
            inbox: None,
        }
    }

    /// The instance of a single-instance plugin on one worker, as an object
    /// of no class (id 0) whose functions run there one at a time
    /// ([`call_function`](Self::call_function)); the objects made there are
    /// its [`sibling`](Self::sibling)s.
    ///
    /// # Errors
    /// As [`Runtime::call`] when no instance can be had.
    pub async fn module(
        runtime: &Runtime,
        plugin: &Arc<Plugin>,
        folders: Option<Arc<crate::Folders>>,
    ) -> Result<Object> {
        let warm = plugin.checkout(folders).await?;
        let mut module = Object::new(runtime.clone(), plugin.clone(), "", 0, warm);
        module.inbox = Some(Arc::new(Inbox::default()));
        Ok(module)
    }

    /// The object `id` of class `class` made in this object's instance: it
    /// shares the instance (its methods queue with this object's calls),
    /// and disposing of it leaves the instance to the others.
    pub fn sibling(&self, class: &str, id: u32) -> Object {
        Object {
            runtime: self.runtime.clone(),
            plugin: self.plugin.clone(),
            class: class.to_owned(),
            id,
            instance: self.instance.clone(),
            inbox: self.inbox.clone(),
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
        let target = VisitTarget::Method {
            object: self.id,
            class: self.class.clone(),
            method: method.to_owned(),
        };
        let outcome = self.run(target, &args, &host, None, method).await?;
        let is_async = entry.kind == ExportKind::AsyncMethod;
        finish(self.plugin.name(), method, is_async, outcome, &host).await
    }

    /// Runs `target` in the instance, holding it; or, in a single-instance
    /// plugin's instance that a call holds while it waits on a future, as a
    /// visit that call's guest runs meanwhile ([`crate::visit`]). `wait`
    /// bounds the wait for the instance ([`Error::ObjectBusy`]).
    async fn run(
        &self,
        target: VisitTarget,
        args: &CallArgs,
        host: &Arc<dyn GuestHost>,
        wait: Option<std::time::Duration>,
        name: &str,
    ) -> Result<wasmrpc_abi::protocol::Outcome> {
        let busy = || Error::ObjectBusy {
            plugin: self.plugin.name().to_owned(),
            class: self.class.clone(),
            function: name.to_owned(),
            waited: wait.unwrap_or_default(),
        };
        let mut slot = match &self.inbox {
            Some(inbox) => {
                let ctx = CallCtx::new(host.clone(), self.plugin.clone(), self.runtime.clone());
                match visit::enter(&self.instance, inbox, target.clone(), args, ctx, wait).await {
                    Ok(Entered::Locked(slot)) => slot,
                    Ok(Entered::Visited(outcome)) => {
                        return outcome.map_err(|message| Error::Abi {
                            plugin: self.plugin.name().to_owned(),
                            function: name.to_owned(),
                            message,
                        });
                    }
                    Err(()) => return Err(busy()),
                }
            }
            None => match wait {
                None => self.instance.lock().await,
                Some(wait) => tokio::time::timeout(wait, self.instance.lock())
                    .await
                    .map_err(|_| busy())?,
            },
        };
        // Taken out while guest code runs: if this future is dropped
        // mid-call, the object is left broken rather than half-updated.
        let Some(mut warm) = slot.take() else {
            return Err(self.broken());
        };
        let ctx = CallCtx::serving(
            host.clone(),
            self.plugin.clone(),
            self.runtime.clone(),
            self.inbox.clone(),
        );
        let target = match &target {
            VisitTarget::Function(name) => Target::Function(name),
            VisitTarget::Constructor(class) => Target::Constructor(class),
            VisitTarget::Method {
                object,
                class,
                method,
            } => Target::Method {
                object: *object,
                class,
                method,
            },
        };
        let outcome = warm.invoke(ctx, target, args).await;
        if outcome.is_ok() {
            *slot = Some(warm);
        }
        outcome.map_err(|fault| fault.into_error(self.plugin.name(), name))
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
    ) -> Result<Called> {
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
        let target = VisitTarget::Function(function.to_owned());
        let outcome = self.run(target, &args, &host, wait, function).await;
        match outcome? {
            wasmrpc_abi::protocol::Outcome::Object(id) => Ok(Called::Object(id)),
            outcome => finish(self.plugin.name(), function, is_async, outcome, &host)
                .await
                .map(Called::Value),
        }
    }

    /// Runs the constructor of `class` in this object's instance: the new
    /// object is a [`sibling`](Self::sibling) (a single-instance plugin's
    /// objects all live in its one instance).
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown class, [`Error::Raised`] for the
    /// constructor's own error, [`Error::ObjectBroken`] after a trap, else
    /// as [`Runtime::construct`].
    pub async fn construct(
        &self,
        class: &str,
        args: CallArgs,
        host: Arc<dyn GuestHost>,
    ) -> Result<Object> {
        if self.plugin.entry(&format!("new:{class}")).is_none() {
            return Err(Error::NotFound {
                plugin: self.plugin.name().to_owned(),
                what: "class",
                name: class.to_owned(),
            });
        }
        let target = VisitTarget::Constructor(class.to_owned());
        match self.run(target, &args, &host, None, class).await? {
            wasmrpc_abi::protocol::Outcome::Object(id) => Ok(self.sibling(class, id)),
            wasmrpc_abi::protocol::Outcome::Raise(error) => Err(Error::Raised {
                plugin: self.plugin.name().to_owned(),
                function: class.to_owned(),
                error,
            }),
            other => Err(Error::Abi {
                plugin: self.plugin.name().to_owned(),
                function: class.to_owned(),
                message: format!("a constructor returned {other:?}"),
            }),
        }
    }

    /// Destroys the object: runs its Rust destructor in the guest (which
    /// releases the handles it held), then frees the instance.
    ///
    /// # Errors
    /// [`Error::ObjectBroken`] after a trap, or the destructor's trap.
    pub async fn dispose(self, host: Arc<dyn GuestHost>) -> Result<()> {
        let mut slot = self.instance.lock().await;
        let Some(mut warm) = slot.take() else {
            return Err(self.broken());
        };
        let ctx = CallCtx::new(host, self.plugin.clone(), self.runtime.clone());
        let target = Target::Drop {
            object: self.id,
            class: &self.class,
        };
        let outcome = warm.invoke(ctx, target, &CallArgs::default()).await;
        // A shared instance stays for the other objects and functions.
        if outcome.is_ok() && Arc::strong_count(&self.instance) > 1 {
            *slot = Some(warm);
        }
        outcome.map(drop).map_err(|fault| {
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
