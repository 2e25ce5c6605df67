//! Deployments in the group's store, for late joiners: publishing each
//! committed version and switch (signed with the cluster secret), and a
//! joiner installing them (see the parent module's docs).

use sha2::{Digest, Sha256};

use super::worker::handle_request;
use super::{DEPLOYED_PLUGINS, DeployPlugin, Deployed, decode_reply, hex, unhex};
use crate::abi::Value;
use crate::agent::RpcAgent;
use crate::error::{Error, Result};
use crate::plugin::plugin_namespace;
use crate::plugin::versions::{self};

/// [`Deploy::install_deployed_plugins`](super::Deploy::install_deployed_plugins).
///
/// # Errors
/// As [`Deploy::install_deployed_plugins`](super::Deploy::install_deployed_plugins).
pub(crate) async fn install_deployed_plugins(agent: &RpcAgent) -> Result<Vec<String>> {
    let store = agent.store();
    let secret = agent.cluster_secret()?;
    let key = |k: &str| format!("{PUBLISHED}/{k}");
    let count = store
        .add(&key("count"), 0)
        .await
        .map_err(|e| Error::runtime(format!("reading the deployed plugins: {e}")))?;
    if count == 0 {
        return Ok(Vec::new());
    }
    // Without a cluster secret (TLS only), the store's entries prove
    // nothing: a member, over an authenticated connection, says which
    // sha256s were deployed.
    let attested = if secret.is_empty() {
        Some(attested_deployments(agent).await?)
    } else {
        None
    };
    let mut names = Vec::new();
    let mut namespaces: Vec<String> = Vec::new();
    for i in 0..count {
        let read = async |k: String| {
            store
                .get(&k)
                .await
                .map_err(|e| Error::runtime(format!("reading deployed plugin {i} ({k}): {e}")))
        };
        let entry = String::from_utf8_lossy(&read(key(&i.to_string())).await?).into_owned();
        let (sha_hex, mac_hex) = entry.split_once(' ').unwrap_or((&entry, ""));
        let wasm = read(key(&format!("sha256/{sha_hex}"))).await?;
        let sha256: [u8; 32] = Sha256::digest(&wasm).into();
        let vouched = match &attested {
            Some((_, hashes)) => hashes.iter().any(|h| h == sha_hex),
            None => hex(&sign(&secret, &sha256)) == mac_hex,
        };
        if let Some((member, _)) = &attested
            && (hex(&sha256) != sha_hex || !vouched)
        {
            return Err(Error::runtime(format!(
                "worker {} did not install deployed plugin {i} (sha256 {sha_hex}): worker \
                 {member} does not serve it as a deployed plugin",
                agent.name()
            )));
        }
        if hex(&sha256) != sha_hex || !vouched {
            return Err(Error::runtime(format!(
                "worker {} did not install deployed plugin {i} (sha256 {sha_hex}): the \
                 store's entry is not signed with the cluster secret",
                agent.name()
            )));
        }
        let name = wasmrpc_wasm::manifest::read(&wasm)
            .map(|m| m.name)
            .unwrap_or_else(|_| format!("sha256 {sha_hex}"));
        let namespace = plugin_namespace(&name);
        if !namespaces.contains(&namespace) {
            namespaces.push(namespace);
        }
        let message = DeployPlugin {
            name,
            sha256,
            wasm,
            stage: false,
        };
        let reply = handle_request(agent, "the group's store", message).await?;
        let (already, registered) = decode_reply(&reply.value)?;
        if !already {
            for n in registered {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
    }
    // The version each plugin was last switched to (by a deployment or a
    // rollback), when it is not the last one published.
    for namespace in namespaces {
        let pointer = key(&format!("current/{namespace}"));
        let err = |e: crate::store::Error| Error::runtime(format!("store: {e}"));
        if !store.check(&[&pointer]).await.map_err(err)? {
            continue;
        }
        let entry = String::from_utf8_lossy(&store.get(&pointer).await.map_err(err)?).into_owned();
        let (sha_hex, mac_hex) = entry.split_once(' ').unwrap_or((&entry, ""));
        let Some(sha256) = unhex(sha_hex) else {
            continue;
        };
        let vouched = match &attested {
            Some((_, hashes)) => hashes.iter().any(|h| h == sha_hex),
            None => hex(&sign_current(&secret, &namespace, &sha256)) == mac_hex,
        };
        if !vouched {
            return Err(Error::runtime(format!(
                "worker {} did not switch plugin {namespace} to version {sha_hex}: the store's \
                 entry is not signed with the cluster secret",
                agent.name()
            )));
        }
        let deployed = agent.state::<Deployed>();
        let _serial = deployed.by_sha256.lock().await;
        versions::commit(agent, &namespace, &sha256).map_err(|e| {
            e.context_line(format!(
                "worker {} switching plugin {namespace} to the group's current version",
                agent.name()
            ))
        })?;
    }
    Ok(names)
}

/// Which plugins were deployed to the group, as a live member other
/// than this worker says over its authenticated connection: the
/// member's name and the sha256s (hex) it serves as deployments.
async fn attested_deployments(agent: &RpcAgent) -> Result<(String, Vec<String>)> {
    let member = agent
        .get_worker_infos()
        .into_iter()
        .find(|w| w.name != agent.name())
        .ok_or_else(|| {
            Error::runtime(format!(
                "worker {} cannot check the group's deployed plugins: no other member to \
                 ask (without a cluster secret the store's entries are not signed)",
                agent.name()
            ))
        })?;
    let reply = agent
        .rpc_sync(member.name.as_str(), DEPLOYED_PLUGINS, crate::Args::new())
        .await?;
    let bad = || {
        Error::runtime(format!(
            "unexpected reply from worker {} listing deployed plugins",
            member.name
        ))
    };
    let Value::List(items) = &reply.value else {
        return Err(bad());
    };
    let hashes = items
        .iter()
        .map(|v| match v {
            Value::Str(s) => Ok(s.clone()),
            _ => Err(bad()),
        })
        .collect::<Result<_>>()?;
    Ok((member.name, hashes))
}

/// The store prefix deployments are published under for late joiners.
const PUBLISHED: &str = "rpc/plugins";

/// Publishes a deployment in the group's store: the bytes first (when
/// given and not there yet), then the next index, so a reader that sees
/// the index finds the bytes; then the namespace's current version.
pub(super) async fn publish(
    agent: &RpcAgent,
    namespace: &str,
    sha256: &[u8; 32],
    wasm: Option<&[u8]>,
) -> Result<()> {
    let store = agent.store();
    let sha_hex = hex(sha256);
    let bytes_key = format!("{PUBLISHED}/sha256/{sha_hex}");
    let err = |e: crate::store::Error| Error::runtime(format!("store: {e}"));
    let secret = agent.cluster_secret()?;
    // Without a secret there is nothing to sign with: joiners ask a member
    // instead (`attested_deployments`).
    let signed = |mac: [u8; 32]| {
        if secret.is_empty() {
            "unsigned".to_string()
        } else {
            hex(&mac)
        }
    };
    if let Some(wasm) = wasm
        && !store.check(&[&bytes_key]).await.map_err(err)?
    {
        store.set(&bytes_key, wasm).await.map_err(err)?;
        let i = store
            .add(&format!("{PUBLISHED}/count"), 1)
            .await
            .map_err(err)?
            - 1;
        store
            .set(
                &format!("{PUBLISHED}/{i}"),
                format!("{sha_hex} {}", signed(sign(&secret, sha256))).as_bytes(),
            )
            .await
            .map_err(err)?;
    }
    store
        .set(
            &format!("{PUBLISHED}/current/{namespace}"),
            format!(
                "{sha_hex} {}",
                signed(sign_current(&secret, namespace, sha256))
            )
            .as_bytes(),
        )
        .await
        .map_err(err)
}

/// HMAC-SHA256 of a published plugin's sha256 under the cluster secret.
fn sign(secret: &[u8], sha256: &[u8; 32]) -> [u8; 32] {
    mac(secret, &[b"wasmrpc published plugin v1\0", sha256])
}

/// HMAC-SHA256 of a namespace's current version under the cluster secret.
fn sign_current(secret: &[u8], namespace: &str, sha256: &[u8; 32]) -> [u8; 32] {
    mac(
        secret,
        &[
            b"wasmrpc current plugin v1\0",
            namespace.as_bytes(),
            b"\0",
            sha256,
        ],
    )
}

fn mac(secret: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
        Ok(mut m) => {
            for p in parts {
                m.update(p);
            }
            m.finalize().into_bytes().into()
        }
        // HMAC takes keys of any length; were it to refuse one, no entry
        // would verify, which fails closed.
        Err(_) => [0; 32],
    }
}
