//! Tests of `tcp`.

use super::refusals::{REFUSAL_LOG_INTERVAL, Refusal};
use super::*;
use crate::transport::MessageKind;

#[test]
fn refusals_are_logged_at_most_once_per_interval_with_a_count() {
    let log = RefusalLog::default();
    let t0 = std::time::Instant::now();
    let ms = |i: u64| t0 + std::time::Duration::from_millis(i);
    assert_eq!(log.note(t0), Refusal::Log(0));
    assert_eq!(log.note(ms(4)), Refusal::FirstSuppressed);
    for i in 2..200 {
        assert_eq!(log.note(ms(i * 4)), Refusal::Suppressed);
    }
    assert_eq!(log.note(t0 + REFUSAL_LOG_INTERVAL), Refusal::Log(199));
    assert_eq!(log.note(t0 + REFUSAL_LOG_INTERVAL * 3), Refusal::Log(0));
    // Refusals that no later one reports are flushed once.
    assert_eq!(log.note(ms(3100)), Refusal::FirstSuppressed);
    assert_eq!(log.note(ms(3200)), Refusal::Suppressed);
    assert_eq!(log.flush(ms(4004)), Some(2));
    assert_eq!(log.flush(ms(4005)), None);
    // The flush counts as a line: the next refusal within a second waits.
    assert_eq!(log.note(ms(4500)), Refusal::FirstSuppressed);
}

/// Every frame a transport receives, as its message's text.
#[derive(Default)]
struct Recorder {
    got: Mutex<Vec<String>>,
}

impl Handler for Recorder {
    fn on_frame(
        &self,
        _: &Arc<Connection>,
        message: Vec<u8>,
        _: Vec<Tensor>,
    ) -> std::result::Result<(), String> {
        lock(&self.got).push(String::from_utf8(message).map_err(|e| e.to_string())?);
        Ok(())
    }

    fn on_over_budget(&self, _: &Arc<Connection>, _: Vec<u8>, _: wasmrpc_torch_sys::BudgetRefusal) {
        panic!("no budget is set");
    }

    fn on_close(&self, _: &Arc<Connection>, _: &str) {}
}

fn config(name: &str, rank: u32) -> TransportConfig {
    TransportConfig {
        name: name.into(),
        rank,
        secret: Arc::new(b"backlog test".to_vec()),
        max_frame_size: crate::transport::DEFAULT_MAX_FRAME_SIZE,
        faults: FaultInjection::default(),
        receive_budget: None,
        tls: None,
        shared_memory: true,
        busy_poll: crate::agent::DEFAULT_BUSY_POLL,
        failure_timeout: None,
    }
}

/// Two transports on loopback, and a connection from the client to the
/// server, whose frames `received` records.
struct Pair {
    client: Arc<Transport>,
    server: Arc<Transport>,
    conn: Arc<Connection>,
    received: Arc<Recorder>,
    // The transports hold their handlers weakly.
    _handlers: [Arc<dyn Handler>; 2],
}

impl Pair {
    async fn new() -> Pair {
        let received = Arc::new(Recorder::default());
        let handlers: [Arc<dyn Handler>; 2] = [received.clone(), Arc::new(Recorder::default())];
        let loopback = ([127, 0, 0, 1], 0).into();
        let bind = |name, rank, handler| Transport::bind(config(name, rank), loopback, handler);
        let server = bind("server", 0, Arc::downgrade(&handlers[0]))
            .await
            .unwrap();
        let client = bind("client", 1, Arc::downgrade(&handlers[1]))
            .await
            .unwrap();
        let conn = client
            .connection("server", server.local_addr())
            .await
            .unwrap();
        Pair {
            client,
            server,
            conn,
            received,
            _handlers: handlers,
        }
    }

    fn send(&self, text: String, tensors: &[Tensor]) {
        let frame = OutFrame::encode(text.into_bytes(), MessageKind::new("Test"), tensors, &[]);
        self.client
            .send_now(&self.conn, frame.unwrap())
            .unwrap()
            .unwrap();
    }

