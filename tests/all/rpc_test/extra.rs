//! The agent's own failure and scale tests (not seed tests): a peer that
//! vanishes mid-call, hostile bytes on a worker's port, a flood of idle
//! sockets, unauthenticated peers, same-host shared memory, and a
//! 32-worker all-to-all.

use std::time::{Duration, Instant};

use anyhow::ensure;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use wasmrpc::testing::worker_name;
use wasmrpc::transport::probe;
use wasmrpc::{ErrorKind, Future, RpcBackendOptions, args, wait_all};
use wasmrpc_tests::{cluster, expect_err, expect_tensor, ones, timed};

const SECRET: &[u8] = b"extra-tests-secret";

fn secret_options() -> RpcBackendOptions {
    RpcBackendOptions {
        cluster_secret: Some(SECRET.to_vec()),
        ..Default::default()
    }
}

/// A stream an authenticated test peer writes raw bytes to: plain TCP, or
/// TLS when the cluster runs TLS.
trait PeerStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> PeerStream for T {}

/// Connects to `addr` and passes the handshake as `name` with `secret`:
/// over TLS with a certificate of `ca` naming `name` when the cluster runs
/// TLS (`ca` is its CA), else over plain TCP.
async fn connect_peer(
    ca: Option<&wasmrpc::CertificateAuthority>,
    addr: std::net::SocketAddr,
    server: &str,
    secret: &[u8],
    name: &str,
) -> wasmrpc::Result<Box<dyn PeerStream>> {
    match ca {
        None => Ok(Box::new(probe::connect(addr, secret, name).await?)),
        Some(ca) => {
            let tls = probe::TlsProbe {
                ca_pem: ca.cert_pem().to_string(),
                client: Some(ca.credentials_for(name)?),
                server: server.to_string(),
            };
            Ok(Box::new(
                probe::connect_tls(addr, &tls, secret, name).await?,
            ))
        }
    }
}

/// A started group of two with `options`, its CA when it runs TLS (what a
/// test peer needs to pass TLS), and the address worker `rank` listens on.
async fn group_of_two(
    options: RpcBackendOptions,
    rank: u32,
) -> anyhow::Result<(
    wasmrpc::testing::Cluster,
    Option<std::sync::Arc<wasmrpc::CertificateAuthority>>,
    std::net::SocketAddr,
)> {
    let builder = cluster(2).options(options);
    let ca = builder.authority().cloned();
    let c = builder.start().await?;
    let addr = c
        .agent(rank)
        .local_addr()
        .ok_or_else(|| anyhow::anyhow!("no address"))?;
    Ok((c, ca, addr))
}

/// Reads until the peer closes the connection; fails if it stays open.
/// The wait is half the acceptor's 10 s handshake timeout: a worker must
/// refuse bad bytes when it reads them, not when that timeout ends.
async fn expect_closed<S: tokio::io::AsyncRead + Unpin + ?Sized>(
    stream: &mut S,
) -> anyhow::Result<()> {
    let mut buf = [0u8; 256];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        ensure!(
            Instant::now() < deadline,
            "the worker kept the connection open"
        );
        match tokio::time::timeout_at(deadline.into(), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(()),
            Ok(Ok(_)) => continue,
            Err(_) => anyhow::bail!("the worker kept the connection open"),
        }
    }
}

