//! The machine's limits: a raw TCP ping-pong round trip, a raw TCP echo of
//! the echo rows' sizes, memcpy of 64 MiB, the bound of the
//! shared-memory channel's design (two overlapped copies each way), and the
//! pieces of a distributed autograd step's floor (its ops in one process,
//! raw TCP round trips carrying its tensors), which `ours::autograd`
//! measures beside its rows.
//!
//! The server runs in a process of its own (`wasmrpc-bench raw-server`), as
//! the RPC workers do. Its protocol is the least an RPC could do: the client
//! writes an 8-byte length and that many bytes; the server reads them all,
//! then writes them back (store and forward, as an RPC echo must: a callee
//! sees its argument whole before it returns it). Buffers are allocated once
//! and reused, `TCP_NODELAY` is on, and nothing is serialized.

use std::hint::black_box;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::progress::Progress;
use crate::rows::{Results, Side, wanted};
use crate::stats::Stat;

mod raw_server;
use raw_server::{RawServer, read_exact, tokio_runtime, write_all};
pub(crate) use raw_server::{Waiting, serve};

/// One framed round trip of `payload` over `conn`, into `back`.
fn round_trip(conn: &mut TcpStream, payload: &[u8], back: &mut [u8]) -> std::io::Result<()> {
    if payload.len() <= 64 << 10 {
        // Small: one write, as a real message would be.
        let mut msg = Vec::with_capacity(8 + payload.len());
        msg.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        msg.extend_from_slice(payload);
        write_all(conn, &msg)?;
    } else {
        write_all(conn, &(payload.len() as u64).to_le_bytes())?;
        write_all(conn, payload)?;
    }
    read_exact(conn, back)
}

fn timed(
    conn: &mut TcpStream,
    size: usize,
    n: usize,
    warmup: usize,
) -> std::io::Result<Vec<Duration>> {
    let payload = vec![7u8; size];
    let mut back = vec![0u8; size];
    for _ in 0..warmup {
        round_trip(conn, &payload, &mut back)?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        round_trip(conn, &payload, &mut back)?;
        samples.push(t.elapsed());
    }
    Ok(samples)
}

/// A raw TCP ping-pong of a small call's bytes, kept open so that it can be
/// measured again and again beside the rows it is the floor of.
pub(crate) struct PingPong {
    conn: TcpStream,
    server: RawServer,
}

impl PingPong {
    /// A connection to a raw server of its own. With `spin`, neither side
    /// ever sleeps: both poll their non-blocking sockets (the second floor
    /// of the small call, where no wake-up is paid); without, each side
    /// blocks in `read` and the kernel wakes it (the first).
    pub(crate) fn start(spin: bool) -> Result<Self> {
        Self::start_working(spin, Duration::ZERO)
    }

    /// As [`start`](Self::start), with a server that keeps its core busy
    /// for `work` before each echo: the round trip of an exchange whose
    /// callee runs an op between the request and its reply, over which the
    /// caller sleeps (or spins) for longer than an instant echo lets it.
    pub(crate) fn start_working(spin: bool, work: Duration) -> Result<Self> {
        let waiting = if spin {
            Waiting::Spinning
        } else {
            Waiting::Blocking
        };
        let server = RawServer::start(waiting, work)?;
        let conn = TcpStream::connect(("127.0.0.1", server.port))?;
        conn.set_nodelay(true)?;
        conn.set_nonblocking(spin)?;
        Ok(PingPong { conn, server })
    }

    /// The process id of the echo server.
    pub(crate) fn server_pid(&self) -> u32 {
        self.server.child.id()
    }

    /// `n` timed round trips of [`SMALL_CALL_BYTES`](crate::rows::SMALL_CALL_BYTES),
    /// after `warmup` untimed ones.
    pub(crate) fn round_trips(&mut self, n: usize, warmup: usize) -> Result<Vec<Duration>> {
        self.round_trips_of(crate::rows::SMALL_CALL_BYTES as usize, n, warmup)
    }

    /// `n` timed round trips of `size` bytes each way, after `warmup`
    /// untimed ones.
    pub(crate) fn round_trips_of(
        &mut self,
        size: usize,
        n: usize,
        warmup: usize,
    ) -> Result<Vec<Duration>> {
        Ok(timed(&mut self.conn, size, n, warmup)?)
    }
}

/// The raw ping-pong of [`PingPong`] with both sides on tokio
/// ([`Waiting::Tokio`]): the client's runtime is its own, so its round trips
/// must be timed off any other runtime's threads.
pub(crate) struct TokioPingPong {
    /// Always `Some` until dropped.
    runtime: Option<tokio::runtime::Runtime>,
    conn: tokio::net::TcpStream,
    _server: RawServer,
}

