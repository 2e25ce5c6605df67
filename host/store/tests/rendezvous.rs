//! `rendezvous` end to end: PyTorch's error texts, `env://` and `tcp://`
//! with several ranks, the torchrun agent-store path, and `file://`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{env_of, free_port, timed};
use wasmrpc_store::{Error, Store, TcpStoreServer, rendezvous_with};

const LIMIT: Duration = Duration::from_secs(30);
const T: Duration = Duration::from_secs(10);

async fn error_of(url: &str, rank: i64, world_size: i64, env: &[(&str, String)]) -> Error {
    let env = env_of(env);
    match rendezvous_with(url, rank, world_size, T, &env).await {
        Ok(_) => panic!("{url} should fail"),
        Err(e) => e,
    }
}

/// URL, rank, world size, environment, Python exception kind, exact text.
type Case<'a> = (&'a str, i64, i64, Vec<(&'a str, String)>, &'a str, &'a str);

#[tokio::test]
async fn missing_pieces_give_pytorchs_texts() {
    timed(LIMIT, async {
        let cases: Vec<Case<'_>> = vec![
            (
                "env://",
                -1,
                -1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using env:// rendezvous: environment variable RANK expected, but not set",
            ),
            (
                "env://",
                0,
                -1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using env:// rendezvous: environment variable WORLD_SIZE expected, but not set",
            ),
            (
                "env://",
                -1,
                -1,
                vec![("RANK", "0".into()), ("WORLD_SIZE", "1".into())],
                "ValueError",
                "Error initializing torch.distributed using env:// rendezvous: environment variable MASTER_ADDR expected, but not set",
            ),
            (
                "env://",
                0,
                1,
                vec![("MASTER_ADDR", "127.0.0.1".into()), ("MASTER_PORT", "".into())],
                "ValueError",
                "Error initializing torch.distributed using env:// rendezvous: environment variable MASTER_PORT expected, but not set",
            ),
            (
                "file:///tmp/x",
                -1,
                -1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using file:// rendezvous: rank parameter missing",
            ),
            (
                "file:///tmp/x?rank=0",
                -1,
                -1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using file:// rendezvous: world size parameter missing",
            ),
            (
                "file://",
                0,
                1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using file:// rendezvous: path missing",
            ),
            (
                "tcp://127.0.0.1",
                0,
                1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using tcp:// rendezvous: port number missing",
            ),
            (
                "tcp://127.0.0.1:1",
                -1,
                -1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using tcp:// rendezvous: rank parameter missing",
            ),
            (
                "tcp://127.0.0.1:1",
                0,
                -1,
                vec![],
                "ValueError",
                "Error initializing torch.distributed using tcp:// rendezvous: world size parameter missing",
            ),
            (
                "foo://bar",
                0,
                1,
                vec![],
                "RuntimeError",
                "No rendezvous handler for foo://",
            ),
            (
                "tcp://127.0.0.1:1?rank=0",
                0,
                1,
                vec![],
                "AssertionError",
                "The url: tcp://127.0.0.1:1?rank=0 has node-specific arguments(rank, world_size) already.",
            ),
            (
                "env://",
                0,
                1,
                vec![("MASTER_ADDR", "127.0.0.1".into()), ("MASTER_PORT", "70000".into())],
                "ValueError",
                "port must have value from 0 to 65535 but was 70000.",
            ),
        ];
        for (url, rank, world_size, env, kind, text) in cases {
            let err = error_of(url, rank, world_size, &env).await;
            assert_eq!(err.to_string(), text, "{url}");
            assert_eq!(err.python_kind(), kind, "{url}");
        }
    })
    .await;
}

/// Every rank publishes its rank and reads everyone else's.
async fn exchange(stores: Vec<(Arc<dyn Store>, i64, i64)>) {
    let world = stores.len() as i64;
    let mut tasks = Vec::new();
    // The stores live until every rank is done: rank 0's owns the server.
    for (store, rank, world_size) in stores.iter().cloned() {
        assert_eq!(world_size, world);
        tasks.push(tokio::spawn(async move {
            store
                .set(&format!("rank{rank}"), rank.to_string().as_bytes())
                .await
                .unwrap();
            for other in 0..world {
                let got = store.get(&format!("rank{other}")).await.unwrap();
                assert_eq!(got, other.to_string().as_bytes());
            }
            rank
        }));
    }
    let mut ranks = Vec::new();
    for t in tasks {
        ranks.push(t.await.unwrap());
    }
    ranks.sort();
    assert_eq!(ranks, (0..world).collect::<Vec<_>>());
    drop(stores);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_rendezvous_rank0_hosts_the_store() {
    timed(LIMIT, async {
        let port = free_port().to_string();
        let mut joins = Vec::new();
        for rank in 0..3 {
            let env = env_of(&[
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", "3".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.clone()),
            ]);
            joins.push(tokio::spawn(async move {
                rendezvous_with("env://", -1, -1, T, &env).await.unwrap()
            }));
        }
        let mut stores = Vec::new();
        for j in joins {
            stores.push(j.await.unwrap());
        }
        // Rank 0 returned, so all three counted themselves on PyTorch's
        // `init/` key (rank 0 waits for that). RDV-2: the timeout is set.
        let (store, ..) = &stores[0];
        assert_eq!(store.timeout(), T);
        exchange(stores).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_rendezvous_with_explicit_rank_and_world_size() {
    timed(LIMIT, async {
        let url = format!("tcp://127.0.0.1:{}", free_port());
        let no_env = env_of::<&str>(&[]);
        let (a, b) = tokio::join!(
            rendezvous_with(&url, 0, 2, T, &no_env),
            rendezvous_with(&url, 1, 2, T, &no_env)
        );
        exchange(vec![a.unwrap(), b.unwrap()]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_store_makes_every_rank_a_client() {
    timed(LIMIT, async {
        // The "agent" already hosts the store; rank 0 must not try to host
        // another one, so it connects to this one.
        let agent = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let mut stores = Vec::new();
        for rank in 0..2 {
            let env = env_of(&[
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", agent.port().to_string()),
                ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ]);
            stores.push(rendezvous_with("env://", -1, -1, T, &env).await.unwrap());
        }
        // Both are clients of the agent's store: a key one sets, the other
        // reads.
        stores[0].0.set("x", b"1").await.unwrap();
        assert_eq!(stores[1].0.get("x").await.unwrap(), b"1");
        exchange(stores).await;
        drop(agent);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_rendezvous_shares_the_file_and_removes_it() {
    timed(LIMIT, async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rdv");
        let no_env = env_of::<&str>(&[]);
        let url = |rank: i64| format!("file://{}?rank={rank}&world_size=2", path.display());
        let a = rendezvous_with(&url(0), -1, -1, T, &no_env).await.unwrap();
        let b = rendezvous_with(&url(1), -1, -1, T, &no_env).await.unwrap();
        exchange(vec![a, b]).await;
        // Both stores are gone: the last removed the file.
        assert!(!path.exists());
    })
    .await;
}
