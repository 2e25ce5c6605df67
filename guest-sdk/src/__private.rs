//! What the macros' generated code calls. Not API: names and signatures
//! change without notice.

use crate::convert::{FromValue, IntoValue};
use crate::{Error, Future, MaybeFuture, host, memory};
use core::any::Any;
use core::cell::RefCell;
use wasmrpc_abi::RemoteError;
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::{CallArgs, HostCall, Outcome};

pub use wasmrpc_abi::manifest::{Export, Record};
pub use wasmrpc_abi::protocol::ExportKind;

/// The arguments of one call, matched to the function's parameters.
#[derive(Debug)]
pub struct Args {
    function: &'static str,
    params: &'static [&'static str],
    slots: Vec<Option<Value>>,
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

impl Args {
    /// Matches positional and keyword arguments to `params`, with Python's
    /// error texts.
    ///
    /// # Errors
    /// A `TypeError` for too many, unexpected or repeated arguments.
    pub fn parse(
        function: &'static str,
        params: &'static [&'static str],
        call: CallArgs,
    ) -> Result<Args, Error> {
        if call.args.len() > params.len() {
            return Err(Error::type_error(format!(
                "{function}() takes {} positional argument{} but {} {} given",
                params.len(),
                plural(params.len()),
                call.args.len(),
                if call.args.len() == 1 { "was" } else { "were" },
            )));
        }
        let mut slots: Vec<Option<Value>> = call.args.into_iter().map(Some).collect();
        slots.resize(params.len(), None);
        for (name, value) in call.kwargs {
            let Some(i) = params.iter().position(|p| *p == name) else {
                return Err(Error::type_error(format!(
                    "{function}() got an unexpected keyword argument '{name}'"
                )));
            };
            if slots[i].is_some() {
                return Err(Error::type_error(format!(
                    "{function}() got multiple values for argument '{name}'"
                )));
            }
            slots[i] = Some(value);
        }
        Ok(Args {
            function,
            params,
            slots,
        })
    }

    /// Converts parameter `i`, or gives its default when it was left out.
    ///
    /// # Errors
    /// A `TypeError` for a missing required argument, or the conversion's
    /// error prefixed with the function and parameter names.
    pub fn take<T: FromValue>(&mut self, i: usize) -> Result<T, Error> {
        let name = self.params.get(i).copied().unwrap_or("?");
        match self.slots.get_mut(i).and_then(Option::take) {
            Some(v) => T::from_value(v).map_err(|e| {
                Error::new(
                    e.kind(),
                    format!("{}() argument '{name}': {}", self.function, e.message()),
                )
            }),
            None => T::missing().ok_or_else(|| {
                Error::type_error(format!(
                    "{}() missing 1 required positional argument: '{name}'",
                    self.function
                ))
            }),
        }
    }
}

/// What a plain function or method may return: a value, or a `Result` of one.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be returned from a remote function",
    note = "return a type that implements `IntoValue`, or a `Result` of one whose error converts into `wasmrpc_guest::Error`",
    note = "a `Future` is not a value (PyTorch: \"Can not pickle torch.futures.Future\"): return it from a `#[remote(async_execution)]` function, which completes with its value"
)]
pub trait IntoOutcome {
    /// The outcome to send to the host.
    fn into_outcome(self) -> Outcome;
}
impl<T: IntoValue> IntoOutcome for T {
    fn into_outcome(self) -> Outcome {
        Outcome::Return(self.into_value())
    }
}
impl<T: IntoValue, E: Into<Error>> IntoOutcome for Result<T, E> {
    fn into_outcome(self) -> Outcome {
        match self {
            Ok(v) => Outcome::Return(v.into_value()),
            Err(e) => Outcome::Raise(RemoteError::from(e.into())),
        }
    }
}