impl TokioPingPong {
    /// A connection to a tokio raw server of its own.
    pub(crate) fn start() -> Result<Self> {
        let server = RawServer::start(Waiting::Tokio, Duration::ZERO)?;
        let conn = TcpStream::connect(("127.0.0.1", server.port))?;
        conn.set_nodelay(true)?;
        conn.set_nonblocking(true)?;
        let runtime = tokio_runtime()?;
        let conn = {
            let _entered = runtime.enter();
            tokio::net::TcpStream::from_std(conn)?
        };
        Ok(TokioPingPong {
            runtime: Some(runtime),
            conn,
            _server: server,
        })
    }

    /// `n` timed round trips of [`SMALL_CALL_BYTES`](crate::rows::SMALL_CALL_BYTES),
    /// framed as [`PingPong`]'s are, after `warmup` untimed ones.
    pub(crate) fn round_trips(&mut self, n: usize, warmup: usize) -> Result<Vec<Duration>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let size = crate::rows::SMALL_CALL_BYTES as usize;
        let conn = &mut self.conn;
        let mut msg = (size as u64).to_le_bytes().to_vec();
        msg.resize(8 + size, 7);
        let mut back = vec![0u8; size];
        let runtime = self
            .runtime
            .as_ref()
            .expect("the runtime lives until dropped");
        let samples = runtime.block_on(async {
            let mut samples = Vec::with_capacity(n);
            for i in 0..warmup + n {
                let t = Instant::now();
                conn.write_all(&msg).await?;
                conn.read_exact(&mut back).await?;
                if i >= warmup {
                    samples.push(t.elapsed());
                }
            }
            std::io::Result::Ok(samples)
        })?;
        Ok(samples)
    }
}

impl Drop for TokioPingPong {
    fn drop(&mut self) {
        // It is dropped on the bench's runtime, where a runtime's blocking
        // shutdown panics; nothing runs on its own between round trips.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Echo sizes: (limit key, bytes, runs in a quick run, runs in a full run).
pub(crate) const ECHO: &[(&str, usize, usize, usize)] = &[
    ("raw_echo_4k", 4 << 10, 500, 3000),
    ("raw_echo_1m", 1 << 20, 100, 500),
    ("raw_echo_64m", 64 << 20, 5, 20),
];

/// Measures every limit the selected rows need.
pub(crate) fn measure(quick: bool, only: &[String], res: &mut Results, progress: &Progress) {
    let need_rtt = [
        "rtt_noop_native",
        "rtt_noop_wasm",
        "rtt_aten_add",
        "raw_rtt",
    ]
    .iter()
    .any(|r| wanted(only, r));
    let need_echo: Vec<_> = ECHO
        .iter()
        .filter(|(key, ..)| wanted(only, &key["raw_".len()..]) || wanted(only, key))
        .collect();
    // The autograd steps' floors are measured beside their rows, in
    // alternating rounds (`ours::autograd`).
    if (need_rtt || !need_echo.is_empty())
        && let Err(e) = tcp(quick, need_rtt, &need_echo, res, progress)
    {
        let why = format!("raw TCP measurement failed: {e:#}");
        res.na(Side::Limit, "raw_rtt", &why);
        for key in ECHO.iter().map(|e| e.0) {
            res.na(Side::Limit, key, &why);
        }
    }
    if wanted(only, "memcpy_64m") {
        progress.set("limit: memcpy of 64 MiB");
        let n = if quick { 10 } else { 30 };
        let bytes = 64usize << 20;
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        dst.copy_from_slice(&src);
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
            samples.push(t.elapsed());
        }
        let lat = Stat::latencies(&samples);
        res.set(
            Side::Limit,
            "memcpy_64m",
            Stat::value(bytes as f64 / (lat.median * 1e3), n as u64),
        );
    }
    // With its row, the bound is measured beside it (`shm`); alone, here.
    if wanted(only, "shm_bound_64m") && !wanted(only, "shm_echo_64m") {
        progress.set("limit: two overlapped copies of 64 MiB, there and back");
        let n = if quick { 5 } else { 20 };
        res.set(
            Side::Limit,
            "shm_bound_64m",
            Stat::latencies(&shared_memory_bound(64 << 20, n)),
        );
    }
}

/// How far a storage is copied into the segment before the receiver is
/// told (the shared-memory channel's `FILL_CHUNK`).
const BOUND_CHUNK: usize = 1 << 20;

/// The least a shared-memory echo of `bytes` can take under the channel's
/// trust model (SHM-1: the receiver copies out of the segment, so a later
/// write by the sender cannot change a received tensor): each direction is
/// a copy into a segment on one thread and a copy out of it on another,
/// [`BOUND_CHUNK`] behind, as the channel pipelines them (SHM-5). No
/// messages, no tensors, no page faults (every buffer is touched first):
/// `n` samples of the two directions one after the other, after one
/// round of warm-up.
pub(crate) fn shared_memory_bound(bytes: usize, n: usize) -> Vec<Duration> {
    // Non-zero fills: every page is touched before the first sample.
    let mut ends = [vec![1u8; bytes], vec![2u8; bytes]];
    let mut segments = [vec![3u8; bytes], vec![4u8; bytes]];
    let mut samples = Vec::with_capacity(n);
    for i in 0..=n {
        let ([a, b], [there, back]) = (&mut ends, &mut segments);
        let t = Instant::now();
        copy_through(a, there, b);
        copy_through(b, back, a);
        // The first round is a warm-up.
        if i > 0 {
            samples.push(t.elapsed());
        }
    }
    black_box(&ends);
    samples
}

/// Copies `from` into `segment` on a thread of its own, publishing after
/// each chunk how far it got, while this thread copies `segment` into `to`
/// behind it.
fn copy_through(from: &[u8], segment: &mut [u8], to: &mut [u8]) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    assert!(
        from.len() == to.len() && segment.len() >= from.len(),
        "copy_through needs a segment at least as large as the source and a destination of its size"
    );
    let filled = AtomicUsize::new(0);
    let segment_ptr = segment.as_mut_ptr() as usize;
    std::thread::scope(|s| {
        s.spawn(|| {
            for (i, chunk) in from.chunks(BOUND_CHUNK).enumerate() {
                let at = i * BOUND_CHUNK;
                // SAFETY: the filler alone writes `segment`, each byte
                // once, and only below `filled` does the reader look.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        chunk.as_ptr(),
                        (segment_ptr as *mut u8).add(at),
                        chunk.len(),
                    );
                }
                filled.store(at + chunk.len(), Ordering::Release);
            }
        });
        let mut done = 0;
        while done < to.len() {
            let upto = filled.load(Ordering::Acquire);
            if upto == done {
                // Not a spin: on a busy machine the filler may share this
                // core, and the bound must not wait for the scheduler.
                std::thread::yield_now();
                continue;
            }
            // SAFETY: bytes below `upto` are written and never written again.
            let ready = unsafe {
                std::slice::from_raw_parts((segment_ptr as *const u8).add(done), upto - done)
            };
            to[done..upto].copy_from_slice(ready);
            done = upto;
        }
    });
}

