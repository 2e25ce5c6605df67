//! [`MessageKind`]: the label a sender gives each frame, for fault
//! injection and logs.

use std::fmt;

/// What kind of message a frame carries, as its owner names it: the agent's
/// calls and responses, and each feature's own requests (RRef forks,
/// gradients, plugin deployment, ...). The transport reads nothing into it:
/// it selects the sends that [`FaultInjection`](super::FaultInjection)
/// fails or delays, and names the frame in errors. Every kind in use is
/// listed in `wasmrpc::message_kinds`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageKind(&'static str);

impl MessageKind {
    /// A kind named `name` (as errors and logs print it).
    pub const fn new(name: &'static str) -> Self {
        MessageKind(name)
    }

    /// The kind's name.
    pub fn name(self) -> &'static str {
        self.0
    }
}

impl fmt::Debug for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}