    /// What the server received, once it is `n` frames or 60 s passed.
    async fn received(&self, n: usize) -> Vec<String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while lock(&self.received.got).len() < n && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        lock(&self.received.got).clone()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.client.abort();
        self.server.abort();
    }
}

/// TR-3 and TR-5 under contention: senders on several threads share one
/// connection, so most find another sender writing and leave their frames
/// in the backlog; large frames fill the socket now and then, so the
/// writer task takes the half over and gives it back. Every frame arrives,
/// each sender's in the order it sent them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_senders_lose_no_frame_and_keep_their_order() {
    const SENDERS: usize = 6;
    const FRAMES: usize = 1500;
    let pair = Arc::new(Pair::new().await);
    let senders: Vec<_> = (0..SENDERS)
        .map(|s| {
            let pair = pair.clone();
            std::thread::spawn(move || {
                for i in 0..FRAMES {
                    let tensors = match i % 100 {
                        0 => vec![Tensor::zeros(
                            [1 << 18],
                            (tch::Kind::Float, tch::Device::Cpu),
                        )],
                        _ => Vec::new(),
                    };
                    pair.send(format!("{s}:{i}"), &tensors);
                }
            })
        })
        .collect();
    for sender in senders {
        sender.join().unwrap();
    }
    let got = pair.received(SENDERS * FRAMES).await;
    assert_eq!(got.len(), SENDERS * FRAMES, "frames lost");
    let mut next = [0usize; SENDERS];
    for message in got {
        let (s, i) = message.split_once(':').unwrap();
        let (s, i): (usize, usize) = (s.parse().unwrap(), i.parse().unwrap());
        assert_eq!(i, next[s], "sender {s}'s frames out of order");
        next[s] += 1;
    }
}

/// TR-5: a sender that finds another holding the write half does not wait
/// for it: its frame waits in the backlog, and goes out with the holder's
/// next drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_never_waits_for_another_senders_write() {
    let pair = Arc::new(Pair::new().await);
    let held = lock(&pair.conn.direct);
    let sender = {
        let pair = pair.clone();
        std::thread::spawn(move || pair.send("left behind".into(), &[]))
    };
    sender.join().unwrap();
    assert_eq!(
        lock(&pair.conn.backlog).len(),
        1,
        "the frame waits in the backlog"
    );
    drop(held);
    pair.conn.drain_backlog().unwrap();
    pair.send("next".into(), &[]);
    assert_eq!(pair.received(2).await, ["left behind", "next"]);
}

/// TR-3 at a close: a frame a sender left in the backlog before the close
/// (it found the half held) still goes out, ahead of the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_sends_what_the_backlog_holds_first() {
    let pair = Arc::new(Pair::new().await);
    let held = lock(&pair.conn.direct);
    let sender = {
        let pair = pair.clone();
        std::thread::spawn(move || pair.send("last words".into(), &[]))
    };
    sender.join().unwrap();
    drop(held);
    pair.client.close(&pair.conn, "test over");
    assert_eq!(pair.received(1).await, ["last words"]);
}

#[tokio::test(flavor = "current_thread")]
async fn frames_sent_while_other_work_is_in_progress_leave_together_after_the_senders_turn() {
    let pair = Pair::new().await;
    let _other = pair.conn.start_work();
    let _mine = pair.conn.start_work();
    let sent: Vec<String> = (0..10).map(|i| format!("frame {i}")).collect();
    for text in &sent {
        pair.send(text.clone(), &[]);
    }
    // TR-10: none is written by its sender; the flush task writes them all
    // once this task lets the thread go.
    assert_eq!(lock(&pair.conn.backlog).len(), sent.len());
    assert_eq!(pair.received(sent.len()).await, sent);
    assert!(lock(&pair.conn.backlog).is_empty());
}

#[tokio::test(flavor = "current_thread")]
async fn a_frame_sent_with_no_other_work_in_progress_is_written_by_its_sender() {
    let pair = Pair::new().await;
    {
        let _ended = pair.conn.start_work();
    }
    let _mine = pair.conn.start_work();
    pair.send("alone".into(), &[]);
    assert!(lock(&pair.conn.backlog).is_empty());
    assert_eq!(pair.received(1).await, ["alone"]);
}