/// What an `async_execution` function may return: a [`Future`], or a
/// `Result` of one.
#[diagnostic::on_unimplemented(
    message = "an `async_execution` function must return a `wasmrpc_guest::Future`, not `{Self}`",
    note = "return `Future` or `Result<Future>` (`MaybeFuture` when the type is only known at run time); drop `async_execution` to return a value"
)]
pub trait IntoAsyncOutcome {
    /// The outcome to send to the host.
    fn into_async_outcome(self) -> Outcome;
}
impl IntoAsyncOutcome for Future {
    fn into_async_outcome(self) -> Outcome {
        Outcome::Future(self.into_raw())
    }
}
impl<E: Into<Error>> IntoAsyncOutcome for Result<Future, E> {
    fn into_async_outcome(self) -> Outcome {
        match self {
            Ok(f) => Outcome::Future(f.into_raw()),
            Err(e) => Outcome::Raise(RemoteError::from(e.into())),
        }
    }
}
impl IntoAsyncOutcome for MaybeFuture {
    fn into_async_outcome(self) -> Outcome {
        match self {
            MaybeFuture::Future(f) => Outcome::Future(f.into_raw()),
            // The host checks the kind of outcome and refuses this one.
            MaybeFuture::Value(v) => Outcome::Return(v.into_value()),
        }
    }
}
impl<E: Into<Error>> IntoAsyncOutcome for Result<MaybeFuture, E> {
    fn into_async_outcome(self) -> Outcome {
        match self {
            Ok(m) => m.into_async_outcome(),
            Err(e) => Outcome::Raise(RemoteError::from(e.into())),
        }
    }
}

/// What a constructor may return: the object, or a `Result` of it.
pub trait IntoObject<C> {
    /// The object, or the error the constructor raised.
    ///
    /// # Errors
    /// The constructor's error.
    fn into_object(self) -> Result<C, Error>;
}
impl<C> IntoObject<C> for C {
    fn into_object(self) -> Result<C, Error> {
        Ok(self)
    }
}
impl<C, E: Into<Error>> IntoObject<C> for Result<C, E> {
    fn into_object(self) -> Result<C, Error> {
        self.map_err(Into::into)
    }
}

fn install_panic_hook() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            // The instance traps right after this; the runtime attaches the
            // message to the trap's error.
            let _ = host::unit(&HostCall::Panicked(info.to_string()));
        }));
    });
}

/// The body of every export: read the arguments, run `body`, write the
/// outcome, return its packed address.
pub fn run(
    function: &'static str,
    params: &'static [&'static str],
    len: u32,
    body: impl FnOnce(&mut Args) -> Result<Outcome, Error>,
) -> u64 {
    install_panic_hook();
    let outcome = memory::read_input::<CallArgs>(len)
        .and_then(|call| Args::parse(function, params, call))
        .and_then(|mut args| body(&mut args))
        .unwrap_or_else(|e| Outcome::Raise(e.into()));
    memory::write_output(&outcome)
}

thread_local! {
    static OBJECTS: RefCell<Vec<Option<Box<dyn Any>>>> = const { RefCell::new(Vec::new()) };
}

/// Stores a new object and returns the outcome naming its id.
pub fn new_object<C: 'static>(object: C) -> Outcome {
    OBJECTS.with_borrow_mut(|objects| {
        let id = match objects.iter().position(Option::is_none) {
            Some(free) => {
                objects[free] = Some(Box::new(object));
                free
            }
            None => {
                objects.push(Some(Box::new(object)));
                objects.len() - 1
            }
        };
        // Ids are slab indices, far below u32::MAX in a 4 GiB memory.
        Outcome::Object(id as u32)
    })
}

/// Runs `f` on object `id` of class `C`. The object is taken out of the
/// table while `f` runs, so `f` may call the host freely.
///
/// # Errors
/// A `RuntimeError` if there is no such object of class `C`, or `f`'s error.
pub fn with_object<C: 'static>(
    id: u32,
    class: &str,
    f: impl FnOnce(&mut C) -> Result<Outcome, Error>,
) -> Result<Outcome, Error> {
    let taken =
        OBJECTS.with_borrow_mut(|objects| objects.get_mut(id as usize).and_then(Option::take));
    let Some(mut boxed) = taken else {
        return Err(Error::runtime_error(format!(
            "no {class} object with id {id}"
        )));
    };
    let result = match boxed.downcast_mut::<C>() {
        Some(object) => f(object),
        None => Err(Error::runtime_error(format!(
            "object {id} is not a {class}"
        ))),
    };
    OBJECTS.with_borrow_mut(|objects| {
        if let Some(slot) = objects.get_mut(id as usize) {
            *slot = Some(boxed);
        }
    });
    result
}

/// Drops object `id`, releasing the handles it held.
pub fn drop_object(id: u32) -> u64 {
    let taken =
        OBJECTS.with_borrow_mut(|objects| objects.get_mut(id as usize).and_then(Option::take));
    drop(taken);
    memory::write_output(&Outcome::Return(Value::None))
}
