//! [`RemoteModule`]: PyTorch's `torch.distributed.nn.RemoteModule` over
//! plugin classes.
//!
//! A module is an object of a plugin class that has a `forward` method
//! (seed-fns' `MyModule`); a `RemoteModule` is a small handle to one,
//! living on its owner: the owner's `remote_device`, the device, and the
//! RRef that holds the object (`module_rref`). Calls go to the RRef's
//! owner (not to `on`: a handle made with
//! [`RemoteModule::init_from_module_rref`] may name another worker).
//!
//! Devices: a module created on `worker1/cuda:N` has every tensor it holds
//! (its parameters) moved to `cuda:N` on the owner right after its
//! constructor ran (`_create_module`'s `module.to(device)`); a `forward`
//! moves the call's tensors there first and, unless the caller has a
//! device map toward the owner (`is_device_map_set`), brings the result's
//! tensors back to the CPU (`_remote_forward`). Unlike PyTorch, which
//! moves only top-level tensors, every tensor of the arguments and of the
//! result moves: a nested CUDA tensor could not travel without a map
//! anyway.
//!
//! What it owns: parsing `remote_device` strings with PyTorch's error
//! texts (the device part is [`crate::device::check_device_string`]'s),
//! the owner-side functions behind creation (`_create_module`, which checks
//! that the class made a module and places it), `forward`
//! (`_remote_forward`) and `remote_parameters` (`_param_rrefs`), and the
//! handle's wire form (a dict of PyTorch's six pickled attributes, in
//! their order, the RRef forked as any RRef in a payload). It leaves
//! objects, proxies and RRefs to the RRef module, plugin classes to the
//! plugin module, and device maps to [`crate::device`].
//!
//! Not supported: TorchScript interfaces (`is_scriptable` is always false),
//! devices other than the CPU and CUDA (`meta`, `mps`: refused at
//! creation).

use crate::abi::{ErrorKind, Value};
use crate::agent::{CallContext, Dest, FunctionRegistry, Future, RpcAgent, call_guarded};
use crate::device::{Device, check_available, check_device_string, has_device_map_to};
use crate::error::{Error, Result, unknown_function_message};
use crate::rref::{Owned, RRef, Remote, discard_kept_object, kept_object, type_name_of};
use crate::value::{Args, Payload};

/// The owner-side creation behind [`RemoteModule::new`] (internal).
pub(crate) const CREATE_MODULE: &str = "wasmrpc::_create_module";
/// The owner-side function behind [`RemoteModule::remote_parameters`]
/// (internal).
pub(crate) const PARAM_RREFS: &str = "wasmrpc::_param_rrefs";
/// The owner-side function behind [`RemoteModule::forward_async`]
/// (internal).
pub(crate) const REMOTE_FORWARD: &str = "wasmrpc::_remote_forward";

/// The attributes a `RemoteModule` travels with, in PyTorch's order
/// (`_REMOTE_MODULE_PICKLED_ATTRIBUTES`).
pub const REMOTE_MODULE_PICKLED_ATTRIBUTES: [&str; 6] = [
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
];

/// Where a module lives: a worker name, or a rank (`rank:N/...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteOn {
    /// `worker1/cpu`.
    Name(String),
    /// `rank:1/cpu`.
    Rank(u32),
}

impl RemoteOn {
    fn dest(&self) -> Dest {
        match self {
            RemoteOn::Name(n) => Dest::Name(n.clone()),
            RemoteOn::Rank(r) => Dest::Rank(i64::from(*r)),
        }
    }

    fn to_payload(&self) -> Payload {
        match self {
            RemoteOn::Name(n) => Payload::from(n.clone()),
            RemoteOn::Rank(r) => Payload::from(i64::from(*r)),
        }
    }
}

fn parse_error(s: &str) -> Error {
    Error::new(
        ErrorKind::ValueError,
        format!(
            "Could not parse remote_device: {s}. The valid format is '<workername>/<device>' or \
             'rank:<rank>/<device>' or '<device>'"
        ),
    )
}

