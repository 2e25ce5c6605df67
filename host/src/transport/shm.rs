//! The same-host shared-memory channel (TR-9): large tensor storages
//! between two workers on one host cross through shared memory instead of
//! the connection's socket.
//!
//! How it is set up: every transport listens on an abstract Unix socket
//! (`SOCK_SEQPACKET`) with a random name. An acceptor offers that name and
//! a fresh token in its handshake (its extension, sent after the dialer's
//! proof: `handshake`, NET-5), so the offer only
//! ever reaches a peer that proved itself (and, with TLS, travels
//! encrypted). The dialer connects to the name (which only succeeds on the
//! same host, in the same network namespace), sends the token, and waits
//! for the acceptor's acknowledgement; the acceptor hands the socket to the
//! connection the token was made for. That socket is the connection's
//! [`ShmLink`]; without one (another host, a refused or slow link, shared
//! memory switched off), everything goes over the connection as before.
//!
//! What crosses: a storage of at least [`SHARE_THRESHOLD`] bytes is copied
//! into a *segment*, a memfd the sender owns and keeps mapped, whose
//! descriptor it sends once over the link; the frame then names the
//! segment instead of carrying the bytes. The receiver maps each segment
//! it is given read-only, copies the storage out into its own tensor
//! memory, and tells the sender the segment is free again, so a segment is
//! reused with its pages already in place (a fresh 64 MiB memfd costs about
//! four copies' time in page allocation on its first fill).
//!
//! Invariants:
//! - SHM-1: a receiver never uses shared memory as tensor memory: it copies
//!   the bytes out before anything reads them, so what a peer writes into a
//!   segment later cannot change a tensor that was received (a hostile
//!   sender can only send other bytes, as it could over TCP).
//! - SHM-2: a receiver maps only memfds sealed against shrinking and
//!   growing, exactly the size announced, read-only: a peer can neither
//!   make the receiver fault (`SIGBUS` on a truncated mapping) nor write to
//!   its memory. Anything else on the link (another kind of descriptor,
//!   several descriptors, unknown segments, more than [`MAX_PEER_SEGMENTS`]
//!   segments) fails the link, and frames that name segments then fail the
//!   connection as a malformed frame would.
//! - SHM-3: a sender writes into a segment only while it is not lent: from
//!   the moment a frame names it until the receiver gives it back.
//! - SHM-4: the link is set up only for a peer that passed the handshake,
//!   with a token made for that connection and used once.
//! - SHM-5: a sender fills a segment after queueing the frame that names
//!   it, publishing after each chunk how far it got in the segment's first
//!   bytes; the receiver copies out behind that mark, so the two copies of
//!   a storage overlap. A mark that never reaches the storage's end fails
//!   the frame after [`LINK_TIMEOUT`], and a segment is reused only once
//!   it is both filled and given back. Neither side holds its runtime's
//!   thread for long (LIVE-2): fills of [`LONG_COPY`] and more, and the
//!   unmapping of segments given up, run on tokio's blocking pool; a copy
//!   out lets the thread's other tasks run after each [`COPY_STRETCH`].
//! - SHM-6: a CUDA storage crosses through a *CUDA segment* ([`cuda`]),
//!   device memory the sender allocated for the link and copied the
//!   storage into: a peer is never given a handle to tensor memory itself,
//!   whose allocation (a block of libtorch's caching allocator) holds other
//!   tensors too. A CUDA segment's handle travels on the link when the
//!   segment is made, and the sender fills it before queueing the frame
//!   that names it (no fill mark: the copy takes microseconds).
//! - SHM-7: a receiver copies out of a CUDA segment only into a tensor it
//!   allocated on the device the sender's device map chose, and only for a
//!   storage that every tensor using it reads as a dense tensor on that one
//!   device (`tensor::cuda_landings`); it opens a segment's handle only
//!   then, and refuses one that maps fewer bytes than its record said.
//!   A CUDA segment named for any other storage (one landing in host
//!   memory, on several devices, or read as a sparse tensor's part) makes
//!   the frame malformed. (A CUDA storage may still cross in a host
//!   segment: one staged in host memory, when no CUDA segment took it.)

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, oneshot};

