//! Tests of `tcp`.

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
