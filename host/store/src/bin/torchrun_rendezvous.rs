//! A worker to run under `torchrun --no-python`: it rendezvouses through
//! `env://` on the store torchrun's agent hosts (as a client only, since
//! torchrun sets `TORCHELASTIC_USE_AGENT_STORE=True`), exchanges a value with
//! every other rank, meets them at a store-based barrier, and exits 0.
//!
//! It prints `rank {rank}/{world_size}: got {values}` on success; on failure
//! it prints the error to stderr and exits 1.

use std::process::ExitCode;
use std::time::Duration;

use wasmrpc_store::{Error, rendezvous, store_based_barrier};

const TIMEOUT: Duration = Duration::from_secs(60);

async fn run() -> Result<String, Error> {
    if std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref() != Ok("True") {
        return Err(Error::Runtime(
            "TORCHELASTIC_USE_AGENT_STORE=True expected: run me under torchrun".into(),
        ));
    }
    let (store, rank, world_size) = rendezvous("env://", -1, -1, TIMEOUT).await?;
    store
        .set(
            &format!("wasmrpc_test/rank{rank}"),
            format!("hello from {rank}").as_bytes(),
        )
        .await?;
    let mut values = Vec::new();
    for other in 0..world_size {
        let value = store.get(&format!("wasmrpc_test/rank{other}")).await?;
        let text = String::from_utf8_lossy(&value).into_owned();
        if text != format!("hello from {other}") {
            return Err(Error::Runtime(format!(
                "rank {rank} read {text:?} for rank {other}"
            )));
        }
        values.push(text);
    }
    // Nobody leaves before everyone has read everything.
    store_based_barrier(
        store.as_ref(),
        rank,
        "wasmrpc_torchrun",
        world_size,
        TIMEOUT,
        Duration::from_secs(1),
    )
    .await?;
    Ok(format!("rank {rank}/{world_size}: got {values:?}"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run().await {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("torchrun_rendezvous: {e}");
            ExitCode::FAILURE
        }
    }
}
