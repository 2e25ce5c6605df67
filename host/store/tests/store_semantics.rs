//! The same behaviour checks run against every store: HashStore, FileStore,
//! TcpStore (on our server) and PrefixStore.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::timed;
use wasmrpc_store::{
    Error, FileStore, HashStore, PrefixStore, Store, TcpStore, TcpStoreOptions, TcpStoreServer,
};

const LIMIT: Duration = Duration::from_secs(30);

/// Every operation, with PyTorch's semantics.
async fn conformance(store: Arc<dyn Store>) {
    store.set_timeout(Duration::from_secs(5));

    store.set("k", b"v1").await.unwrap();
    assert_eq!(store.get("k").await.unwrap(), b"v1");
    store.set("k", b"v2").await.unwrap();
    assert_eq!(store.get("k").await.unwrap(), b"v2", "set overwrites");
    store.set("empty", b"").await.unwrap();
    assert_eq!(store.get("empty").await.unwrap(), b"");
    let binary: Vec<u8> = (0..=255).collect();
    store.set("bin", &binary).await.unwrap();
    assert_eq!(store.get("bin").await.unwrap(), binary);

    assert_eq!(
        store.add("c", 5).await.unwrap(),
        5,
        "missing counter starts at 0"
    );
    assert_eq!(store.add("c", -2).await.unwrap(), 3);
    assert_eq!(store.add("c", 0).await.unwrap(), 3, "add 0 reads");
    assert_eq!(
        store.get("c").await.unwrap(),
        b"3",
        "counters are decimal text"
    );

    // compare_set, every branch.
    assert_eq!(
        store.compare_set("cs", b"", b"first").await.unwrap(),
        b"first"
    );
    assert_eq!(store.get("cs").await.unwrap(), b"first");
    assert_eq!(
        store.compare_set("cs", b"wrong", b"x").await.unwrap(),
        b"first"
    );
    assert_eq!(
        store.compare_set("cs", b"first", b"second").await.unwrap(),
        b"second"
    );
    assert_eq!(store.get("cs").await.unwrap(), b"second");
    assert_eq!(
        store
            .compare_set("absent", b"expected", b"x")
            .await
            .unwrap(),
        b"expected",
        "absent key with non-empty expected returns expected"
    );
    assert!(!store.check(&["absent"]).await.unwrap(), "and sets nothing");

    assert!(store.check(&["k", "c"]).await.unwrap());
    assert!(!store.check(&["k", "nope"]).await.unwrap());

    store.append("log", b"ab").await.unwrap();
    store.append("log", b"cd").await.unwrap();
    assert_eq!(store.get("log").await.unwrap(), b"abcd");

    store
        .multi_set(&["m1", "m2"], &[b"one".as_slice(), b"two"])
        .await
        .unwrap();
    assert_eq!(
        store.multi_get(&["m2", "m1"]).await.unwrap(),
        vec![b"two".to_vec(), b"one".to_vec()]
    );
    assert!(matches!(
        store.multi_set(&["a"], &[]).await,
        Err(Error::InvalidArgument(_))
    ));

    let before = store.num_keys().await.unwrap();
    store.set("fresh", b"1").await.unwrap();
    assert_eq!(store.num_keys().await.unwrap(), before + 1);
    assert!(store.delete_key("fresh").await.unwrap());
    assert_eq!(store.num_keys().await.unwrap(), before);
    assert!(!store.check(&["fresh"]).await.unwrap());

    store
        .wait(&["k", "c"], Duration::from_secs(1))
        .await
        .unwrap();

    // A wait is woken by a set from elsewhere, well before its timeout.
    let setter = Arc::clone(&store);
    let t0 = Instant::now();
    let task = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        setter.set("late", b"here").await.unwrap();
    });
    store
        .wait(&["late"], Duration::from_secs(10))
        .await
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    task.await.unwrap();

    // Timeouts: get uses the store's timeout, wait its argument.
    store.set_timeout(Duration::from_millis(500));
    let t0 = Instant::now();
    let err = store.get("never").await.unwrap_err();
    let took = t0.elapsed();
    assert!(err.to_string().contains("Timeout"), "{err}");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let t0 = Instant::now();
    let err = store
        .wait(&["never"], Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("Timeout"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(3));

    // The store still works after a timeout.
    assert_eq!(store.get("k").await.unwrap(), b"v2");
}

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