/// Parses `remote_device` as PyTorch's `_remote_device`: `worker/device`,
/// `rank:N/device`, or a worker name alone (on the CPU).
///
/// # Errors
/// `ValueError` "Could not parse remote_device: ..." for anything else
/// (three fields, an empty worker, a device without a worker), and the
/// device's c10 errors ([`check_device_string`]). The device is returned
/// as written (`str(torch.device)`); [`RemoteModule::new`] checks it is
/// one RPC can place a module on.
pub fn parse_remote_device(s: &str) -> Result<(RemoteOn, String)> {
    let fields: Vec<&str> = s.split('/').collect();
    let (worker, device) = match fields.as_slice() {
        [worker, device] => (*worker, *device),
        [one] if check_device_string(one).is_err() => (*one, "cpu"),
        _ => return Err(parse_error(s)),
    };
    if worker.is_empty() {
        return Err(parse_error(s));
    }
    check_device_string(device)?;
    let device = device.to_owned();
    let on = match worker.strip_prefix("rank:") {
        Some(r) => RemoteOn::Rank(r.parse().map_err(|_| parse_error(s))?),
        None => RemoteOn::Name(worker.to_owned()),
    };
    Ok((on, device))
}

/// A module on a remote worker (`RemoteModule`): `forward` and
/// `forward_async` run it on its owner, `remote_parameters` returns RRefs
/// to its parameters, `train`/`eval` set its mode there.
///
/// ```no_run
/// # async fn f(agent: wasmrpc::RpcAgent) -> wasmrpc::Result<()> {
/// use wasmrpc::{RemoteModule, args};
/// let m = RemoteModule::new(&agent, "worker1/cpu", "seed_fns::MyModule", args![1])?;
/// let out = m.forward(&agent, args![tch::Tensor::from(1.0), 2, "3"]).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RemoteModule {
    on: RemoteOn,
    device: String,
    is_device_map_set: bool,
    is_scriptable: bool,
    generated_methods: Vec<String>,
    module_rref: RRef,
    /// Attributes set on this handle (`setattr(remote_module, name, v)`):
    /// they stay with it and are never part of the wire form.
    attributes: HandleAttributes,
}

/// A handle's own attributes. Behind a mutex only so that the handle stays
/// `Sync` (a [`Payload`] with tensors is not); a clone copies them.
#[derive(Debug, Default)]
struct HandleAttributes(std::sync::Mutex<Vec<(String, Payload)>>);

impl HandleAttributes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, Payload)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Clone for HandleAttributes {
    fn clone(&self) -> Self {
        HandleAttributes(std::sync::Mutex::new(self.lock().clone()))
    }
}

/// PyTorch's refusal of a RemoteModule pickled outside RPC.
pub const REMOTE_MODULE_PICKLE_OUTSIDE_RPC: &str =
    "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC";

/// A RemoteModule crosses the network only as a call's argument (its
/// [`to_payload`](RemoteModule::to_payload) form, whose RRef the agent
/// forks); any other serializer (serde's, the counterpart of
/// `torch.save`'s pickler) is refused with PyTorch's text.
impl serde::Serialize for RemoteModule {
    fn serialize<S: serde::Serializer>(&self, _: S) -> std::result::Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(REMOTE_MODULE_PICKLE_OUTSIDE_RPC))
    }
}

impl RemoteModule {
    /// Creates an object of the plugin class `module_cls` (registered name,
    /// e.g. `seed_fns::MyModule`) with `args` on `remote_device`'s worker,
    /// asynchronously (`rpc.remote`): a class whose objects are not modules
    /// (no `forward`) or a constructor error surfaces on first use.
    ///
    /// On `cuda:N`, the owner moves the module's tensors there after
    /// construction; an index the owner does not have is a `RuntimeError`
    /// "CUDA error: invalid device ordinal" that surfaces on first use, as
    /// the constructor's errors do.
    ///
    /// # Errors
    /// The errors of [`parse_remote_device`]; `RuntimeError` "RPC supports
    /// CPU and CUDA devices only" for other device types; those of
    /// [`crate::Remote::remote`].
    pub fn new(
        agent: &RpcAgent,
        remote_device: &str,
        module_cls: &str,
        args: Args,
    ) -> Result<RemoteModule> {
        let (on, device) = parse_remote_device(remote_device)?;
        crate::device::parse_device(device.as_str())
            .map_err(|e| e.context_line(format!("RemoteModule on {remote_device}")))?;
        let call = args.prepend([Payload::from(module_cls), Payload::from(device.as_str())]);
        let module_rref = agent.remote(on.dest(), CREATE_MODULE, call)?;
        let map_set = agent
            .resolve(on.dest())
            .is_ok_and(|w| has_device_map_to(agent, &w.name));
        let mut m = Self::with_rref(on, device, module_rref);
        m.is_device_map_set = map_set;
        Ok(m)
    }