use super::handshake::random_bytes;

mod cuda;
mod link;
mod slot;
#[cfg(test)]
mod tests;

pub(crate) use link::{Lent, ShmLink};
pub(crate) use slot::ShmSlot;

/// Bytes at the start of each segment before its storage: the fill mark
/// (SHM-5), alone in its cache line.
pub(crate) const SEGMENT_HEADER: usize = 64;
/// How much a sender copies into a segment between two publications of
/// its fill mark.
pub(crate) const FILL_CHUNK: usize = 1 << 20;
/// Storages from this size on are filled after their frame is queued, the
/// receiver copying behind (SHM-5); smaller ones, a chunk or two, are
/// filled before, so the receiver finds them whole.
pub(crate) const PIPELINE_FROM: usize = 4 * FILL_CHUNK;

/// A fill this long holds a thread for milliseconds, seconds when the
/// segment's pages are fresh: it runs on tokio's blocking pool
/// (`SharedFill::run`), off the caller's runtime thread.
pub(crate) const LONG_COPY: usize = 16 * FILL_CHUNK;
/// The most a copy out of a segment copies before it lets its thread's
/// other tasks run (heartbeats among them) and counts as a sign of the
/// peer's life (LIVE-3): a chunk, whose pages fault in within milliseconds
/// even where a fresh GiB took seconds.
pub(crate) const COPY_STRETCH: usize = FILL_CHUNK;
/// How long a receiver looks again at once for the next chunk of a fill
/// before it backs off.
const SPIN: Duration = Duration::from_millis(2);
/// The smallest storage that crosses through shared memory: below it the
/// socket is as fast, and a segment's bookkeeping would cost more.
pub(crate) const SHARE_THRESHOLD: usize = 1 << 20;
/// The most segments one side of a link owns at once.
pub(crate) const MAX_OWN_SEGMENTS: usize = 16;
/// The most segments one side of a link accepts from its peer.
pub(crate) const MAX_PEER_SEGMENTS: usize = 64;
/// Free segments a sender keeps for reuse, in bytes (or the one segment
/// just given back, if it is larger): others freed over this are given up,
/// and their memory returns to the system.
pub(crate) const IDLE_BYTES: usize = 256 << 20;
/// How long a free segment is kept before it is given up.
pub(crate) const IDLE_LIFE: Duration = Duration::from_secs(5);
/// How long the link's set-up and a wait for a segment may take.
pub(crate) const LINK_TIMEOUT: Duration = Duration::from_secs(10);

/// What an acceptor offers in its handshake: where its link listener is,
/// and the token that names this connection there (SHM-4).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ShmOffer {
    socket: [u8; 16],
    token: [u8; 32],
}

fn socket_address(socket: &[u8; 16]) -> std::io::Result<SocketAddrUnix> {
    let name: String = socket.iter().map(|b| format!("{b:02x}")).collect();
    Ok(SocketAddrUnix::new_abstract_name(
        format!("wasmrpc-shm-{name}").as_bytes(),
    )?)
}

fn seqpacket() -> std::io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)
}

