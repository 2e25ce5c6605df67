//! The optional process-wide "current agent".

use std::sync::RwLock;

use super::RpcAgent;
use crate::error::{Error, Result};

static CURRENT: RwLock<Option<RpcAgent>> = RwLock::new(None);

/// The process-wide current agent.
///
/// # Errors
/// `RuntimeError` "RPC has not been initialized ..." if none is set or it
/// has shut down.
pub fn current_agent() -> Result<RpcAgent> {
    CURRENT
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .filter(RpcAgent::is_running)
        .ok_or_else(Error::not_initialized)
}

/// Makes `agent` the process-wide current agent.
///
/// # Errors
/// `RuntimeError` if another running agent is current already.
pub fn set_current_agent(agent: &RpcAgent) -> Result<()> {
    let mut slot = CURRENT.write().unwrap_or_else(|p| p.into_inner());
    if let Some(a) = slot.as_ref().filter(|a| a.is_running() && *a != agent) {
        return Err(Error::runtime(format!(
            "Current RPC agent is already set ({})",
            a.name()
        )));
    }
    *slot = Some(agent.clone());
    Ok(())
}

/// Clears the current agent.
pub fn reset_current_agent() {
    *CURRENT.write().unwrap_or_else(|p| p.into_inner()) = None;
}

/// Clears the current agent if it is `agent`.
pub(crate) fn reset_if(agent: &RpcAgent) {
    let mut slot = CURRENT.write().unwrap_or_else(|p| p.into_inner());
    if slot.as_ref() == Some(agent) {
        *slot = None;
    }
}
