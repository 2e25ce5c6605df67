//! Transport security (issue 20): what the store holds after a rendezvous
//! (nothing secret), and the attacks a worker's port must refuse while the
//! cluster serves on.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use wasmrpc::store::HashStore;
use wasmrpc::{RpcAgent, RpcBackendOptions, args, init_rpc};
use wasmrpc_tests::{cluster, expect_tensor, ones, register_all, timed};

/// Fails if any key or value of `store` holds `secret`, raw or in hex, or a
/// PEM private key, or if a key names a secret.
fn assert_no_secret(store: &HashStore, secret: &[u8]) -> anyhow::Result<()> {
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let needles: [&[u8]; 3] = [secret, hex.as_bytes(), b"PRIVATE KEY"];
    let entries = store.entries();
    ensure!(!entries.is_empty(), "the rendezvous wrote nothing");
    for (key, value) in &entries {
        ensure!(
            !key.contains("secret") && !key.contains("key"),
            "the store has a key named {key}"
        );
        for needle in needles {
            let found = value.windows(needle.len()).any(|w| w == needle)
                || key.as_bytes().windows(needle.len()).any(|w| w == needle);
            ensure!(!found, "store key {key} holds key material");
        }
    }
    Ok(())
}

/// A call from `from` to `to` that must succeed.
async fn still_serves(from: &RpcAgent, to: &str) -> anyhow::Result<()> {
    let r = from.rpc_sync(to, "aten::add", args![ones(&[2]), 1]).await?;
    expect_tensor(&r, &(ones(&[2]) + 1))?;
    Ok(())
}

#[test]
fn test_static_rendezvous_writes_no_secret_to_the_store() {
    timed(async {
        let store = Arc::new(HashStore::new());
        let builder = cluster(3).store(store.clone());
        let secret = builder.secret().to_vec();
        let c = builder.start().await?;
        still_serves(c.agent(0), "worker2").await?;
        assert_no_secret(&store, &secret)?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_dynamic_rendezvous_and_deployment_write_no_secret_to_the_store() {
    timed(async {
        let store = Arc::new(HashStore::new());
        let secret = wasmrpc::transport::generate_secret().into_bytes();
        let join = |rank: u32| {
            let (store, secret) = (store.clone(), secret.clone());
            async move {
                let registry = wasmrpc::FunctionRegistry::new();
                register_all(&registry);
                let o = RpcBackendOptions {
                    registry: Arc::new(registry),
                    accept_plugin_deployment: true,
                    cluster_secret: Some(secret),
                    ..RpcBackendOptions::default()
                };
                let name = format!("worker{rank}");
                init_rpc(&name, Some(rank), None, store, o).await
            }
        };
        let w0 = join(0).await?;
        let w1 = join(1).await?;
        let wasm = std::fs::read(wasmrpc_plugins::HELLO).context("the hello plugin")?;
        w0.deploy_plugin(&wasm).await?.check()?;
        // A late joiner installs the deployment through the store.
        let w2 = join(2).await?;
        let names = w2.install_deployed_plugins().await?;
        ensure!(names.contains(&"hello::greet".to_string()), "{names:?}");
        still_serves(&w2, "worker0").await?;
        assert_no_secret(&store, &secret)?;
        ensure!(
            store
                .entries()
                .iter()
                .any(|(k, _)| k.starts_with("rpc/plugins/")),
            "the deployment was not published"
        );
        for w in [w2, w1, w0] {
            w.shutdown(true, Duration::ZERO).await?;
        }
        Ok(())
    });
}

#[test]
fn test_worker_without_credentials_on_a_non_loopback_address_refuses_to_start() {
    timed(async {
        let store = wasmrpc::testing::fresh_store();
        let options = RpcBackendOptions {
            listen_addr: "0.0.0.0:0".parse()?,
            ..RpcBackendOptions::default()
        };
        let e = init_rpc("worker0", Some(0), Some(1), store.clone(), options.clone())
            .await
            .err()
            .context("a worker without credentials listened on 0.0.0.0")?;
        ensure!(
            e.message().contains("not a loopback address")
                && e.message().contains("--cluster-secret-file")
                && e.message().contains("--insecure"),
            "{e}"
        );
        // Refused before the rendezvous: the store is untouched.
        ensure!(
            !store.check(&["rpc/mode"]).await?,
            "the refused worker wrote to the store"
        );
        let insecure = RpcBackendOptions {
            insecure: true,
            ..options
        };
        let a = init_rpc("worker0", Some(0), Some(1), store, insecure).await?;
        a.shutdown(true, Duration::ZERO).await?;
        Ok(())
    });
}