/// A transport's link listener: the abstract socket, and the tokens of
/// accepted connections whose dialers have not joined yet.
pub(crate) struct ShmListener {
    socket: [u8; 16],
    waiting: Mutex<HashMap<[u8; 32], oneshot::Sender<OwnedFd>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl ShmListener {
    /// Listens on a fresh abstract socket.
    ///
    /// # Errors
    /// Fails if the socket cannot be made (no Unix sockets, say); the
    /// transport then runs without shared memory.
    pub(crate) fn bind() -> std::io::Result<Arc<Self>> {
        let socket = random_bytes::<16>();
        let fd = seqpacket()?;
        rustix::net::bind(&fd, &socket_address(&socket)?)?;
        rustix::net::listen(&fd, 128)?;
        let listener = register(fd, Interest::READABLE)?;
        let this = Arc::new(ShmListener {
            socket,
            waiting: Mutex::default(),
            task: Mutex::new(None),
        });
        let task = tokio::spawn(accept_loop(listener, Arc::downgrade(&this)));
        *lock(&this.task) = Some(task);
        Ok(this)
    }

    /// An offer for one accepted connection, and where its link arrives
    /// once the dialer joins.
    pub(crate) fn offer(&self) -> (ShmOffer, oneshot::Receiver<OwnedFd>) {
        let token = random_bytes::<32>();
        let (tx, rx) = oneshot::channel();
        let mut waiting = lock(&self.waiting);
        // Offers whose connection is gone (refused, closed) are dropped.
        waiting.retain(|_, tx| !tx.is_closed());
        waiting.insert(token, tx);
        let offer = ShmOffer {
            socket: self.socket,
            token,
        };
        (offer, rx)
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
    }
}

async fn accept_loop(listener: AsyncFd<OwnedFd>, this: std::sync::Weak<ShmListener>) {
    loop {
        let accepted = listener
            .async_io(Interest::READABLE, |fd| {
                Ok(rustix::net::accept_with(
                    fd,
                    SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
                )?)
            })
            .await;
        let Some(this) = this.upgrade() else { return };
        let fd = match accepted {
            Ok(fd) => fd,
            Err(e) => {
                tracing::debug!("shared-memory link accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        tokio::spawn(async move {
            // A joiner has a second to show a token; unknown ones are
            // closed without an answer.
            let Ok(Ok((fd, token))) = tokio::time::timeout(Duration::from_secs(1), async {
                let fd = register(fd, Interest::READABLE | Interest::WRITABLE)?;
                let mut token = [0u8; 32];
                let n = fd
                    .async_io(Interest::READABLE, |fd| {
                        Ok(rustix::net::recv(fd, &mut token, RecvFlags::empty())?.0)
                    })
                    .await?;
                std::io::Result::Ok((fd, (n == 32).then_some(token)))
            })
            .await
            else {
                return;
            };
            let Some(waiter) = token.and_then(|t| lock(&this.waiting).remove(&t)) else {
                return;
            };
            let acked = fd
                .async_io(Interest::WRITABLE, |fd| {
                    Ok(rustix::net::send(fd, &[1], SendFlags::NOSIGNAL)?)
                })
                .await;
            if acked.is_ok() {
                let _ = waiter.send(fd.into_inner());
            }
        });
    }
}

/// Joins the link an acceptor offered: the connected socket, or `None` when
/// the acceptor is on another host (or does not answer in time).
pub(crate) async fn join(offer: &ShmOffer) -> Option<OwnedFd> {
    let joined = tokio::time::timeout(Duration::from_secs(1), async {
        let fd = seqpacket()?;
        match rustix::net::connect(&fd, &socket_address(&offer.socket)?) {
            Ok(()) => {}
            Err(rustix::io::Errno::INPROGRESS | rustix::io::Errno::AGAIN) => {}
            Err(e) => return Err(e.into()),
        }
        let fd = register(fd, Interest::READABLE | Interest::WRITABLE)?;
        fd.async_io(Interest::WRITABLE, |fd| {
            Ok(rustix::net::send(fd, &offer.token, SendFlags::NOSIGNAL)?)
        })
        .await?;
        let mut ack = [0u8; 1];
        let n = fd
            .async_io(Interest::READABLE, |fd| {
                Ok(rustix::net::recv(fd, &mut ack, RecvFlags::empty())?.0)
            })
            .await?;
        if n != 1 || ack[0] != 1 {
            return Err(std::io::Error::other("no acknowledgement"));
        }
        std::io::Result::Ok(fd.into_inner())
    })
    .await;
    match joined {
        Ok(Ok(fd)) => Some(fd),
        Ok(Err(e)) => {
            tracing::debug!("no shared-memory link: {e}");
            None
        }
        Err(_) => None,
    }
}

/// A mapping of a whole memfd, unmapped when dropped.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a mapping is plain memory; who may write it is SHM-3's business,
// enforced by the segment bookkeeping, not by the pointer.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`; readers copy out of it (SHM-1).
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize, writable: bool) -> std::io::Result<Self> {
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a fresh mapping chosen by the kernel, of a file at least
        // `len` bytes long that can no longer shrink (sealed, SHM-2).
        let ptr =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0)? };
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Mapping {
    /// The segment's fill mark (SHM-5): its first 8 bytes.
    fn mark(&self) -> &std::sync::atomic::AtomicU64 {
        // SAFETY: a mapping is page-aligned and longer than
        // `SEGMENT_HEADER` (a segment is at least `SHARE_THRESHOLD`), so its
        // first 8 bytes are an aligned `u64` that lives as long as `self`;
        // an atomic load of read-only memory is a plain load.
        unsafe { &*self.ptr.cast::<std::sync::atomic::AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        #[cfg(test)]
        let _held = BULK_WORK_GATE.read();
        // SAFETY: the mapping made in `new`, unmapped once.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// Lets go of a segment (its mapping, its memfd) off the caller's thread
/// when there is a runtime: the side that lets go last frees the pages,
/// and a GiB's took 0.38 s on the 2-core VM (2026-12-03), long enough for
/// a runtime of one thread to miss its heartbeats (LIVE-2); it also leaves
/// the pool's lock free meanwhile. Without a runtime it happens here.
pub(crate) fn let_go<T: Send + 'static>(segment: T) {
    off_the_runtime(move || drop(segment));
}

/// Runs `work` on tokio's blocking pool when called on a runtime, without
/// waiting for it; here otherwise. For bulk work on segments, which must
/// not hold a runtime thread (LIVE-2).
pub(crate) fn off_the_runtime(work: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(work)),
        Err(_) => work(),
    }
}

