//! The same behaviour checks run against every store: HashStore, FileStore,
//! TcpStore (on our server) and PrefixStore.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{conformance, timed};
use wasmrpc_store::{
    FileStore, HashStore, PrefixStore, Store, TcpStore, TcpStoreOptions, TcpStoreServer,
};

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn hash_store_conformance() {
    timed(LIMIT, conformance(Arc::new(HashStore::new()))).await;
}

#[tokio::test]
async fn file_store_conformance() {
    let dir = tempfile::tempdir().unwrap();
    timed(
        LIMIT,
        conformance(Arc::new(FileStore::new(dir.path().join("store"), None))),
    )
    .await;
}

#[tokio::test]
async fn tcp_store_conformance() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let store = TcpStore::connect("127.0.0.1", server.port(), TcpStoreOptions::default())
            .await
            .unwrap();
        conformance(Arc::new(store)).await;
    })
    .await;
}

#[tokio::test]
async fn prefix_store_conformance() {
    timed(LIMIT, async {
        let inner: Arc<dyn Store> = Arc::new(HashStore::new());
        conformance(Arc::new(PrefixStore::new("pfx", Arc::clone(&inner)))).await;
        // Keys really live under the prefix.
        assert_eq!(inner.get("pfx/k").await.unwrap(), b"v2");
        assert!(!inner.check(&["k"]).await.unwrap());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_is_shared_between_instances() {
    timed(LIMIT, async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared");
        let a = Arc::new(FileStore::new(&path, Some(2)));
        let b = Arc::new(FileStore::new(&path, Some(2)));
        b.set_timeout(Duration::from_secs(5));
        let writer = Arc::clone(&a);
        let task = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            writer.set("x", b"from a").await.unwrap();
        });
        assert_eq!(b.get("x").await.unwrap(), b"from a");
        task.await.unwrap();
        // Concurrent adds from both instances never lose an increment.
        let mut tasks = Vec::new();
        for store in [Arc::clone(&a), Arc::clone(&b)] {
            tasks.push(tokio::spawn(async move {
                for _ in 0..50 {
                    store.add("n", 1).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(a.add("n", 0).await.unwrap(), 100);
        // The last of the two workers to go removes the file.
        drop(a);
        assert!(path.exists());
        drop(b);
        assert!(!path.exists());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_store_wakes_many_waiters() {
    timed(LIMIT, async {
        let store = Arc::new(HashStore::new());
        let mut waiters = Vec::new();
        for _ in 0..100 {
            let s = Arc::clone(&store);
            waiters.push(tokio::spawn(async move {
                s.wait(&["go"], Duration::from_secs(20)).await
            }));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        store.set("go", b"1").await.unwrap();
        for w in waiters {
            w.await.unwrap().unwrap();
        }
    })
    .await;
}
