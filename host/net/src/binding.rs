//! What a handshake is bound to: the protocol, its context, and the
//! identities both sides claim.

use serde::{Deserialize, Serialize};

/// A protocol that opens connections with this crate's handshake: its name
/// (in the MAC labels and the transcript) and the 4-byte magic a side sends
/// first. Only the protocols defined here exist, so their labels cannot
/// collide (NET-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol {
    name: &'static str,
    magic: [u8; 4],
}

impl Protocol {
    /// The agent's transport (`wasmrpc::transport`).
    pub const AGENT: Protocol = Protocol {
        name: "agent",
        magic: *b"WRPC",
    };
    /// The `tcp` process-group backend's mesh (`wasmrpc-c10d`).
    pub const C10D: Protocol = Protocol {
        name: "c10d",
        magic: *b"WC10",
    };

    /// Its name: `"agent"` or `"c10d"`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The 4 bytes each side sends before its first message.
    pub fn magic(&self) -> [u8; 4] {
        self.magic
    }
}

/// What a handshake's proofs are bound to besides the connection's nonces
/// and the two identities: the protocol and its context (the c10d group's
/// name; nothing for the agent, whose workers form one group per secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    protocol: Protocol,
    context: String,
}

impl Binding {
    /// The agent's connections.
    pub fn agent() -> Self {
        Self {
            protocol: Protocol::AGENT,
            context: String::new(),
        }
    }

    /// The mesh connections of c10d group `group`.
    pub fn c10d(group: &str) -> Self {
        Self {
            protocol: Protocol::C10D,
            context: group.to_owned(),
        }
    }

    /// The protocol.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The context (the c10d group's name; empty for the agent).
    pub fn context(&self) -> &str {
        &self.context
    }
}

impl std::fmt::Display for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.context.is_empty() {
            write!(f, "the {} protocol", self.protocol.name)
        } else {
            write!(f, "{} group {}", self.protocol.name, self.context)
        }
    }
}

/// Who a side claims to be: a worker name (empty if it has none, as a c10d
/// rank) and/or a rank. With a secret the claim is covered by the side's
/// MAC; what the claim must be is the caller's to check.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Identity {
    /// The worker's name; empty when the side claims none.
    pub name: String,
    /// The rank, if the side claims one.
    pub rank: Option<u64>,
}

impl Identity {
    /// Worker `name` at `rank`.
    pub fn worker(name: &str, rank: u64) -> Self {
        Self {
            name: name.to_owned(),
            rank: Some(rank),
        }
    }

    /// A side known by its rank only.
    pub fn of_rank(rank: u64) -> Self {
        Self {
            name: String::new(),
            rank: Some(rank),
        }
    }
}

impl std::fmt::Display for Identity {
    /// `worker {name}`, or `rank {rank}` without a name.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.name, self.rank) {
            (name, _) if !name.is_empty() => write!(f, "worker {name}"),
            (_, Some(rank)) => write!(f, "rank {rank}"),
            _ => f.write_str("an anonymous peer"),
        }
    }
}
