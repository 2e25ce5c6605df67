//! One connection's shared-memory link: the segments this side lends its
//! peer, the peer's segments this side has mapped, and the task reading
//! the link's records.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::cuda::{DeviceSegment, PeerDeviceSegment};
use super::{
    COPY_STRETCH, FILL_CHUNK, IDLE_BYTES, IDLE_LIFE, LINK_TIMEOUT, LinkState, MAX_OWN_SEGMENTS,
    MAX_PEER_SEGMENTS, Mapping, Record, SEGMENT_HEADER, SHARE_THRESHOLD, SPIN, let_go, lock,
    map_peer_segment, new_segment, recv, register, try_send,
};

mod copy_out;
mod cuda_segments;

/// Where a segment's bytes are.
enum OwnMemory {
    /// A memfd this side keeps mapped.
    Host {
        /// Kept so the memfd lives as long as the segment (the peer maps it).
        _fd: OwnedFd,
        map: Arc<Mapping>,
    },
    /// Device memory exported to the peer (SHM-6).
    Cuda(Arc<DeviceSegment>),
}

/// A segment this side owns.
struct OwnSegment {
    id: u64,
    memory: OwnMemory,
    /// Named by a frame and not yet given back by the peer (SHM-3).
    lent: bool,
    /// Lent and not yet filled by this side.
    filling: bool,
    /// When it was last given back or filled.
    free_since: std::time::Instant,
}

impl OwnSegment {
    fn is_free(&self) -> bool {
        !self.lent && !self.filling
    }

    /// The memory it holds, in bytes.
    fn bytes(&self) -> usize {
        match &self.memory {
            OwnMemory::Host { map, .. } => map.len,
            OwnMemory::Cuda(segment) => segment.len(),
        }
    }

    fn is_cuda(&self) -> bool {
        matches!(self.memory, OwnMemory::Cuda(_))
    }

    /// Whether it is free and can take a storage of `len` bytes: host
    /// memory when `device` is `None`, else memory on that CUDA device.
    fn fits(&self, len: usize, device: Option<u32>) -> bool {
        self.is_free()
            && match (&self.memory, device) {
                (OwnMemory::Host { map, .. }, None) => map.len - SEGMENT_HEADER >= len,
                (OwnMemory::Cuda(segment), Some(d)) => {
                    segment.device() == d && segment.len() >= len
                }
                _ => false,
            }
    }
}

/// A peer's segment this side was given.
#[derive(Clone)]
enum PeerSegment {
    /// A memfd, mapped read-only.
    Host(Arc<Mapping>),
    /// Device memory, opened when first copied from.
    Cuda(Arc<PeerDeviceSegment>),
}

/// A segment lent for one storage: fill it after queueing the frame that
/// names it, and the peer copies out behind the fill.
pub(crate) struct Lent {
    link: Arc<ShmLink>,
    id: u64,
    map: Arc<Mapping>,
}

impl Lent {
    /// The segment's id, for the frame to name.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Copies `bytes` into the segment [`FILL_CHUNK`] at a time, publishing
    /// after each chunk how far the fill got (SHM-5).
    pub(crate) fn fill(self, bytes: &[u8]) {
        let mark = self.map.mark();
        let capacity = self.map.len - SEGMENT_HEADER;
        let bytes = &bytes[..bytes.len().min(capacity)];
        let mut done = 0;
        for chunk in bytes.chunks(FILL_CHUNK) {
            // SAFETY: the segment is this side's to write while it fills
            // (SHM-3), alive (the `Arc`), and holds `capacity` bytes after
            // its header.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    self.map.ptr.add(SEGMENT_HEADER + done),
                    chunk.len(),
                );
            }
            done += chunk.len();
            mark.store(done as u64, Ordering::Release);
        }
        self.link.filled(self.id, done);
    }
}

#[derive(Default)]
struct OwnPool {
    next_id: u64,
    segments: Vec<OwnSegment>,
}

