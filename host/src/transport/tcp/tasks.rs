//! The tasks a transport runs: its listener's accept loop, and each
//! connection's reader and writer.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::error::Error;
use crate::transport::frame::{FrameError, read_frame, write_frame};
use crate::transport::handshake::{self, HANDSHAKE_TIMEOUT};
use crate::transport::tls::check_peer_names;
use crate::transport::traffic::RefusalReason;

use super::admission::{Admission, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_ADDRESS};
use super::write_half::WriteHalf;
use super::{Connection, ShmSlot, Stream, Transport, WriterCmd, lock};

/// Tags a handshake stage's error with the reason it is refused for.
fn refused_for<E: Into<Error>>(reason: RefusalReason) -> impl FnOnce(E) -> (RefusalReason, Error) {
    move |e| (reason, e.into())
}

pub(super) async fn accept_loop(listener: TcpListener, t: Weak<Transport>) {
    let admission = Admission::new();
    loop {
        let (mut stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(tr) = t.upgrade() else { return };
        let _ = stream.set_nodelay(true);
        // TR-8: room for this handshake, made by ending the oldest.
        let (ticket, displaced) = admission.admit(from);
        for old in displaced {
            if let Some(task) = old.task {
                task.abort();
            }
            tr.refused(
                old.from,
                RefusalReason::Displaced,
                &format!(
                    "still in its handshake when newer connections needed its place \
                     ({MAX_HANDSHAKES_PER_ADDRESS} per address, {MAX_HANDSHAKES} in all)"
                ),
            );
        }
        let id = ticket.id();
        let handshake = tokio::spawn(async move {
            let _ticket = ticket;
            let (secret, name, rank) = (tr.cfg.secret.clone(), tr.cfg.name.clone(), tr.cfg.rank);
            // TR-9: the offer reaches the dialer only after its proof.
            let (offer, joined) = tr.shm.as_ref().map(|l| l.offer()).unzip();
            // Each stage's error is counted under its own reason (TRAFFIC-2).
            let accept = async {
                match &tr.cfg.tls {
                    None => {
                        let who = handshake::server(&mut stream, &secret, &name, rank, offer)
                            .await
                            .map_err(refused_for(RefusalReason::Handshake))?;
                        Ok((Stream::Tcp(stream), who))
                    }
                    Some(tls) => {
                        // TLS-1: a certificate of the cluster CA, or no byte
                        // of the agent's protocol is read.
                        let in_progress = super::busy_poll::InProgress::default();
                        let mut stream = super::busy_poll::HANDSHAKING
                            .scope(in_progress.clone(), tls.accept(stream))
                            .await
                            .map_err(refused_for(RefusalReason::Tls))?;
                        let who = handshake::server(&mut stream, &secret, &name, rank, offer)
                            .await
                            .map_err(refused_for(RefusalReason::Handshake))?;
                        // TLS-3: the announced name is the certificate's.
                        check_peer_names(&stream, &who.name)
                            .map_err(refused_for(RefusalReason::CertificateName))?;
                        Ok::<_, (RefusalReason, Error)>((
                            Stream::Tls(Box::new(stream), in_progress),
                            who,
                        ))
                    }
                }
            };
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept).await {
                Ok(Ok((stream, who))) => {
                    if !tr.shut.load(Ordering::Acquire) {
                        let shm = joined.map_or_else(ShmSlot::none, ShmSlot::awaiting);
                        tr.start(stream, who, shm);
                    }
                }
                Ok(Err((reason, e))) => tr.refused(from, reason, &e.to_string()),
                Err(_) => tr.refused(from, RefusalReason::Timeout, "handshake timed out"),
            }
        });
        if !admission.started(id, handshake.abort_handle()) {
            handshake.abort();
        }
    }
}

pub(super) async fn writer_loop(
    mut rx: mpsc::UnboundedReceiver<WriterCmd>,
    t: Weak<Transport>,
    conn: Arc<Connection>,
) {
    use tokio::io::AsyncWriteExt;
    // The write half while this task owns it: between a `Resume` and the
    // moment its queue is empty.
    let mut half: Option<WriteHalf> = None;
    while let Some(cmd) = rx.recv().await {
        let (frame, offset) = match cmd {
            WriterCmd::Frame(frame) => (frame, 0),
            WriterCmd::Resume(h, frame, offset) => {
                half = Some(h);
                (frame, offset)
            }
            WriterCmd::Close => break,
        };
        let Some(write) = half.as_mut() else {
            // Frames are queued only while the half is away from `direct`,
            // and a `Resume` hands it over before them (TR-5).
            tracing::error!(peer = %conn.peer, "frame queued while no writer owns the connection");
            if let Some(t) = t.upgrade() {
                t.close(&conn, "internal error: frame queued without a writer");
            }
            return;
        };
        let written = match write_frame(write, &frame, offset).await {
            // TLS buffers records: flush once nothing more is queued.
            Ok(()) if rx.is_empty() => write.flush().await,
            other => other,
        };
        if let Err(e) = written {
            tracing::warn!(peer = %conn.peer, "write failed: {e}");
            if let Some(t) = t.upgrade() {
                t.close(&conn, &format!("write failed: {e}"));
            }
            return;
        }
        // Senders queue only while the half is away, and do so holding the
        // lock: an empty queue seen under the lock stays empty until the
        // half is back.
        let mut direct = lock(&conn.direct);
        if rx.is_empty() {
            *direct = half.take();
            drop(direct);
            // A sender that found `direct` held meanwhile left its frame in
            // the backlog for whoever held it: this task. The connection's
            // sender side lives as long as this task, so queueing cannot fail.
            let _ = conn.drain_backlog();
        }
    }
    let half = half.or_else(|| lock(&conn.direct).take());
    if let Some(mut write) = half {
        let _ = write.shutdown().await;
    }
}

/// Bytes read ahead from each connection.
pub(super) const READ_BUFFER: usize = 16 << 10;

pub(super) async fn reader_loop(
    mut read: tokio::io::BufReader<Box<dyn tokio::io::AsyncRead + Send + Unpin>>,
    t: Weak<Transport>,
    conn: Arc<Connection>,
    max: u64,
    budget: Option<wasmrpc_torch_sys::MemoryBudget>,
) {
    let reason = loop {
        match read_frame(
            &mut read,
            max,
            budget.as_ref(),
            Some(&conn.shm),
            Some(&conn.activity),
        )
        .await
        {
            Ok(Some((message, tensors))) => {
                conn.activity.received();
                let Some(tr) = t.upgrade() else { return };
                let Some(h) = tr.handler.upgrade() else {
                    return;
                };
                if let Err(e) = h.on_frame(&conn, message, tensors) {
                    tracing::error!(peer = %conn.peer, "closing connection: {e}");
                    break format!("worker {} sent a bad frame: {e}", conn.peer);
                }
            }
            Err(FrameError::OverBudget(message, refusal)) => {
                let Some(tr) = t.upgrade() else { return };
                let Some(h) = tr.handler.upgrade() else {
                    return;
                };
                h.on_over_budget(&conn, message, refusal);
            }
            Ok(None) => break format!("worker {} closed the connection", conn.peer),
            Err(FrameError::Io(e)) => {
                break format!("connection to worker {} failed: {e}", conn.peer);
            }
            Err(e) => {
                tracing::error!(peer = %conn.peer, "closing connection: {e}");
                break format!("worker {} sent a bad frame: {e}", conn.peer);
            }
        }
    };
    if let Some(tr) = t.upgrade() {
        tr.close(&conn, &reason);
    }
}