    /// A second handle to the module `module_rref` holds, naming
    /// `remote_device` (`RemoteModule.init_from_module_rref`): nothing is
    /// created, and calls still go to the RRef's owner.
    ///
    /// # Errors
    /// The errors of [`parse_remote_device`].
    pub fn init_from_module_rref(remote_device: &str, module_rref: RRef) -> Result<RemoteModule> {
        let (on, device) = parse_remote_device(remote_device)?;
        Ok(Self::with_rref(on, device, module_rref))
    }

    fn with_rref(on: RemoteOn, device: String, module_rref: RRef) -> RemoteModule {
        RemoteModule {
            on,
            device,
            is_device_map_set: false,
            is_scriptable: false,
            generated_methods: vec!["forward_async".into(), "forward".into()],
            module_rref,
            attributes: HandleAttributes::default(),
        }
    }

    /// Sets an attribute of this handle (`setattr(remote_module, name,
    /// value)`), replacing one of the same name. Like an attribute added to
    /// a Python `RemoteModule`, it is local to the handle: the wire form
    /// ([`to_payload`](Self::to_payload)) carries only
    /// [`REMOTE_MODULE_PICKLED_ATTRIBUTES`], so a receiver never sees it.
    pub fn set_attribute(&mut self, name: &str, value: Payload) {
        let mut attributes = self.attributes.lock();
        match attributes.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v = value,
            None => attributes.push((name.to_owned(), value)),
        }
    }

    /// A copy of the attribute `name` set with
    /// [`set_attribute`](Self::set_attribute).
    pub fn attribute(&self, name: &str) -> Option<Payload> {
        self.attributes
            .lock()
            .iter()
            .find_map(|(n, v)| (n == name).then(|| v.clone()))
    }

    /// The worker named by `remote_device` (`on`).
    pub fn on(&self) -> &RemoteOn {
        &self.on
    }

    /// The device (`device`), e.g. `cpu`.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Whether the creating worker had a device map toward `on`
    /// (`is_device_map_set`): then `forward` returns the result's tensors
    /// where the module left them, through the map, instead of on the CPU.
    pub fn is_device_map_set(&self) -> bool {
        self.is_device_map_set
    }

    /// Whether the module has a typed interface (`is_scriptable`; always
    /// false: no TorchScript).
    pub fn is_scriptable(&self) -> bool {
        self.is_scriptable
    }

    /// The methods the handle serves (`generated_methods`).
    pub fn generated_methods(&self) -> &[String] {
        &self.generated_methods
    }

    /// The RRef holding the module (`get_module_rref()`).
    pub fn get_module_rref(&self) -> &RRef {
        &self.module_rref
    }

    /// `forward_async(*args, **kwargs)`: the future of `forward` run on the
    /// module's owner (`_remote_forward`): on a CUDA module, the call's
    /// tensors move to its device first, and the result's come back to
    /// the CPU unless [`is_device_map_set`](Self::is_device_map_set).
    pub fn forward_async(&self, agent: &RpcAgent, args: Args) -> Future {
        let call = args.prepend([
            Payload::from(&self.module_rref),
            Payload::from(self.device.as_str()),
            Payload::from(self.is_device_map_set),
        ]);
        agent.rpc_async(Dest::Info(self.module_rref.owner()), REMOTE_FORWARD, call)
    }

    /// `forward(*args, **kwargs)` on the module's owner.
    ///
    /// # Errors
    /// The module's creation error (e.g. `ValueError` "Expect
    /// \`module_cls(*args, **kwargs)\` returns an instance of `<class
    /// nn.Module>`, ..."), and `forward`'s errors.
    pub async fn forward(&self, agent: &RpcAgent, args: Args) -> Result<Payload> {
        self.forward_async(agent, args).wait().await
    }

    /// RRefs to the module's parameters, owned by the module's owner
    /// (`remote_parameters(recurse)`).
    ///
    /// # Errors
    /// The module's creation error, or its `parameters` method's.
    pub async fn remote_parameters(&self, agent: &RpcAgent, recurse: bool) -> Result<Vec<RRef>> {
        let p = agent
            .rpc_sync(
                Dest::Info(self.module_rref.owner()),
                PARAM_RREFS,
                crate::args![&self.module_rref, recurse],
            )
            .await?;
        p.items()?.iter().map(Payload::as_rref).collect()
    }

    /// `train(mode)`: sets the module's training mode on its owner and
    /// returns what the module's `train` returned.
    ///
    /// # Errors
    /// The module's creation error, or its `train` method's.
    pub async fn train(&self, agent: &RpcAgent, mode: bool) -> Result<Payload> {
        self.module_rref
            .rpc_sync(agent, None)
            .call("train", crate::args![mode])
            .await
    }

    /// `eval()`: `train(false)`.
    ///
    /// # Errors
    /// As [`train`](Self::train).
    pub async fn eval(&self, agent: &RpcAgent) -> Result<Payload> {
        self.train(agent, false).await
    }

    /// The wire form: a dict of [`REMOTE_MODULE_PICKLED_ATTRIBUTES`] in
    /// order, and nothing else (not the handle's own attributes); sent in a
    /// call's arguments, the RRef forks as any RRef.
    pub fn to_payload(&self) -> Payload {
        Payload::dict([
            (Payload::from("on"), self.on.to_payload()),
            (Payload::from("device"), Payload::from(self.device.clone())),
            (
                Payload::from("is_device_map_set"),
                Payload::from(self.is_device_map_set),
            ),
            (
                Payload::from("is_scriptable"),
                Payload::from(self.is_scriptable),
            ),
            (
                Payload::from("generated_methods"),
                Payload::list(
                    self.generated_methods
                        .iter()
                        .map(|m| Payload::from(m.clone())),
                ),
            ),
            (
                Payload::from("module_rref"),
                Payload::from(&self.module_rref),
            ),
        ])
    }

    /// Rebuilds a handle from [`to_payload`](Self::to_payload)'s form.
    ///
    /// # Errors
    /// `TypeError` for a payload that is not a RemoteModule's.
    pub fn from_payload(p: &Payload) -> Result<RemoteModule> {
        let field = |k: &str| {
            p.get(k)?.ok_or_else(|| {
                Error::new(
                    ErrorKind::TypeError,
                    format!("not a RemoteModule: no attribute {k}"),
                )
            })
        };
        let on = field("on")?;
        let on = match &on.value {
            Value::Int(r) => RemoteOn::Rank(
                u32::try_from(*r).map_err(|_| Error::value(format!("invalid rank {r}")))?,
            ),
            _ => RemoteOn::Name(on.as_str()?.to_owned()),
        };
        Ok(RemoteModule {
            on,
            device: field("device")?.as_str()?.to_owned(),
            is_device_map_set: field("is_device_map_set")?.as_bool()?,
            is_scriptable: field("is_scriptable")?.as_bool()?,
            generated_methods: field("generated_methods")?
                .items()?
                .iter()
                .map(|m| m.as_str().map(ToOwned::to_owned))
                .collect::<Result<_>>()?,
            module_rref: field("module_rref")?.as_rref()?,
            attributes: HandleAttributes::default(),
        })
    }
}