/// Long fills (`SharedFill::run`) and unmapping segments wait while a test
/// holds this for writing: work that ran on the caller's thread would hold
/// that thread too.
#[cfg(test)]
pub(crate) static BULK_WORK_GATE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// A new segment of `len` bytes: a sealed memfd (SHM-2) and its writable
/// mapping.
fn new_segment(len: usize) -> std::io::Result<(OwnedFd, Mapping)> {
    let fd = rustix::fs::memfd_create(
        "wasmrpc-shm",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    rustix::fs::ftruncate(&fd, len as u64)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    let map = Mapping::new(&fd, len, true)?;
    Ok((fd, map))
}

/// Maps a segment a peer sent, if it is what SHM-2 allows.
fn map_peer_segment(fd: &OwnedFd, len: u64) -> Result<Mapping, String> {
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|e| format!("a shared segment that is not a memfd ({e})"))?;
    if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err("a shared segment not sealed against resizing".into());
    }
    let size = rustix::fs::fstat(fd)
        .map_err(|e| format!("a shared segment that cannot be inspected ({e})"))?
        .st_size;
    if u64::try_from(size).ok() != Some(len) || len == 0 {
        return Err(format!(
            "a shared segment of {size} bytes announced as {len} bytes"
        ));
    }
    let len = usize::try_from(len).map_err(|_| "a shared segment larger than memory")?;
    Mapping::new(fd, len, false).map_err(|e| format!("cannot map a shared segment: {e}"))
}

/// One record on the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    /// A new segment of the sender's, its descriptor attached.
    Segment { id: u64, len: u64 },
    /// The receiver has copied out of the segment: the sender may reuse it.
    Release { id: u64 },
    /// The sender gave the segment up: the receiver unmaps it.
    Forget { id: u64 },
    /// A new CUDA segment of the sender's, exported under `handle` (SHM-6);
    /// `address` is its device address when the two sides are one process
    /// (0 otherwise).
    CudaSegment {
        id: u64,
        len: u64,
        address: u64,
        handle: cuda::Handle,
    },
}

