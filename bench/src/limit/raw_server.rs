//! The raw echo server of the limits (`wasmrpc-bench raw-server`), in a
//! process of its own, and the ways its connections wait for bytes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// How a raw server's connections, and the client beside it, wait for
/// bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waiting {
    /// Asleep in a blocking `read`, woken by the kernel: the floor of any
    /// transport that sleeps while idle.
    Blocking,
    /// Polling a non-blocking socket in a loop, never asleep: the floor of
    /// one that busy-polls.
    Spinning,
    /// In tokio's `TcpStream`, on a current-thread runtime (asleep in
    /// `epoll`): the least a transport on tokio, a chosen package, can do,
    /// with no framing, dispatch or encoding of its own.
    Tokio,
}

/// `wasmrpc-bench raw-server [--spin | --tokio] [--work-ns N]`: accepts
/// connections on a free loopback port, prints the port, and echoes framed
/// payloads until stdin closes, each connection on a thread of its own
/// that waits as `waiting` says. With `work`, it keeps its core busy for
/// that long between reading a payload and echoing it, as a callee runs an
/// op.
pub(crate) fn serve(waiting: Waiting, work: Duration) -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("{}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    // Stop when the parent goes away (it closes our stdin).
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    for conn in listener.incoming() {
        let conn = conn?;
        std::thread::spawn(move || {
            let _ = echo(conn, waiting, work);
        });
    }
    Ok(())
}

/// Echoes the framed payloads of `conn` until the client leaves, waiting
/// for bytes as `waiting` says.
fn echo(conn: TcpStream, waiting: Waiting, work: Duration) -> std::io::Result<()> {
    match waiting {
        Waiting::Blocking => echo_connection(conn, false, work),
        Waiting::Spinning => echo_connection(conn, true, work),
        Waiting::Tokio => echo_on_tokio(conn, work),
    }
}

fn echo_connection(mut conn: TcpStream, spin: bool, work: Duration) -> std::io::Result<()> {
    conn.set_nodelay(true)?;
    conn.set_nonblocking(spin)?;
    let mut buf = Vec::new();
    loop {
        let mut len = [0u8; 8];
        if read_exact(&mut conn, &mut len).is_err() {
            return Ok(());
        }
        let len = u64::from_le_bytes(len) as usize;
        if buf.len() < len {
            buf.resize(len, 0);
        }
        read_exact(&mut conn, &mut buf[..len])?;
        work_for(work);
        write_all(&mut conn, &buf[..len])?;
    }
}

/// Keeps the core busy for `work`: a callee's op keeps its core, and the
/// caller's core is left idle as it would be.
fn work_for(work: Duration) {
    let worked = Instant::now();
    while worked.elapsed() < work {
        std::hint::spin_loop();
    }
}

/// A current-thread tokio runtime with I/O, as each side of
/// [`Waiting::Tokio`] runs on.
pub(super) fn tokio_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
}

/// [`echo_connection`] over tokio's `TcpStream` on a current-thread runtime.
fn echo_on_tokio(conn: TcpStream, work: Duration) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    conn.set_nodelay(true)?;
    conn.set_nonblocking(true)?;
    tokio_runtime()?.block_on(async move {
        let mut conn = tokio::net::TcpStream::from_std(conn)?;
        let mut buf = Vec::new();
        loop {
            let mut len = [0u8; 8];
            if conn.read_exact(&mut len).await.is_err() {
                return Ok(());
            }
            let len = u64::from_le_bytes(len) as usize;
            if buf.len() < len {
                buf.resize(len, 0);
            }
            conn.read_exact(&mut buf[..len]).await?;
            work_for(work);
            conn.write_all(&buf[..len]).await?;
        }
    })
}

/// `read_exact` that also works on a non-blocking socket, by polling it
/// (a blocking socket never reports `WouldBlock`, so it sleeps in `read`).
pub(super) fn read_exact(conn: &mut TcpStream, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match conn.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` that also works on a non-blocking socket, by polling it.
pub(super) fn write_all(conn: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match conn.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The raw server process; killed when dropped.
pub(super) struct RawServer {
    /// The server process.
    pub(super) child: Child,
    /// The loopback port it listens on.
    pub(super) port: u16,
}

impl RawServer {
    pub(super) fn start(waiting: Waiting, work: Duration) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let mode = match waiting {
            Waiting::Blocking => None,
            Waiting::Spinning => Some("--spin"),
            Waiting::Tokio => Some("--tokio"),
        };
        let mut child = crate::worker::started_by_this_bench(&mut Command::new(exe))
            .arg("raw-server")
            .args(mode)
            .args(["--work-ns".to_string(), work.as_nanos().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("could not start the raw TCP server process")?;
        let stdout = child.stdout.take().context("raw server stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let port = line
            .trim()
            .parse()
            .with_context(|| format!("raw server printed {line:?}, not a port"))?;
        Ok(RawServer { child, port })
    }
}

impl Drop for RawServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::super::round_trip;
    use super::*;

    /// The step floors' echo server (`--work-ns`), however it waits
    /// (blocking, spinning, on tokio), answers no payload before its work
    /// is done, and answers each with the bytes it got:
    /// a floor whose server skipped the work would read low.
    #[test]
    fn a_working_echo_server_answers_each_payload_after_its_work() {
        for waiting in [Waiting::Blocking, Waiting::Spinning, Waiting::Tokio] {
            working_echo_answers_each_payload_after_its_work(waiting);
        }
    }

    fn working_echo_answers_each_payload_after_its_work(waiting: Waiting) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let port = listener.local_addr().expect("its address").port();
        let work = Duration::from_millis(5);
        let server = std::thread::spawn(move || {
            let (conn, _) = listener.accept().expect("the client connects");
            echo(conn, waiting, work)
        });
        let mut conn = TcpStream::connect(("127.0.0.1", port)).expect("connected");
        for size in [8, 3000, 100 << 10] {
            let payload: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
            let mut back = vec![0u8; size];
            let started = Instant::now();
            round_trip(&mut conn, &payload, &mut back).expect("a round trip");
            assert!(
                started.elapsed() >= work,
                "{waiting:?}: {size} bytes came back after {:?}, before the server's {work:?} \
                 of work",
                started.elapsed()
            );
            assert!(
                back == payload,
                "{waiting:?}: the echo of {size} bytes differs"
            );
        }
        drop(conn);
        server
            .join()
            .expect("the server thread")
            .expect("the server ends cleanly when the client leaves");
    }
}