fn not_a_module(type_name: &str) -> Error {
    Error::new(
        ErrorKind::ValueError,
        format!(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, but \
             it returns an instance of {type_name}."
        ),
    )
}

/// The module `rref` holds, on its owner `agent`, for `api`.
///
/// # Errors
/// The module's creation error; `RuntimeError` if `agent` does not own
/// `rref`; `TypeError` if it holds a value, not a module.
async fn owned_module(
    agent: &RpcAgent,
    rref: &RRef,
    api: &str,
) -> Result<std::sync::Arc<dyn crate::rref::RRefObject>> {
    let state = rref.owner_state().ok_or_else(|| {
        Error::runtime(format!(
            "{api} of {rref}: worker {} does not own it",
            agent.name()
        ))
    })?;
    match state.owned().await? {
        Owned::Object(module) => Ok(module),
        Owned::Value(_) => Err(Error::new(
            ErrorKind::TypeError,
            format!("{api} of {rref}: it does not hold a module"),
        )),
    }
}

/// RemoteModule on the agent: its owner-side functions.
pub(crate) struct RemoteModules;

impl crate::agent::Extension for RemoteModules {
    fn name(&self) -> &'static str {
        "remote_module"
    }

    fn register(&self, functions: &FunctionRegistry) {
        register(functions);
    }
}