#[test]
fn test_peer_vanishing_mid_call_fails_pending_calls_promptly() {
    timed(async {
        let c = cluster(4).start().await?;
        let (a0, a2) = (c.agent(0).clone(), c.agent(2).clone());
        // Long calls into worker2, with a timeout far beyond the test's.
        let pending: Vec<Future> = (0..3)
            .map(|_| {
                a0.rpc_async_with_timeout(
                    "worker2",
                    "seed_fns::my_sleep_func",
                    args![30],
                    Duration::from_secs(60),
                )
            })
            .collect();
        // worker2 has received them (they are running there) before it dies.
        let start = Instant::now();
        while a2
            .get_debug_info()
            .get("agent.server_active_calls")
            .map(String::as_str)
            != Some("3")
        {
            ensure!(
                start.elapsed() < Duration::from_secs(10),
                "calls never reached worker2"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let died = Instant::now();
        a2.abort();
        for f in &pending {
            let e = expect_err(f.wait().await, ErrorKind::RuntimeError, "worker2")?;
            ensure!(e.message().contains("closed"), "{e}");
        }
        ensure!(
            died.elapsed() < Duration::from_secs(5),
            "pending calls failed only after {:?}",
            died.elapsed()
        );
        // The rest of the group keeps working, and new calls to the dead
        // worker fail quickly.
        expect_tensor(
            &a0.rpc_sync("worker1", "aten::add", args![ones(&[2]), 1])
                .await?,
            &(ones(&[2]) + 1),
        )?;
        expect_tensor(
            &c.agent(3)
                .rpc_sync("worker1", "aten::add", args![ones(&[2]), 2])
                .await?,
            &(ones(&[2]) + 2),
        )?;
        expect_err(
            a0.rpc_sync("worker2", "aten::add", args![ones(&[2]), 1])
                .await,
            ErrorKind::RuntimeError,
            "worker2",
        )?;
        for r in [0, 1, 3] {
            c.agent(r).shutdown(false, Duration::ZERO).await?;
        }
        Ok(())
    });
}

#[test]
fn test_garbage_bytes_and_oversized_frames_close_only_that_connection() {
    timed(async {
        let options = RpcBackendOptions {
            max_frame_size: 1 << 20,
            ..secret_options()
        };
        let (c, ca, addr) = group_of_two(options, 1).await?;
        let peer = |name| connect_peer(ca.as_deref(), addr, "worker1", SECRET, name);

        // Garbage before any handshake.
        let mut raw = tokio::net::TcpStream::connect(addr).await?;
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\xff\xff\xff\xff garbage")
            .await?;
        expect_closed(&mut raw).await?;

        // An authenticated peer sending a malformed frame header.
        let mut s = peer("intruder").await?;
        s.write_all(&[5, 0, 0, 0, 0xff, 0xee, 0xdd, 0xcc, 0xbb])
            .await?;
        s.flush().await?;
        expect_closed(&mut *s).await?;

        // An authenticated peer announcing a frame over the maximum.
        let mut s = peer("intruder2").await?;
        s.write_all(&u32::MAX.to_le_bytes()).await?;
        s.flush().await?;
        expect_closed(&mut *s).await?;

        // A truncated frame followed by a hang-up.
        let mut s = peer("intruder3").await?;
        s.write_all(&[100, 0, 0, 0, 1, 2, 3]).await?;
        s.flush().await?;
        drop(s);

        // The worker still serves its real peers.
        let r = c
            .agent(0)
            .rpc_sync("worker1", "aten::add", args![ones(&[3]), 1])
            .await?;
        expect_tensor(&r, &(ones(&[3]) + 1))?;
        // A message over the maximum is refused by the sender, with the size.
        let big = ones(&[1 << 19]);
        let e = expect_err(
            c.agent(0)
                .rpc_sync("worker1", "aten::add", args![big, 1])
                .await,
            ErrorKind::RuntimeError,
            "",
        )?;
        ensure!(e.message().contains("maximum frame size"), "{e}");
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_idle_sockets_cannot_lock_real_peers_out() {
    timed(async {
        let (c, ca, addr) = group_of_two(secret_options(), 1).await?;
        // A flood from another loopback address: sockets that connect and
        // never send a byte, each of which would hold a handshake (a task,
        // a descriptor, a TLS buffer) for its whole timeout.
        const FLOOD: usize = 400;
        let mut watches = tokio::task::JoinSet::new();
        for _ in 0..FLOOD {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind("127.0.0.2:0".parse()?)?;
            let mut stream = socket.connect(addr).await?;
            // Whether the worker closes it within 3 s; an open one is kept.
            watches.spawn(async move {
                let mut byte = [0u8; 1];
                let read = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut byte));
                match read.await {
                    Ok(Ok(0) | Err(_)) => None,
                    _ => Some(stream),
                }
            });
        }
        // The worker keeps only the newest of them in their handshake.
        let flood: Vec<_> = watches.join_all().await.into_iter().flatten().collect();
        let closed = FLOOD - flood.len();
        ensure!(
            closed >= FLOOD / 2,
            "the worker held {} of {FLOOD} idle sockets open",
            FLOOD - closed
        );
        // A real peer still gets in while the flood's newest are held.
        let peer = connect_peer(ca.as_deref(), addr, "worker1", SECRET, "friend").await;
        ensure!(peer.is_ok(), "a real peer was locked out: {:?}", peer.err());
        expect_tensor(
            &c.agent(0)
                .rpc_sync("worker1", "aten::add", args![ones(&[2]), 1])
                .await?,
            &(ones(&[2]) + 1),
        )?;
        drop(flood);
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_large_tensors_cross_in_shared_memory_between_workers_on_one_host() {
    timed(async {
        for shared_memory in [true, false] {
            let options = RpcBackendOptions {
                shared_memory,
                ..secret_options()
            };
            let c = cluster(2).options(options).start().await?;
            // 1 MiB (copied before the frame goes) and 8 MiB (copied while
            // the receiver reads) each way: through shared memory when it
            // is on, over the connection when it is off; the same values
            // either way.
            for _ in 0..3 {
                for floats in [1 << 18, 2 << 20] {
                    let big = tch::Tensor::rand([floats], (tch::Kind::Float, tch::Device::Cpu));
                    let r = c
                        .agent(0)
                        .rpc_sync("worker1", "aten::add", args![big.shallow_clone(), 1])
                        .await?;
                    expect_tensor(&r, &(&big + 1))?;
                }
            }
            let info = |rank: u32, key: &str| -> anyhow::Result<u64> {
                let info = c.agent(rank).get_debug_info();
                let value = info
                    .get(key)
                    .ok_or_else(|| anyhow::anyhow!("no {key} in {info:?}"))?;
                Ok(value.parse()?)
            };
            let (sent, answered) = (
                info(0, "agent.shared_memory_bytes_sent")?,
                info(1, "agent.shared_memory_bytes_sent")?,
            );
            if shared_memory {
                ensure!(info(0, "agent.shared_memory_links")? == 1);
                ensure!(
                    sent == 3 * (9 << 20) && answered == 3 * (9 << 20),
                    "shared {sent} and {answered} bytes"
                );
            } else {
                ensure!(info(0, "agent.shared_memory_links")? == 0);
                ensure!(sent == 0 && answered == 0);
            }
            c.shutdown().await?;
        }
        Ok(())
    });
}

#[test]
fn test_unauthenticated_peer_is_refused() {
    timed(async {
        let (c, ca, addr) = group_of_two(secret_options(), 0).await?;
        let linger = Duration::from_millis(300);
        // Over TLS the same peers hold certificates of the cluster CA naming
        // them: the secret is checked inside TLS.
        let probe = |secret: &'static [u8], name: &'static str| {
            let ca = ca.clone();
            async move {
                match ca {
                    None => probe::probe(addr, secret, name, linger).await,
                    Some(ca) => {
                        let tls = probe::TlsProbe {
                            ca_pem: ca.cert_pem().to_string(),
                            client: Some(ca.credentials_for(name)?),
                            server: "worker0".to_string(),
                        };
                        probe::probe_tls(addr, &tls, secret, name, linger).await
                    }
                }
            }
        };
        ensure!(probe(b"wrong secret", "mallory").await.is_err());
        probe(SECRET, "friend").await?;
        // A worker of another cluster (another secret) cannot join in either.
        ensure!(probe(b"", "worker1").await.is_err());
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_all_to_all_32_workers() {
    timed(async {
        let c = cluster(32).start().await?;
        c.run_on_all(|w| async move {
            let futs: Vec<Future> = (0..w.world_size)
                .filter(|r| *r != w.rank)
                .map(|r| {
                    w.agent.rpc_async(
                        worker_name(r),
                        "aten::add",
                        args![ones(&[4]), i64::from(w.rank)],
                    )
                })
                .collect();
            for r in wait_all(&futs).await? {
                expect_tensor(&r, &(ones(&[4]) + i64::from(w.rank)))?;
            }
            anyhow::Ok(())
        })
        .await?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_feature_requests_are_served_and_unknown_kinds_get_a_clear_error_reply() {
    use wasmrpc::MessageKind;
    use wasmrpc::dist_autograd::{AutogradEnvelope, AutogradMessage};
    timed(async {
        let c = cluster(2).start().await?;
        let a = c.agent(0);
        let envelope = AutogradEnvelope {
            context_id: 1,
            message_id: 2,
            from_worker: 0,
        };
        let grad = ones(&[2]);
        // Served by distributed autograd: an unknown context is an error for
        // gradients, and a no-op to clean up.
        let propagate = AutogradMessage::PropagateGradients {
            envelope,
            grads: vec![wasmrpc::Value::Tensor(0)],
            retain_graph: false,
        };
        let f = a.request(
            "worker1",
            propagate.kind(),
            propagate.encode()?,
            &[grad.shallow_clone()],
            None,
        );
        expect_err(
            f.wait().await,
            ErrorKind::RuntimeError,
            "Error on Node 1: Could not find autograd context with id: 1",
        )?;
        let cleanup = AutogradMessage::CleanupAutogradContext {
            context_ids: vec![1],
        };
        a.request("worker1", cleanup.kind(), cleanup.encode()?, &[], None)
            .wait()
            .await?;
        // A kind no feature of the callee serves, and a body that is not
        // the kind's: clear errors.
        let unknown = MessageKind::new("ProfilingRequest");
        let f = a.request("worker1", unknown, vec![1, 2, 3], &[], None);
        let e = expect_err(
            f.wait().await,
            ErrorKind::NotImplementedError,
            "ProfilingRequest",
        )?;
        ensure!(e.message().contains("worker1"), "{e}");
        let f = a.request("worker1", cleanup.kind(), vec![0xff; 3], &[], None);
        expect_err(
            f.wait().await,
            ErrorKind::RuntimeError,
            "malformed CleanupAutogradContext request",
        )?;
        // The worker is unharmed.
        let r = a
            .rpc_sync("worker1", "aten::add", args![ones(&[2]), 1])
            .await?;
        expect_tensor(&r, &(ones(&[2]) + 1))?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_debug_info_sources_are_merged_and_polled() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    timed(async {
        let c = cluster(2).start().await?;
        let a = c.agent(0).clone();
        let counter = Arc::new(AtomicU64::new(3));
        let source = counter.clone();
        a.add_debug_info_source(move || {
            [(
                "rref.num_pending_users".to_string(),
                source.load(Ordering::SeqCst).to_string(),
            )]
            .into()
        });
        ensure!(a.get_debug_info().contains_key("agent.thread_pool_size"));
        let waiter = tokio::spawn({
            let a = a.clone();
            async move {
                wasmrpc::testing::wait_until_debug_info(
                    &a,
                    "pending users",
                    Duration::from_secs(10),
                    |m| m.get("rref.num_pending_users").map(String::as_str) == Some("0"),
                )
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        ensure!(!waiter.is_finished());
        counter.store(0, Ordering::SeqCst);
        waiter.await??;
        let e =
            wasmrpc::testing::wait_until_debug_info(&a, "never", Duration::from_millis(50), |_| {
                false
            })
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("an impossible wait succeeded"))?;
        ensure!(
            e.kind() == ErrorKind::ValueError
                && e.message().contains("Timed out waiting for never")
        );
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_autograd_envelope_reaches_the_callee() {
    use wasmrpc::dist_autograd::AutogradEnvelope;
    timed(async {
        let c = cluster(2)
            .functions(|r| {
                wasmrpc_tests::register_all(r);
                r.register_native("test::envelope", |ctx, _args| async move {
                    Ok(match AutogradEnvelope::of(&ctx) {
                        Some(e) => wasmrpc::Payload::tuple(vec![
                            e.context_id.into(),
                            e.message_id.into(),
                            e.from_worker.into(),
                            ctx.caller().name.clone().into(),
                        ]),
                        None => wasmrpc::Payload::none(),
                    })
                });
            })
            .start()
            .await?;
        let a = c.agent(0);
        let envelope = AutogradEnvelope {
            context_id: 7,
            message_id: 9,
            from_worker: 0,
        };
        let options = wasmrpc::CallOptions {
            fields: vec![envelope.field()],
            ..Default::default()
        };
        let got = a
            .call("worker1", "test::envelope", args![], options)
            .await?;
        let items = got.items()?;
        ensure!(items[0].as_int()? == 7 && items[1].as_int()? == 9 && items[2].as_int()? == 0);
        ensure!(items[3].as_str()? == "worker0");
        ensure!(
            a.rpc_sync("worker1", "test::envelope", args![])
                .await?
                .is_none()
        );
        c.shutdown().await?;
        Ok(())
    });
}

/// A view of a shared store whose `multi_get` is slow: the rendezvous of the
/// worker using it finishes late.
#[derive(Debug)]
struct SlowMultiGet(std::sync::Arc<dyn wasmrpc::store::Store>, Duration);

#[async_trait::async_trait]
impl wasmrpc::store::Store for SlowMultiGet {
    async fn set(&self, key: &str, value: &[u8]) -> wasmrpc::store::Result<()> {
        self.0.set(key, value).await
    }
    async fn get(&self, key: &str) -> wasmrpc::store::Result<Vec<u8>> {
        self.0.get(key).await
    }
    async fn add(&self, key: &str, delta: i64) -> wasmrpc::store::Result<i64> {
        self.0.add(key, delta).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> wasmrpc::store::Result<Vec<u8>> {
        self.0.compare_set(key, expected, desired).await
    }
    async fn wait(&self, keys: &[&str], timeout: Duration) -> wasmrpc::store::Result<()> {
        self.0.wait(keys, timeout).await
    }
    async fn check(&self, keys: &[&str]) -> wasmrpc::store::Result<bool> {
        self.0.check(keys).await
    }
    async fn delete_key(&self, key: &str) -> wasmrpc::store::Result<bool> {
        self.0.delete_key(key).await
    }
    async fn num_keys(&self) -> wasmrpc::store::Result<i64> {
        self.0.num_keys().await
    }
    async fn append(&self, key: &str, value: &[u8]) -> wasmrpc::store::Result<()> {
        self.0.append(key, value).await
    }
    async fn multi_get(&self, keys: &[&str]) -> wasmrpc::store::Result<Vec<Vec<u8>>> {
        tokio::time::sleep(self.1).await;
        self.0.multi_get(keys).await
    }
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> wasmrpc::store::Result<()> {
        self.0.multi_set(keys, values).await
    }
    fn timeout(&self) -> Duration {
        self.0.timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.0.set_timeout(timeout)
    }
}

#[test]
fn test_call_arriving_before_the_callees_init_returns_waits_for_it() {
    timed(async {
        let store = wasmrpc::testing::fresh_store();
        let builder = cluster(2);
        let (o0, o1) = (builder.options_for(0), builder.options_for(1));
        let slow: std::sync::Arc<dyn wasmrpc::store::Store> =
            std::sync::Arc::new(SlowMultiGet(store.clone(), Duration::from_millis(500)));
        let late =
            tokio::spawn(
                async move { wasmrpc::init_rpc("worker1", Some(1), Some(2), slow, o1).await },
            );
        let a0 = wasmrpc::init_rpc("worker0", Some(0), Some(2), store, o0).await?;
        // worker1 is still in rendezvous; its function calls back worker0,
        // which it can only name once its worker table is filled.
        ensure!(!late.is_finished());
        let r = a0
            .rpc_sync("worker1", "seed_fns::nested_rpc", args!["worker0"])
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 1))?;
        let a1 = late.await??;
        let (r0, r1) = tokio::join!(
            a0.shutdown(true, Duration::ZERO),
            a1.shutdown(true, Duration::ZERO)
        );
        r0?;
        r1?;
        Ok(())
    });
}

/// The RPC core alone: agents started with no extension call and serve
/// functions (a native one and a builtin op), shut down gracefully, and
/// refuse what needs a feature they lack (RRefs) with a clear error; the
/// features' own functions are not served.
#[test]
fn test_an_agent_without_features_calls_and_serves() {
    timed(async {
        let store = wasmrpc::testing::fresh_store();
        let starts: Vec<_> = (0..2u32)
            .map(|rank| {
                let store = store.clone();
                let options = RpcBackendOptions::default();
                options
                    .registry
                    .register_native("core::double", |_ctx, args| async move {
                        Ok(wasmrpc::Payload::from(args.get(0)?.as_int()? * 2))
                    });
                tokio::spawn(async move {
                    wasmrpc::init_rpc_with(
                        &worker_name(rank),
                        Some(rank),
                        Some(2),
                        store,
                        options,
                        wasmrpc::Extensions::none(),
                    )
                    .await
                })
            })
            .collect();
        let mut agents = Vec::new();
        for start in starts {
            agents.push(start.await??);
        }
        let a = &agents[0];
        ensure!(
            a.rpc_sync("worker1", "core::double", args![21])
                .await?
                .as_int()?
                == 42
        );
        let r = a
            .rpc_sync("worker1", "aten::add", args![ones(&[2]), 1])
            .await?;
        expect_tensor(&r, &(ones(&[2]) + 1))?;
        // No RRef feature: RRefs cannot be sent, and its functions are not
        // there.
        let rref = wasmrpc::RRef::new(a, ones(&[1]));
        expect_err(
            a.rpc_sync("worker1", "core::double", args![rref]).await,
            ErrorKind::RuntimeError,
            "no extension that sends RRefs",
        )?;
        expect_err(
            a.rpc_sync("worker1", "wasmrpc::_rref_fetch", args![]).await,
            ErrorKind::RuntimeError,
            "is not registered on worker worker1",
        )?;
        ensure!(!a.get_debug_info().contains_key("num_owner_rrefs"));
        let stops: Vec<_> = agents
            .iter()
            .map(|a| {
                let a = a.clone();
                tokio::spawn(async move { a.shutdown(true, Duration::from_secs(30)).await })
            })
            .collect();
        for stop in stops {
            stop.await??;
        }
        Ok(())
    });
}
