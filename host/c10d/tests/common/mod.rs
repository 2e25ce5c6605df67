//! What the c10d test binaries share: every rank a tokio task with its own
//! `World`, all ranks meeting in one `FileStore` file.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use wasmrpc_c10d::{InitOptions, World};
use wasmrpc_store::FileStore;

/// Every multi-rank test finishes well within this.
pub(crate) const TEST_LIMIT: Duration = Duration::from_secs(40);

/// Runs `body(rank, store_file)` for every rank concurrently and fails if
/// any rank fails or the whole run outlives [`TEST_LIMIT`].
pub(crate) async fn run_ranks<F, Fut>(world_size: usize, body: F)
where
    F: Fn(usize, PathBuf) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("store");
    let tasks: Vec<_> = (0..world_size)
        .map(|rank| tokio::spawn(body(rank, file.clone())))
        .collect();
    let all = async {
        for (rank, t) in tasks.into_iter().enumerate() {
            if let Err(e) = t.await {
                if e.is_panic() {
                    eprintln!("rank {rank} failed");
                    std::panic::resume_unwind(e.into_panic());
                }
                panic!("rank {rank}: {e}");
            }
        }
    };
    tokio::time::timeout(TEST_LIMIT, all)
        .await
        .expect("the ranks did not finish in time");
}

/// `init_process_group(backend, world_size=, rank=, store=FileStore(file,
/// world_size), timeout=)`.
pub(crate) async fn init(
    backend: Option<&str>,
    rank: usize,
    world_size: usize,
    file: &Path,
    timeout: Duration,
) -> World {
    let world = World::new();
    world
        .init_process_group(InitOptions {
            backend: backend.map(str::to_owned),
            store: Some(Arc::new(FileStore::new(file, Some(world_size)))),
            rank: Some(rank as i64),
            world_size: Some(world_size as i64),
            timeout: Some(timeout),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("rank {rank}: init_process_group: {e}"));
    world
}
