//! Helpers shared by the integration tests: a timeout around every async
//! test, finding PyTorch's Python, injected environments, free ports, and
//! the behaviour checks every store must pass.

#![allow(dead_code, reason = "each test crate uses a different subset")]

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmrpc_store::{Error, Store};

/// Runs `fut` and fails the test if it takes longer than `limit`.
pub(crate) async fn timed<T>(limit: Duration, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("test timed out after {limit:?}"),
    }
}

/// `$WASMRPC_ENV/venv/bin/<tool>` if it exists; otherwise prints the skip
/// line and returns `None`.
pub(crate) fn torch_tool(tool: &str) -> Option<PathBuf> {
    let env = std::env::var_os("WASMRPC_ENV").map(PathBuf::from);
    let path = env
        .clone()
        .unwrap_or_else(|| PathBuf::from(".wasmrpc-env"))
        .join("venv/bin")
        .join(tool);
    if path.exists() {
        Some(path)
    } else {
        println!("wasmrpc-skip: torch python not found at {}", path.display());
        None
    }
}

/// The venv's Python, if torch is installed there.
pub(crate) fn torch_python() -> Option<PathBuf> {
    torch_tool("python")
}

/// A script kept next to the tests.
pub(crate) fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(name)
}

/// An injected environment (tests never touch the process environment, so
/// they cannot race each other).
pub(crate) fn env_of<V: AsRef<str>>(
    vars: &[(&str, V)],
) -> impl Fn(&str) -> Option<String> + Sync + use<V> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.as_ref().to_owned()))
        .collect();
    move |name: &str| map.get(name).cloned()
}

/// A port that was free a moment ago, for a master that must bind the port
/// other ranks are told.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Every operation, with PyTorch's semantics.
pub(crate) async fn conformance(store: Arc<dyn Store>) {
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
