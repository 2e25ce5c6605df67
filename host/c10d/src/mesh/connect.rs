//! How a mesh's connections are made and authenticated: accepting and
//! dialing one peer, each with the group handshake (the cluster secret),
//! over plain TCP or TLS.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use wasmrpc_credentials::{TlsEndpoints, TlsStream};
use wasmrpc_store::Store;

/// How a mesh's connections are authenticated.
pub(crate) struct MeshAuth {
    /// The cluster secret each connection's handshake proves.
    pub(crate) secret: Option<Arc<[u8]>>,
    /// TLS for every connection.
    pub(crate) tls: Option<MeshTls>,
}

/// A mesh's TLS: the endpoints of this member's credentials and the worker
/// its certificate names.
pub(crate) struct MeshTls {
    pub(crate) endpoints: TlsEndpoints,
    pub(crate) name: String,
}

/// The store key under which rank `rank` publishes the worker name its
/// certificate names.
pub(super) fn name_key(rank: usize) -> String {
    format!("name/{rank}")
}

/// One authenticated connection, before it is split.
pub(super) enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream>),
}

pub(super) type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
pub(super) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

impl Conn {
    pub(super) fn split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Conn::Plain(stream) => {
                let (read, write) = stream.into_split();
                (Box::new(read), Box::new(write))
            }
            Conn::Tls(stream) => {
                let (read, write) = stream.into_split();
                (Box::new(read), Box::new(write))
            }
        }
    }
}

/// The acceptor's side of one connection: TLS (with the certificate
/// checked against the name published for the announced rank), then the
/// handshake. Returns the dialer's rank.
pub(super) async fn accept_one(
    mut stream: TcpStream,
    auth: &MeshAuth,
    store: &dyn Store,
    group: &str,
    rank: usize,
    size: usize,
) -> std::result::Result<(usize, Conn), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let in_range = |peer: usize| {
        if peer <= rank || peer >= size {
            Err(format!(
                "a connection announced rank {peer}, which does not dial rank {rank} in a group of \
                 size {size}"
            ))
        } else {
            Ok(peer)
        }
    };
    let secret = auth.secret.as_deref();
    let Some(tls) = &auth.tls else {
        let peer = crate::handshake::accept(&mut stream, secret, group, rank).await?;
        return Ok((in_range(peer)?, Conn::Plain(stream)));
    };
    let mut stream = tls
        .endpoints
        .accept(stream)
        .await
        .map_err(|e| e.to_string())?;
    let peer = in_range(crate::handshake::accept(&mut stream, secret, group, rank).await?)?;
    let key = name_key(peer);
    store
        .wait(&[key.as_str()], crate::handshake::HANDSHAKE_TIMEOUT)
        .await
        .map_err(|e| format!("rank {peer} published no worker name: {e}"))?;
    let name = store.get(&key).await.map_err(|e| e.to_string())?;
    let name = String::from_utf8_lossy(&name);
    wasmrpc_credentials::check_peer_names(&stream, &name)
        .map_err(|e| format!("rank {peer} is worker {name}: {e}"))?;
    Ok((peer, Conn::Tls(Box::new(stream))))
}

/// The dialer's side of one connection to rank `peer` at `addr`.
pub(super) async fn dial_one(
    addr: &str,
    auth: &MeshAuth,
    store: &dyn Store,
    group: &str,
    rank: usize,
    peer: usize,
) -> std::result::Result<Conn, String> {
    let mut stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let secret = auth.secret.as_deref();
    let Some(tls) = &auth.tls else {
        crate::handshake::dial(&mut stream, secret, group, rank, peer).await?;
        return Ok(Conn::Plain(stream));
    };
    // Published before the address, so it is there.
    let name = store
        .get(&name_key(peer))
        .await
        .map_err(|e| e.to_string())?;
    let name = String::from_utf8_lossy(&name);
    let mut stream = tls
        .endpoints
        .connect(stream, &name)
        .await
        .map_err(|e| e.to_string())?;
    crate::handshake::dial(&mut stream, secret, group, rank, peer).await?;
    Ok(Conn::Tls(Box::new(stream)))
}