/// What a transport's handler heard of silences and closes.
#[derive(Default)]
struct Watcher {
    silent: Mutex<Vec<(String, String)>>,
    closed: Mutex<Vec<String>>,
}

impl Handler for Watcher {
    fn on_frame(&self, _: &Arc<Connection>, _: Vec<u8>, _: Vec<Tensor>) -> Result<(), String> {
        Ok(())
    }

    fn on_over_budget(&self, _: &Arc<Connection>, _: Vec<u8>, _: wasmrpc_torch_sys::BudgetRefusal) {
        panic!("no budget is set");
    }

    fn on_close(&self, _: &Arc<Connection>, reason: &str) {
        lock(&self.closed).push(reason.to_string());
    }

    fn on_silent(&self, conn: &Arc<Connection>, cause: &str) {
        lock(&self.silent).push((conn.peer.clone(), cause.to_string()));
    }
}

fn with_window(name: &str, rank: u32, window_ms: u64) -> TransportConfig {
    TransportConfig {
        failure_timeout: Some(std::time::Duration::from_millis(window_ms)),
        ..config(name, rank)
    }
}

/// LIVE-2: a peer that proved itself and then sends nothing (a stopped
/// process: its socket stays open) is failed once the window has passed,
/// its handler told why before the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_goes_silent_is_failed_after_the_window_with_the_cause() {
    let watcher = Arc::new(Watcher::default());
    let handler: Arc<dyn Handler> = watcher.clone();
    let loopback = ([127, 0, 0, 1], 0).into();
    let server = Transport::bind(
        with_window("server", 0, 300),
        loopback,
        Arc::downgrade(&handler),
    )
    .await
    .unwrap();
    // A dialer that completes the handshake and is never heard from again.
    let mut stalled =
        crate::transport::probe::connect(server.local_addr(), b"backlog test", "stalled")
            .await
            .unwrap();
    let started = std::time::Instant::now();
    while lock(&watcher.closed).is_empty() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the silent peer was never failed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    assert_eq!(
        *lock(&watcher.silent),
        [("stalled".to_string(), "no heartbeat for 0.3 s".to_string())]
    );
    assert_eq!(
        *lock(&watcher.closed),
        ["worker stalled failed: no heartbeat for 0.3 s"]
    );
    // LIVE-1: before the close, the idle connection carried heartbeats
    // (zero lengths) and nothing else; then the server closed it.
    let mut got = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stalled, &mut got)
        .await
        .unwrap();
    assert!(got.len() >= 4 && got.iter().all(|&b| b == 0), "{got:?}");
    assert_eq!(server.num_connections(), 0);
    server.abort();
}

/// LIVE-1: two live transports with nothing to say keep their connection
/// over many windows: heartbeats carry it, and the reader skips them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_between_live_peers_stays_open_on_heartbeats() {
    let (server_watch, client_watch) = (Arc::new(Watcher::default()), Arc::new(Watcher::default()));
    let handlers: [Arc<dyn Handler>; 2] = [server_watch.clone(), client_watch.clone()];
    let loopback = ([127, 0, 0, 1], 0).into();
    let server = Transport::bind(
        with_window("server", 0, 200),
        loopback,
        Arc::downgrade(&handlers[0]),
    )
    .await
    .unwrap();
    let client = Transport::bind(
        with_window("client", 1, 200),
        loopback,
        Arc::downgrade(&handlers[1]),
    )
    .await
    .unwrap();
    let conn = client
        .connection("server", server.local_addr())
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(!conn.is_closed());
    for w in [&server_watch, &client_watch] {
        assert!(lock(&w.silent).is_empty(), "{:?}", lock(&w.silent));
        assert!(lock(&w.closed).is_empty(), "{:?}", lock(&w.closed));
    }
    assert!(conn.activity.frames_sent() >= 5, "no heartbeats were sent");
    client.abort();
    server.abort();
}
