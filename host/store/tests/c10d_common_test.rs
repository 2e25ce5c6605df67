//! Ports of the store, timeout and environment tests of PyTorch's
//! `test/distributed/test_c10d_common.py` (seed suites `TimeoutTest`,
//! `AbstractTimeoutTest`, `LocalRankTest`, `CommTest`), one submodule per
//! suite, test functions named as in the seed. The process-group suites of
//! the same seed need tensors and live with the process-group crate, in
//! `host/c10d/tests/c10d_common_test.rs`.

mod common;

use std::time::Duration;

use common::env_of;

mod timeout_test {
    use std::sync::Arc;

    use super::common::timed;
    use super::*;
    use wasmrpc_store::{
        FileStore, HashStore, Store, TcpStore, TcpStoreOptions, store_based_barrier,
    };

    const WORLD_SIZE: i64 = 4;

    /// Ranks 0..3 of 4 enter the barrier; rank 3 never does. Returns the
    /// error texts (with their Python kinds) of the ranks that failed.
    async fn run_barrier(stores: Vec<Arc<dyn Store>>) -> Vec<(String, &'static str)> {
        let mut tasks = Vec::new();
        // `stores` outlives every rank: the TCP master's store owns the server.
        for (rank, store) in stores.iter().cloned().enumerate().take(3) {
            tasks.push(tokio::spawn(async move {
                store_based_barrier(
                    store.as_ref(),
                    rank as i64,
                    "_",
                    WORLD_SIZE,
                    Duration::from_secs(3),
                    Duration::from_millis(1500),
                )
                .await
            }));
        }
        let mut errors = Vec::new();
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                errors.push((e.to_string(), e.python_kind()));
            }
        }
        drop(stores);
        errors
    }

    fn check(errors: &[(String, &'static str)], joined: i64, store: &str) {
        assert_eq!(errors.len(), 3, "{store}: {errors:?}");
        for (text, kind) in errors {
            assert_eq!(*kind, "DistStoreError", "{store}: {text}");
            assert!(
                text.contains("Timed out initializing process group in store based barrier"),
                "{store}: {text}"
            );
            assert!(
                text.contains(&format!(
                    ", for key: store_based_barrier_key:_ (world_size=4, num_workers_joined={joined}, timeout=0:00:03 error="
                )),
                "{store}: {text}"
            );
        }
        let mut ranks: Vec<&str> = errors
            .iter()
            .map(|(t, _)| {
                t.split("barrier on rank ")
                    .nth(1)
                    .and_then(|r| r.split(',').next())
                    .unwrap_or("?")
            })
            .collect();
        ranks.sort();
        assert_eq!(ranks, ["0", "1", "2"], "{store}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_store_based_barrier() {
        timed(Duration::from_secs(60), async {
            // file: one file, a FileStore per rank, no world size.
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("barrier");
            let file: Vec<Arc<dyn Store>> = (0..4)
                .map(|_| Arc::new(FileStore::new(&path, None)) as Arc<dyn Store>)
                .collect();

            // tcp: rank 0 hosts, without waiting for workers.
            let options = TcpStoreOptions {
                wait_for_workers: false,
                world_size: Some(4),
                ..Default::default()
            };
            let master = TcpStore::start_master("localhost", 0, options.clone())
                .await
                .unwrap();
            let port = master.port();
            let mut tcp: Vec<Arc<dyn Store>> = vec![Arc::new(master)];
            for _ in 1..4 {
                tcp.push(Arc::new(
                    TcpStore::connect("localhost", port, options.clone())
                        .await
                        .unwrap(),
                ));
            }

            // hash: a separate HashStore per rank, as in the seed.
            let hash: Vec<Arc<dyn Store>> = (0..4)
                .map(|_| Arc::new(HashStore::new()) as Arc<dyn Store>)
                .collect();

            let (file_errors, tcp_errors, hash_errors) =
                tokio::join!(run_barrier(file), run_barrier(tcp), run_barrier(hash));
            check(&file_errors, 3, "file");
            check(&tcp_errors, 3, "tcp");
            check(&hash_errors, 1, "hash");
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_based_barrier_passes_when_everyone_joins() {
        timed(Duration::from_secs(30), async {
            let store: Arc<dyn Store> = Arc::new(HashStore::new());
            let mut tasks = Vec::new();
            for rank in 0..4 {
                let store = Arc::clone(&store);
                tasks.push(tokio::spawn(async move {
                    store_based_barrier(
                        store.as_ref(),
                        rank,
                        "all",
                        4,
                        Duration::from_secs(20),
                        Duration::from_secs(1),
                    )
                    .await
                }));
            }
            for t in tasks {
                t.await.unwrap().unwrap();
            }
            assert_eq!(
                store
                    .get("store_based_barrier_key:all:last_worker")
                    .await
                    .unwrap(),
                b"1"
            );
        })
        .await;
    }
}

mod abstract_timeout_test {
    use std::time::Instant;

    use super::common::timed;
    use super::*;
    use wasmrpc_store::rendezvous;

    /// The init methods of the seed's `_init_methods`: a temporary file and a
    /// TCP store on 127.0.0.1 (port 0: the master binds any free port).
    fn init_methods(dir: &tempfile::TempDir) -> Vec<String> {
        vec![
            format!("file://{}", dir.path().join("store").display()),
            "tcp://127.0.0.1:0".to_owned(),
        ]
    }

    /// The seed's `_test_store_timeout`: world size 1, rank 0, a 1 s timeout;
    /// `get` of a missing key fails with "Timeout". Returns the seconds it
    /// took.
    async fn store_timeout(init_method: &str) -> f64 {
        let (store, rank, world_size) = rendezvous(init_method, 0, 1, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!((rank, world_size), (0, 1));
        let t0 = Instant::now();
        let err = store.get("nonexistent key").await.unwrap_err();
        let took = t0.elapsed().as_secs_f64();
        assert!(err.to_string().contains("Timeout"), "{init_method}: {err}");
        took
    }

    #[tokio::test]
    async fn _test_store_timeout() {
        timed(Duration::from_secs(30), async {
            let dir = tempfile::tempdir().unwrap();
            for method in init_methods(&dir) {
                let took = store_timeout(&method).await;
                assert!((0.9..3.0).contains(&took), "{method}: {took}s");
            }
        })
        .await;
    }

    #[test]
    fn _test_default_store_timeout() {
        // As the seed: each init method on its own thread, joined within 5 s,
        // exactly one result each, under 3 s.
        let dir = tempfile::tempdir().unwrap();
        for method in init_methods(&dir) {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let took = rt.block_on(timed(Duration::from_secs(10), store_timeout(&method)));
                let _ = tx.send(took);
            });
            let took = rx
                .recv_timeout(Duration::from_secs(5))
                .expect("init method did not finish within 5 s");
            assert!(took < 3.0, "{took}s");
        }
    }
}

mod local_rank_test {
    #![allow(
        non_snake_case,
        reason = "test names match the seed's camelCase names exactly"
    )]

    use super::*;
    use wasmrpc_store::get_node_local_rank_with;

    #[test]
    fn testWithoutEnv() {
        let env = env_of::<&str>(&[]);
        let err = get_node_local_rank_with(None, &env).unwrap_err();
        assert_eq!(err.python_kind(), "RuntimeError");
        assert!(err.to_string().contains("LOCAL_RANK"), "{err}");
    }

    #[test]
    fn testWithoutEnvWithFallback() {
        assert_eq!(
            get_node_local_rank_with(Some(2), &env_of::<&str>(&[])).unwrap(),
            2
        );
    }

    #[test]
    fn testNodeLocalRankOverridesFallback() {
        for rank in 0..4 {
            let value = rank.to_string();
            let env = env_of(&[("LOCAL_RANK", &value)]);
            assert_eq!(get_node_local_rank_with(Some(123), &env).unwrap(), rank);
        }
    }

    #[test]
    fn testNodeLocalRank() {
        for rank in 0..4 {
            let value = rank.to_string();
            let env = env_of(&[("LOCAL_RANK", &value)]);
            assert_eq!(get_node_local_rank_with(None, &env).unwrap(), rank);
        }
    }
}

mod comm_test {
    use super::*;
    use wasmrpc_store::{DebugLevel, get_debug_level, set_debug_level_from_env_with};

    #[test]
    fn test_debug_level() {
        // Unset means OFF.
        set_debug_level_from_env_with(&env_of::<&str>(&[])).unwrap();
        assert_eq!(get_debug_level(), DebugLevel::Off);

        let mapping = [
            ("OFF", DebugLevel::Off),
            ("off", DebugLevel::Off),
            ("oFf", DebugLevel::Off),
            ("INFO", DebugLevel::Info),
            ("info", DebugLevel::Info),
            ("INfO", DebugLevel::Info),
            ("DETAIL", DebugLevel::Detail),
            ("detail", DebugLevel::Detail),
            ("DeTaIl", DebugLevel::Detail),
        ];
        for (mode, want) in mapping {
            set_debug_level_from_env_with(&env_of(&[("TORCH_DISTRIBUTED_DEBUG", mode)])).unwrap();
            let got = get_debug_level();
            assert_eq!(
                got, want,
                "Expected {mode} to map to {want:?} but got {got:?}"
            );
        }

        for invalid in ["foo", "0", "1", "-1"] {
            let err =
                set_debug_level_from_env_with(&env_of(&[("TORCH_DISTRIBUTED_DEBUG", invalid)]))
                    .unwrap_err();
            assert_eq!(err.python_kind(), "ValueError");
            assert!(
                err.to_string()
                    .starts_with("The value of TORCH_DISTRIBUTED_DEBUG must"),
                "{err}"
            );
            assert_eq!(
                err.to_string(),
                "The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, or DETAIL."
            );
        }
    }
}