fn tcp(
    quick: bool,
    rtt: bool,
    echo: &[&(&str, usize, usize, usize)],
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let server = RawServer::start(Waiting::Blocking, Duration::ZERO)?;
    let mut conn = TcpStream::connect(("127.0.0.1", server.port))?;
    conn.set_nodelay(true)?;
    if rtt {
        progress.set("limit: raw TCP ping-pong round trip (8 bytes)");
        let n = if quick { 2000 } else { 20000 };
        let samples = timed(&mut conn, crate::rows::SMALL_CALL_BYTES as usize, n, n / 10)?;
        res.set(Side::Limit, "raw_rtt", Stat::latencies(&samples));
    }
    for (key, size, nq, nf) in echo {
        progress.set(&format!("limit: raw TCP echo of {size} bytes"));
        let n = if quick { *nq } else { *nf };
        let samples = timed(&mut conn, *size, n, (n / 10).max(1))?;
        res.set(Side::Limit, key, Stat::latencies(&samples));
    }
    Ok(())
}

/// The bytes a remote step's round trips carry each way, on average: the
/// forward sends both matrices and gets the product back, the backward
/// sends the product's gradient and gets both matrices' gradients back,
/// so each round trip moves three matrices of `side`x`side` floats.
pub(crate) fn step_bytes_each_way(side: i64) -> usize {
    usize::try_from(side * side * 4 * 3 / 2).unwrap_or(usize::MAX)
}

/// The bench's distributed autograd step done in this process: the matmul
/// of two `side`x`side` leaves, its sum, and the leaves' gradients by
/// libtorch's engine (returned, as a distributed context holds them,
/// rather than accumulated), on this process's op threads, which the
/// bench sets to a worker's share.
pub(crate) struct LocalStep {
    a: tch::Tensor,
    b: tch::Tensor,
}

impl LocalStep {
    pub(crate) fn new(side: i64) -> Self {
        use tch::{Device, Kind, Tensor};
        let leaf =
            || Tensor::rand([side, side], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        LocalStep {
            a: leaf(),
            b: leaf(),
        }
    }

    /// One step.
    pub(crate) fn run(&self) -> Result<()> {
        let loss = self.a.f_matmul(&self.b)?.f_sum(None)?;
        tch::Tensor::f_run_backward(&[loss], &[&self.a, &self.b], false, false)?;
        Ok(())
    }

    /// `n` steps timed one by one, after `warmup`.
    pub(crate) fn timed(&self, n: usize, warmup: usize) -> Result<Vec<Duration>> {
        for _ in 0..warmup {
            self.run()?;
        }
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            self.run()?;
            samples.push(t.elapsed());
        }
        Ok(samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_through_a_segment_delivers_every_byte_in_order() {
        let from: Vec<u8> = (0..(3 * BOUND_CHUNK + 12_345))
            .map(|i| (i % 251) as u8)
            .collect();
        let mut segment = vec![0u8; from.len()];
        let mut to = vec![0u8; from.len()];
        copy_through(&from, &mut segment, &mut to);
        assert!(to == from, "the copy differs from its source");
    }
}
