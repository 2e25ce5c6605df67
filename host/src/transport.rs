//! Moving messages between workers: frames, authenticated TCP connections,
//! fault injection. No RPC semantics: a message is bytes its owner encodes
//! (the agent's protocol is `crate::agent::message`), labelled with a
//! [`MessageKind`].
//!
//! - `frame`: a frame is a 4-byte length, a postcard header (the message's
//!   bytes, its tensor table, its blob sizes), then the raw bytes of every
//!   tensor storage.
//!   Storages are written from tensor memory with vectored writes and read
//!   into fresh tensor memory; nothing is copied through a buffer. A frame
//!   may name storages that crossed in shared memory instead (TR-9).
//! - `handshake`: mutual authentication with the cluster secret (HMAC-SHA256
//!   over both sides' nonces, bound to the agent protocol and both workers'
//!   names and ranks) before any frame is accepted: the agent's adapter over
//!   `wasmrpc-net`, which owns the exchange for the c10d mesh too (NET-1 to
//!   NET-6). The secret comes from the operator only, never from the store
//!   (`agent::rendezvous`, JOIN-3); a worker without one runs
//!   unauthenticated, which only loopback addresses allow unless
//!   `--insecure`.
//! - `tcp`: one connection per pair of workers, opened lazily by whichever
//!   side sends first and used in both directions; `TCP_NODELAY` on. Its
//!   reader busy-polls the socket between messages that come close
//!   together (`tcp::busy_poll`, BUSY-1 to BUSY-9), under TLS too.
//! - `tls`: TLS 1.3 with mutual authentication when the worker has TLS
//!   credentials (from `wasmrpc-credentials`, which also makes the cluster
//!   CA and the certificates that name their worker, and whose TLS stream
//!   has halves that read and write without a lock between them).
//! - `shm`: the same-host shared-memory channel: storages of 1 MiB and more
//!   to a peer on this host cross in memfd segments lent over a Unix
//!   socket that only the two authenticated workers share, and CUDA
//!   storages in CUDA segments (device memory exported through CUDA IPC
//!   handles, `shm::cuda`).
//! - `tcp::liveness`: the watchdog that sends heartbeats on idle
//!   connections and fails a connection whose peer went silent for the
//!   failure window (`RpcBackendOptions::failure_timeout`), by the network
//!   layer's rules (`wasmrpc_net::liveness`, LIVE-1 to LIVE-3).
//! - `traffic`: the bytes and frames each peer's connections carried, by
//!   channel, and the connections refused, by reason (TRAFFIC-1, TRAFFIC-2).
//! - `fault`: make the first N sends of given message kinds fail, or delay
//!   them, for the seeds' faulty-agent tests.
//!
//! Invariants:
//! - TR-1: nothing a peer sends can panic a worker. A malformed, truncated or
//!   oversized frame closes only its connection, with a logged `tracing`
//!   error.
//! - TR-2: no frame is read from a connection before the handshake proved the
//!   peer knows the cluster secret (the empty secret of an unauthenticated
//!   worker proves nothing, and matches no other secret).
//! - TR-3: frames on one connection are delivered in the order they were
//!   queued.
//! - TR-4: when a connection closes, its handler hears of it exactly once, so
//!   the agent can fail the calls that were pending on it.
//! - TR-5: a frame is written by the task that sends it when nothing is
//!   queued on the connection and the socket takes the whole frame without
//!   waiting (the common small call: no task switch, no wake-up); otherwise
//!   it, and every frame after it, goes through the connection's writer
//!   task, which owns the write half until its queue is empty. A sender
//!   never waits for another's write: one that finds another sender
//!   writing leaves its frame in the connection's backlog, and whoever
//!   holds the write half writes the whole backlog in one vectored write
//!   before letting go (under load, many frames per syscall). A frame is
//!   never split between two writers. Over TLS the same holds with the
//!   records flushed too: a sender whose frame is sealed but cannot all be
//!   sent at once hands the half to the writer task, which flushes once its
//!   queue is empty.
//! - TR-6: a refused connection (bad handshake, bad certificate, timeout)
//!   is one WARN line, and at most one such line per second per worker,
//!   counting the refusals suppressed since the last; the cause never
//!   includes a secret.
//! - TR-7 (TLS): see `tls` (TLS-1 to TLS-3): with TLS credentials, no byte
//!   of the agent's protocol is read before the peer proved a certificate
//!   of the cluster CA, and a peer only passes under the name its
//!   certificate gives.
//! - TR-8: at most `MAX_HANDSHAKES_PER_ADDRESS` sockets from one address,
//!   and `MAX_HANDSHAKES` in all, are in their handshake at once; a new
//!   socket over a limit ends the oldest handshake of its address (or of
//!   all), so sockets that connect and stall can neither exhaust the
//!   worker nor lock out a real peer (`tcp::admission`).
//! - TR-9: between workers on one host, a storage of at least 1 MiB may
//!   cross in a shared-memory segment instead of the connection (`shm`,
//!   SHM-1 to SHM-5): offered only to a peer that proved itself, copied
//!   out by the receiver before use, refused unless sealed against
//!   resizing; the connection stays the fallback and carries the frame.
//!   A CUDA storage that lands on a CUDA device crosses in a CUDA segment
//!   of any size (SHM-6, SHM-7); without one it is staged in host memory.
//! - TR-10: while other work is in progress on a connection (calls awaiting
//!   its responses, calls served from it: `tcp::Work`), a frame waits in
//!   the backlog for a flush task instead of being written by its sender,
//!   so the frames of a burst leave in one vectored write; the flush runs
//!   once the sending worker's ready tasks have run, or after at most 61 of
//!   them (tokio's event interval). A lone call's frame, and a frame with
//!   shared-memory storages, is written as TR-5 says.
//! - TR-11: with a failure window, a connection whose peer sent nothing
//!   (no frame, no heartbeat) for the window is closed, its handler told
//!   why first (`tcp::liveness`, LIVE-2); idle connections carry heartbeats
//!   and busy ones none (LIVE-1).

mod fault;
mod frame;
mod handshake;
mod kind;
mod shm;
mod tcp;
mod tls;
mod traffic;

pub use fault::FaultInjection;
pub use kind::MessageKind;

pub(crate) use frame::OutFrame;
pub use handshake::generate_secret;
pub use tcp::DEFAULT_FAILURE_TIMEOUT;
pub(crate) use tcp::{Connection, Handler, Transport, TransportConfig, Work, busy_poll_back_offs};
pub(crate) use tls::TlsEndpoints;
pub use tls::{
    CertificateAuthority, TLS_CA_ENV, TLS_CA_PEM_ENV, TLS_CERT_ENV, TLS_CERT_PEM_ENV, TLS_KEY_ENV,
    TLS_KEY_PEM_ENV, TlsCredentials, worker_dns_name,
};
pub use traffic::{Channel, PeerTraffic, RefusalReason};

/// Handshake helpers for tests that play a foreign peer.
pub mod probe {
    pub use super::handshake::{connect, probe};
    pub use super::tls::{TlsProbe, connect_tls, probe_tls};
}

/// The default maximum size of one frame (header plus storages): 2 GiB.
pub const DEFAULT_MAX_FRAME_SIZE: u64 = 2 << 30;