/// Registers the owner-side functions in the agent's internal registry.
fn register(r: &FunctionRegistry) {
    // `_create_module(cls, *args, **kwargs)`: runs as the function of the
    // owner-side remote(), so the class's constructor keeps its object for
    // the RRef; a result that is not a module is the ValueError instead.
    r.register_native(CREATE_MODULE, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let cls = args.get(0)?.as_str()?.to_owned();
        let device = crate::device::parse_device(args.get(1)?.as_str()?)?;
        let rest = Args {
            positional: args.positional.get(2..).unwrap_or_default().to_vec(),
            kwargs: args.kwargs.clone(),
            tensors: args
                .tensors
                .iter()
                .map(tch::Tensor::shallow_clone)
                .collect(),
            rrefs: args.rrefs.clone(),
        };
        let Some(f) = agent.lookup_function(&cls) else {
            return Err(Error::runtime(unknown_function_message(&cls, agent.name())));
        };
        let call = CallContext::new(
            agent.clone(),
            ctx.caller().clone(),
            cls.clone(),
            ctx.fields().clone(),
        );
        let value = call_guarded(f, call, rest).await?;
        match kept_object() {
            Some(o) if o.has_method("forward") => {
                if device != Device::Cpu {
                    let placed = check_available(device).and_then(|()| o.to_device(device));
                    if let Err(e) = placed {
                        drop(o);
                        discard_kept_object();
                        return Err(e.context_line(format!(
                            "placing {cls} on {device} of worker {}",
                            agent.name()
                        )));
                    }
                }
                Ok(value)
            }
            Some(o) => {
                let name = o.type_name().to_owned();
                drop(o);
                discard_kept_object();
                Err(not_a_module(&name))
            }
            None => Err(not_a_module(&type_name_of(&value))),
        }
    });
    // `_remote_forward(module_rref, device, is_device_map_set, *args,
    // **kwargs)`: the module's `forward` on its owner, around the device
    // moves.
    r.register_native(REMOTE_FORWARD, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let rref = args.get(0)?.as_rref()?;
        let device = crate::device::parse_device(args.get(1)?.as_str()?)?;
        let map_set = args.get(2)?.as_bool()?;
        let module = owned_module(&agent, &rref, "forward").await?;
        let moved = |tensors: &[tch::Tensor], to: Device| {
            tensors
                .iter()
                .map(|t| t.f_to_device(to.to_tch()))
                .collect::<std::result::Result<Vec<_>, _>>()
        };
        let call = Args {
            positional: args.positional.get(3..).unwrap_or_default().to_vec(),
            kwargs: args.kwargs.clone(),
            tensors: if device == Device::Cpu {
                args.tensors
                    .iter()
                    .map(tch::Tensor::shallow_clone)
                    .collect()
            } else {
                moved(&args.tensors, device)?
            },
            rrefs: args.rrefs.clone(),
        };
        let mut out = module
            .call_method(&agent, ctx.caller(), "forward", call)
            .await?;
        if device != Device::Cpu && !map_set {
            out.tensors = moved(&out.tensors, Device::Cpu)?;
        }
        Ok(out)
    });
    // `_param_rrefs(module_rref, recurse)`: the module's parameters, each
    // in a new owner RRef.
    r.register_native(PARAM_RREFS, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let rref = args.get(0)?.as_rref()?;
        let recurse = args.get(1)?.as_bool()?;
        let module = owned_module(&agent, &rref, "remote_parameters").await?;
        let params = module
            .call_method(&agent, ctx.caller(), "parameters", crate::args![recurse])
            .await?;
        let rrefs: Vec<Payload> = params
            .items()?
            .into_iter()
            .map(|p| Payload::from(RRef::new(&agent, p)))
            .collect();
        Ok(Payload::list(rrefs))
    });
}

#[cfg(test)]
mod tests;