/// A connection's link to a peer on the same host.
pub(crate) struct ShmLink {
    sock: AsyncFd<OwnedFd>,
    own: Mutex<OwnPool>,
    peer: Mutex<HashMap<u64, PeerSegment>>,
    state: LinkState,
    /// Storage bytes this side sent through its segments.
    sent_bytes: std::sync::atomic::AtomicU64,
    /// Of those, the bytes sent through CUDA segments.
    sent_cuda_bytes: std::sync::atomic::AtomicU64,
    /// Whether the peer is this very process (the kernel's word for the
    /// link's socket): CUDA segments then go by address, not by handle.
    same_process: bool,
    /// Whether a CUDA storage went through host memory for want of a CUDA
    /// segment (warned once per link).
    cuda_fell_back: AtomicBool,
}

impl ShmLink {
    pub(super) fn new(fd: OwnedFd) -> std::io::Result<Arc<Self>> {
        let same_process = rustix::net::sockopt::socket_peercred(&fd)
            .is_ok_and(|peer| u32::try_from(peer.pid.as_raw_pid()) == Ok(std::process::id()));
        Ok(Arc::new(ShmLink {
            sock: register(fd, Interest::READABLE | Interest::WRITABLE)?,
            own: Mutex::default(),
            peer: Mutex::default(),
            state: LinkState::default(),
            sent_bytes: std::sync::atomic::AtomicU64::new(0),
            sent_cuda_bytes: std::sync::atomic::AtomicU64::new(0),
            same_process,
            cuda_fell_back: AtomicBool::new(false),
        }))
    }

    pub(super) fn failed(&self) -> bool {
        self.state.failed.load(Ordering::Acquire)
    }

    pub(super) fn fail(&self, why: &str) {
        if !self.state.failed.swap(true, Ordering::AcqRel) {
            tracing::debug!("shared-memory link closed: {why}");
        }
        self.state.changed.notify_waiters();
    }

    /// Lends a free segment for a storage of `len` bytes, to be filled
    /// (`Lent::fill`) once the frame naming it is queued. `None` when the
    /// link failed, every segment is lent, or no segment can be made: the
    /// bytes then go over the connection.
    pub(crate) fn lend(self: &Arc<Self>, len: usize) -> Option<Lent> {
        if self.failed() || len == 0 {
            return None;
        }
        let mut pool = lock(&self.own);
        let segment = self.lend_from(&mut pool, len, None, |size| {
            let (fd, map) = new_segment(size)
                .map_err(|e| tracing::debug!("cannot make a shared segment: {e}"))
                .ok()?;
            Some(OwnMemory::Host {
                _fd: fd,
                map: Arc::new(map),
            })
        })?;
        let OwnMemory::Host { map, .. } = &segment.memory else {
            return None;
        };
        // Nothing is published yet: the peer reads this only after the
        // frame naming the segment, which is queued after this store.
        map.mark().store(0, Ordering::SeqCst);
        Some(Lent {
            link: Arc::clone(self),
            id: segment.id,
            map: Arc::clone(map),
        })
    }

