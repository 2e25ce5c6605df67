//! The RRef feature on the agent ([`RRefs`], an [`Extension`]): its owner
//! functions, its protocol requests, how RRefs cross the wire inside values
//! (fork records), the deletion step of graceful shutdown and the leak
//! check (RREF-5); and how RRefs live in payloads ([`Handle`]s).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use super::RRef;
use super::context::{self, context};
use super::message::{KINDS, RRefMessage};
use crate::abi::{Value, WorkerInfo};
use crate::agent::{Extension, FunctionRegistry, HandleCodec, Request, RpcAgent, Run};
use crate::error::{Error, Result};
use crate::transport::MessageKind;
use crate::value::{Handle, HandleObject, Payload};

/// The RRef feature.
pub(crate) struct RRefs;

impl Extension for RRefs {
    fn name(&self) -> &'static str {
        "rref"
    }

    fn register(&self, functions: &FunctionRegistry) {
        super::functions::register(functions);
    }

    fn message_kinds(&self) -> &'static [MessageKind] {
        KINDS
    }

    /// Applies the request to the context at once, on the reader (the
    /// protocol relies on each connection's order), and acknowledges it.
    fn serve_request(&self, agent: &RpcAgent, request: Request) -> Run {
        let r = request
            .decode(RRefMessage::kind)
            .and_then(|message| context(agent).on_message(agent, message))
            .map(|()| Payload::none());
        futures::future::ready(r).boxed()
    }

    fn handles(&self) -> Option<&dyn HandleCodec> {
        Some(self)
    }

    fn worker_failed(&self, agent: &RpcAgent, failed: &WorkerInfo, _cause: &str) {
        context(agent).forget_forks_of(agent, failed.id);
    }

    fn shutdown(&self, agent: &RpcAgent) -> Option<BoxFuture<'static, Result<()>>> {
        let agent = agent.clone();
        Some(Box::pin(async move {
            context(&agent)
                .delete_all_users_and_unforked_owners(&agent, Duration::ZERO)
                .await
        }))
    }

    fn stopped(&self, agent: &RpcAgent) -> Result<()> {
        context(agent).destroy()
    }

    fn debug_info(&self, agent: &RpcAgent) -> BTreeMap<String, String> {
        context(agent).debug_info()
    }
}

impl HandleCodec for RRefs {
    fn encode(
        &self,
        agent: &RpcAgent,
        to: &WorkerInfo,
        value: Value,
        handles: &[Handle],
    ) -> Result<Value> {
        context::to_wire(agent, to, value, handles)
    }

    fn decode(&self, agent: &RpcAgent, value: Value, handles: &mut Vec<Handle>) -> Result<Value> {
        context::from_wire(agent, value, handles)
    }

    fn ready(&self, agent: &RpcAgent, handles: &[Handle]) -> Option<BoxFuture<'static, ()>> {
        let pending = handles
            .iter()
            .filter_map(|h| h.downcast_ref::<RRef>())
            .any(|r| !r.confirmed_by_owner());
        pending.then(|| context::wait_confirmed(agent.clone(), handles.to_vec()).boxed())
    }
}

impl HandleObject for RRef {}

impl From<RRef> for Payload {
    fn from(r: RRef) -> Self {
        Payload {
            value: Value::RRef(0),
            tensors: Vec::new(),
            rrefs: vec![Handle::new(r)],
        }
    }
}

impl From<&RRef> for Payload {
    fn from(r: &RRef) -> Self {
        r.clone().into()
    }
}

impl Payload {
    /// The value as an RRef (a handle to the same RRef object).
    ///
    /// # Errors
    /// `TypeError` for any other value, `RuntimeError` for an index outside
    /// the RRef table.
    pub fn as_rref(&self) -> Result<RRef> {
        match &self.value {
            Value::RRef(i) => self
                .rrefs
                .get(*i as usize)
                .and_then(|h| h.downcast_ref::<RRef>())
                .cloned()
                .ok_or_else(|| {
                    Error::runtime(format!(
                        "RRef index {i} outside the payload's table of {}",
                        self.rrefs.len()
                    ))
                }),
            _ => Err(self.mismatch("RRef")),
        }
    }
}