/// The bytes of a record: kind, id, length.
const RECORD: usize = 17;
/// The bytes of the longest record, a CUDA segment's (its address and
/// handle after).
const LONGEST_RECORD: usize = RECORD + 8 + cuda::HANDLE_LEN;

impl Record {
    /// The record's bytes, and how many of them it uses.
    fn encode(self) -> ([u8; LONGEST_RECORD], usize) {
        let (kind, id, len) = match self {
            Record::Segment { id, len } => (1, id, len),
            Record::Release { id } => (2, id, 0),
            Record::Forget { id } => (3, id, 0),
            Record::CudaSegment { id, len, .. } => (4, id, len),
        };
        let mut out = [0u8; LONGEST_RECORD];
        out[0] = kind;
        out[1..9].copy_from_slice(&id.to_le_bytes());
        out[9..RECORD].copy_from_slice(&len.to_le_bytes());
        if let Record::CudaSegment {
            address, handle, ..
        } = self
        {
            out[RECORD..RECORD + 8].copy_from_slice(&address.to_le_bytes());
            out[RECORD + 8..].copy_from_slice(&handle);
            return (out, LONGEST_RECORD);
        }
        (out, RECORD)
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let (head, rest) = bytes.split_at_checked(RECORD)?;
        let id = u64::from_le_bytes(head[1..9].try_into().ok()?);
        let len = u64::from_le_bytes(head[9..].try_into().ok()?);
        match (head[0], rest.len()) {
            (1, 0) => Some(Record::Segment { id, len }),
            (2, 0) if len == 0 => Some(Record::Release { id }),
            (3, 0) if len == 0 => Some(Record::Forget { id }),
            (4, n) if n == LONGEST_RECORD - RECORD => Some(Record::CudaSegment {
                id,
                len,
                address: u64::from_le_bytes(rest[..8].try_into().ok()?),
                handle: rest[8..].try_into().ok()?,
            }),
            _ => None,
        }
    }
}

/// Sends `record` (with `fd` attached) without waiting.
fn try_send(sock: &AsyncFd<OwnedFd>, record: Record, fd: Option<&OwnedFd>) -> std::io::Result<()> {
    let (bytes, len) = record.encode();
    let bytes = &bytes[..len];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd.as_fd()];
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let sent = rustix::net::sendmsg(
        sock,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
    )?;
    if sent != len {
        return Err(std::io::Error::other("a link record was cut"));
    }
    Ok(())
}

/// Receives one record and the descriptors that came with it.
async fn recv(sock: &AsyncFd<OwnedFd>) -> std::io::Result<Option<(Record, Vec<OwnedFd>)>> {
    sock.async_io(Interest::READABLE, |fd| {
        let mut bytes = [0u8; LONGEST_RECORD + 1];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            fd,
            &mut [std::io::IoSliceMut::new(&mut bytes)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        )?;
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if got.bytes == 0 {
            return Ok(None);
        }
        if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            return Err(std::io::Error::other(
                "more descriptors than one in a link record",
            ));
        }
        let record = Record::decode(&bytes[..got.bytes])
            .ok_or_else(|| std::io::Error::other("a malformed link record"))?;
        Ok(Some((record, fds)))
    })
    .await
}

/// `fd` under the runtime's reactor.
fn register(fd: OwnedFd, interest: Interest) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` owns its descriptor, which stays open and the
    // same for as long as the `AsyncFd` holds it.
    Ok(unsafe { AsyncFd::register_with_interest(fd, interest) }?)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a link failed, and the notification of changes to it.
#[derive(Default)]
struct LinkState {
    failed: AtomicBool,
    changed: Notify,
}