    /// Marks lent a free segment that takes `len` bytes (host memory, or
    /// memory on CUDA `device`), the smallest that fits, or one made by
    /// `make` (given its size) and announced to the peer.
    fn lend_from<'p>(
        &self,
        pool: &'p mut OwnPool,
        len: usize,
        device: Option<u32>,
        make: impl FnOnce(usize) -> Option<OwnMemory>,
    ) -> Option<&'p mut OwnSegment> {
        let fitting = pool
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.fits(len, device))
            .min_by_key(|(_, s)| s.bytes())
            .map(|(i, _)| i);
        let index = match fitting {
            Some(i) => i,
            None => {
                if pool.segments.len() >= MAX_OWN_SEGMENTS {
                    // Make room by giving up the smallest free segment.
                    let smallest = pool
                        .segments
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.is_free())
                        .min_by_key(|(_, s)| s.bytes())
                        .map(|(i, _)| i)?;
                    self.give_up(pool, smallest);
                }
                let header = if device.is_some() { 0 } else { SEGMENT_HEADER };
                let size = (len + header).next_power_of_two().max(SHARE_THRESHOLD);
                let memory = make(size)?;
                let id = pool.next_id;
                pool.next_id += 1;
                let sent = match &memory {
                    OwnMemory::Host { _fd, .. } => try_send(
                        &self.sock,
                        Record::Segment {
                            id,
                            len: size as u64,
                        },
                        Some(_fd),
                    ),
                    OwnMemory::Cuda(segment) => try_send(
                        &self.sock,
                        Record::CudaSegment {
                            id,
                            len: size as u64,
                            address: if self.same_process {
                                segment.address()
                            } else {
                                0
                            },
                            handle: segment.handle(),
                        },
                        None,
                    ),
                };
                if let Err(e) = sent {
                    self.fail(&format!("cannot send a segment: {e}"));
                    return None;
                }
                pool.segments.push(OwnSegment {
                    id,
                    memory,
                    lent: false,
                    filling: false,
                    free_since: std::time::Instant::now(),
                });
                pool.segments.len() - 1
            }
        };
        let segment = &mut pool.segments[index];
        segment.lent = true;
        segment.filling = true;
        Some(segment)
    }

    /// Segment `id` was lent but never named by a frame: it is free again.
    fn unlend(&self, id: u64) {
        let mut pool = lock(&self.own);
        if let Some(s) = pool.segments.iter_mut().find(|s| s.id == id) {
            (s.lent, s.filling) = (false, false);
            s.free_since = std::time::Instant::now();
        }
    }

    /// The fill of segment `id` is done: once the peer gives it back too,
    /// it is free.
    fn filled(&self, id: u64, bytes: usize) {
        self.sent_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        let mut pool = lock(&self.own);
        if let Some(s) = pool.segments.iter_mut().find(|s| s.id == id) {
            s.filling = false;
            s.free_since = std::time::Instant::now();
        }
    }

    /// Lends a segment and fills it with `bytes` at once (tests).
    #[cfg(test)]
    pub(crate) fn share(self: &Arc<Self>, bytes: &[u8]) -> Option<u64> {
        let lent = self.lend(bytes.len())?;
        let id = lent.id();
        lent.fill(bytes);
        Some(id)
    }

    /// Storage bytes this side sent through its segments.
    pub(crate) fn sent_bytes(&self) -> u64 {
        self.sent_bytes.load(Ordering::Relaxed)
    }

    /// Of [`sent_bytes`](Self::sent_bytes), those sent through CUDA
    /// segments.
    pub(crate) fn sent_cuda_bytes(&self) -> u64 {
        self.sent_cuda_bytes.load(Ordering::Relaxed)
    }

    /// Gives the peer's segment `id` back unread (its frame was refused).
    pub(crate) fn give_back(self: &Arc<Self>, id: u64) {
        self.send_soon(Record::Release { id });
    }

    async fn peer_segment(&self, id: u64) -> Result<PeerSegment, String> {
        let deadline = tokio::time::Instant::now() + LINK_TIMEOUT;
        loop {
            let changed = self.state.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(segment) = lock(&self.peer).get(&id) {
                return Ok(segment.clone());
            }
            if self.failed() {
                return Err(format!(
                    "the shared-memory link failed before segment {id} arrived"
                ));
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(format!(
                    "shared segment {id} did not arrive within {LINK_TIMEOUT:?}"
                ));
            }
        }
    }

    /// Sends `record` now, or as soon as the link takes it.
    fn send_soon(self: &Arc<Self>, record: Record) {
        match try_send(&self.sock, record, None) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let link = Arc::clone(self);
                tokio::spawn(async move {
                    loop {
                        let Ok(mut ready) = link.sock.writable().await else {
                            return;
                        };
                        match try_send(&link.sock, record, None) {
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                ready.clear_ready();
                            }
                            Err(e) => return link.fail(&e.to_string()),
                            Ok(()) => return,
                        }
                    }
                });
            }
            Err(e) => self.fail(&e.to_string()),
        }
    }

    /// Reads the link's records until it fails (SHM-2).
    pub(super) async fn run(self: Arc<Self>) {
        let why = loop {
            match recv(&self.sock).await {
                Ok(None) => break "the peer closed the link".to_string(),
                Err(e) => break e.to_string(),
                Ok(Some((record, fds))) => {
                    if let Err(e) = self.on_record(record, fds) {
                        break e;
                    }
                }
            }
        };
        self.fail(&why);
    }

    fn on_record(&self, record: Record, fds: Vec<OwnedFd>) -> Result<(), String> {
        let expected = usize::from(matches!(record, Record::Segment { .. }));
        if fds.len() != expected {
            return Err(format!(
                "a link record {record:?} with {} descriptors",
                fds.len()
            ));
        }
        match record {
            Record::Segment { id, len } => {
                let map = map_peer_segment(&fds[0], len)?;
                self.add_peer_segment(id, PeerSegment::Host(Arc::new(map)))?;
            }
            Record::CudaSegment {
                id,
                len,
                address,
                handle,
            } => {
                if len == 0 {
                    return Err(format!("the peer lent CUDA segment {id} of 0 bytes"));
                }
                // An address means something only within this process; from
                // another one it is ignored and the handle is opened.
                let local = match (self.same_process, address) {
                    (true, 0) => {
                        return Err(format!(
                            "CUDA segment {id} of this very process came without its address"
                        ));
                    }
                    (true, address) => Some(address),
                    (false, _) => None,
                };
                let segment = PeerDeviceSegment::new(handle, len, local);
                self.add_peer_segment(id, PeerSegment::Cuda(Arc::new(segment)))?;
            }
            Record::Release { id } => {
                let mut pool = lock(&self.own);
                let segment = pool
                    .segments
                    .iter_mut()
                    .find(|s| s.id == id && s.lent)
                    .ok_or_else(|| {
                        format!("the peer gave back segment {id}, which it did not hold")
                    })?;
                segment.lent = false;
                segment.free_since = std::time::Instant::now();
                let kept = segment.bytes().max(IDLE_BYTES);
                let cuda = segment.is_cuda();
                // Other free segments of the same memory over the idle limit
                // are given up, largest first; the one given back stays for
                // the next storage of its size (the common case: the same
                // call again).
                loop {
                    let idle: usize = pool
                        .segments
                        .iter()
                        .filter(|s| s.is_free() && s.is_cuda() == cuda)
                        .map(OwnSegment::bytes)
                        .sum();
                    if idle <= kept {
                        break;
                    }
                    let Some(largest) = pool
                        .segments
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.is_free() && s.is_cuda() == cuda && s.id != id)
                        .max_by_key(|(_, s)| s.bytes())
                        .map(|(i, _)| i)
                    else {
                        break;
                    };
                    self.give_up(&mut pool, largest);
                }
            }
            Record::Forget { id } => {
                let gone = lock(&self.peer)
                    .remove(&id)
                    .ok_or_else(|| format!("the peer gave up segment {id}, which it never lent"))?;
                let_go(gone);
            }
        }
        Ok(())
    }

    /// Records the peer's segment `id` (SHM-2: at most
    /// [`MAX_PEER_SEGMENTS`], each id once).
    fn add_peer_segment(&self, id: u64, segment: PeerSegment) -> Result<(), String> {
        let mut peer = lock(&self.peer);
        if peer.len() >= MAX_PEER_SEGMENTS {
            return Err(format!(
                "the peer lent more than {MAX_PEER_SEGMENTS} segments"
            ));
        }
        if peer.insert(id, segment).is_some() {
            return Err(format!("the peer lent segment {id} twice"));
        }
        drop(peer);
        self.state.changed.notify_waiters();
        Ok(())
    }

    /// Gives up the free segment at `index`: the peer unmaps it, and its
    /// memory returns to the system once both sides let go.
    fn give_up(&self, pool: &mut OwnPool, index: usize) {
        let gone = pool.segments.swap_remove(index);
        let _ = try_send(&self.sock, Record::Forget { id: gone.id }, None);
        let_go(gone);
    }

    /// Gives up the segments free for longer than [`IDLE_LIFE`].
    pub(super) fn trim(&self) {
        let mut pool = lock(&self.own);
        while let Some(old) = pool
            .segments
            .iter()
            .position(|s| s.is_free() && s.free_since.elapsed() > IDLE_LIFE)
        {
            self.give_up(&mut pool, old);
        }
    }

    /// How many segments this side owns, and how many of its peer's it has
    /// mapped (tests).
    #[cfg(test)]
    pub(crate) fn segments(&self) -> (usize, usize) {
        (lock(&self.own).segments.len(), lock(&self.peer).len())
    }

    /// How many of this side's segments are lent (tests).
    #[cfg(test)]
    pub(crate) fn lent(&self) -> usize {
        lock(&self.own)
            .segments
            .iter()
            .filter(|s| !s.is_free())
            .count()
    }
}
