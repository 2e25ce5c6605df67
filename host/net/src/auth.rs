//! The cluster-secret mutual authentication: [`dial`] and [`accept`].

use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::de::DeserializeOwned;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use crate::binding::{Binding, Identity};
use crate::error::{Refusal, RefusalKind};
use crate::message::{HANDSHAKE_TIMEOUT, MAX_HANDSHAKE, io, read_body, write_all};
use crate::random::random_bytes;
use crate::wire::{Admitted, Hello, Proof, VERSION, Welcome, decode, encode};

/// One side's part in a handshake: what it is bound to, its secret (`None`:
/// unauthenticated), who it claims to be, and how long the whole exchange
/// may take.
#[derive(Debug, Clone, Copy)]
pub struct Handshake<'a> {
    /// The protocol and context the proofs are bound to.
    pub binding: &'a Binding,
    /// The cluster secret, if this side holds one.
    pub secret: Option<&'a [u8]>,
    /// Who this side claims to be.
    pub identity: &'a Identity,
    /// How long the whole exchange may take.
    pub timeout: Duration,
}

impl<'a> Handshake<'a> {
    /// A handshake under [`HANDSHAKE_TIMEOUT`].
    pub fn new(binding: &'a Binding, secret: Option<&'a [u8]>, identity: &'a Identity) -> Self {
        Self {
            binding,
            secret,
            identity,
            timeout: HANDSHAKE_TIMEOUT,
        }
    }

    /// The same handshake under `timeout`.
    #[must_use]
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }
}

/// What the dialer learns from an accepted handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dialed {
    /// Who the acceptor claims to be (proven, with a secret).
    pub peer: Identity,
    /// The acceptor's extension (empty if it sent none).
    pub extension: Vec<u8>,
}

/// Which MAC: the label differs per direction (and per protocol).
#[derive(Clone, Copy)]
pub(crate) enum Role {
    /// The acceptor's MAC in its welcome.
    Acceptor,
    /// The dialer's proof.
    Dialer,
    /// The acceptor's MAC over its extension.
    Admitted,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Acceptor => "acceptor",
            Role::Dialer => "dialer",
            Role::Admitted => "admitted",
        }
    }
}

/// What every MAC of one connection covers.
pub(crate) struct Transcript<'a> {
    pub(crate) binding: &'a Binding,
    pub(crate) dialer: &'a Identity,
    pub(crate) acceptor: &'a Identity,
    pub(crate) nonce_d: &'a [u8; 32],
    pub(crate) nonce_a: &'a [u8; 32],
}

fn field(m: &mut Hmac<Sha256>, bytes: &[u8]) {
    m.update(&(bytes.len() as u64).to_le_bytes());
    m.update(bytes);
}

fn identity(m: &mut Hmac<Sha256>, id: &Identity) {
    field(m, id.name.as_bytes());
    match id.rank {
        Some(rank) => {
            m.update(&[1]);
            m.update(&rank.to_le_bytes());
        }
        None => m.update(&[0]),
    }
}

fn keyed(secret: &[u8], role: Role, t: &Transcript<'_>, extension: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: new_from_slice cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC rejected a key"));
    let protocol = t.binding.protocol().name();
    field(
        &mut m,
        format!("wasmrpc-{protocol}-{}", role.name()).as_bytes(),
    );
    m.update(&VERSION.to_le_bytes());
    field(&mut m, protocol.as_bytes());
    field(&mut m, t.binding.context().as_bytes());
    m.update(t.nonce_d);
    m.update(t.nonce_a);
    identity(&mut m, t.dialer);
    identity(&mut m, t.acceptor);
    field(&mut m, extension);
    m
}

pub(crate) fn mac(
    secret: Option<&[u8]>,
    role: Role,
    t: &Transcript<'_>,
    extension: &[u8],
) -> [u8; 32] {
    secret.map_or([0; 32], |s| {
        keyed(s, role, t, extension).finalize().into_bytes().into()
    })
}

/// Constant-time (NET-2).
fn checks(secret: &[u8], role: Role, t: &Transcript<'_>, extension: &[u8], got: &[u8; 32]) -> bool {
    keyed(secret, role, t, extension).verify_slice(got).is_ok()
}

fn secret_mismatch(ours: bool) -> Refusal {
    let message = if ours {
        "the peer has no cluster secret but this rank has one (every member needs the same \
         cluster secret: WASMRPC_CLUSTER_SECRET or --cluster-secret-file)"
    } else {
        "the peer has a cluster secret but this rank has none (every member needs the same \
         cluster secret: WASMRPC_CLUSTER_SECRET or --cluster-secret-file)"
    };
    Refusal::new(RefusalKind::SecretMismatch, message)
}

fn check_version(version: u32, binding: &Binding) -> Result<(), Refusal> {
    if version == VERSION {
        return Ok(());
    }
    Err(Refusal::new(
        RefusalKind::Version,
        format!(
            "the peer speaks version {version} of the wasmrpc {} handshake, this side {VERSION}",
            binding.protocol().name()
        ),
    ))
}

async fn read_magic<S: AsyncRead + Unpin>(
    stream: &mut S,
    binding: &Binding,
) -> Result<(), Refusal> {
    let mut magic = [0u8; 4];
    stream
        .read_exact(&mut magic)
        .await
        .map_err(|e| io("handshake", &e))?;
    if magic != binding.protocol().magic() {
        return Err(Refusal::new(
            RefusalKind::NotAPeer,
            format!(
                "handshake: not a wasmrpc {} peer (its first bytes are {magic:02x?})",
                binding.protocol().name()
            ),
        ));
    }
    Ok(())
}

async fn recv<S: AsyncRead + Unpin, T: DeserializeOwned>(
    stream: &mut S,
    what: &str,
) -> Result<T, Refusal> {
    let body = read_body(stream, MAX_HANDSHAKE, what).await?;
    decode(&body, what)
}

async fn timed<T>(
    hs: &Handshake<'_>,
    exchange: impl Future<Output = Result<T, Refusal>>,
) -> Result<T, Refusal> {
    tokio::time::timeout(hs.timeout, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(Refusal::new(
                RefusalKind::TimedOut,
                format!(
                    "no complete {} handshake within {:?}",
                    hs.binding.protocol().name(),
                    hs.timeout
                ),
            ))
        })
}

/// The dialer's side: returns the acceptor, proven (with a secret), and its
/// extension. The caller checks that the acceptor is the one it dialed.
///
/// # Errors
/// A [`Refusal`]: I/O or the timeout, a peer of another protocol or
/// version, a malformed or oversized message, a secret on one side only,
/// or a MAC that does not check.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    hs: &Handshake<'_>,
) -> Result<Dialed, Refusal> {
    timed(hs, dial_untimed(stream, hs)).await
}

async fn dial_untimed<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    hs: &Handshake<'_>,
) -> Result<Dialed, Refusal> {
    let binding = hs.binding;
    let nonce_d = random_bytes::<32>();
    let mut hello = binding.protocol().magic().to_vec();
    hello.extend(encode(
        &Hello {
            version: VERSION,
            has_secret: hs.secret.is_some(),
            identity: hs.identity.clone(),
            nonce: nonce_d,
        },
        "hello",
    )?);
    write_all(stream, &hello, "hello").await?;

    read_magic(stream, binding).await?;
    let welcome: Welcome = recv(stream, "welcome").await?;
    check_version(welcome.version, binding)?;
    if welcome.has_secret != hs.secret.is_some() {
        return Err(secret_mismatch(hs.secret.is_some()));
    }
    let t = Transcript {
        binding,
        dialer: hs.identity,
        acceptor: &welcome.identity,
        nonce_d: &nonce_d,
        nonce_a: &welcome.nonce,
    };
    if let Some(s) = hs.secret
        && !checks(s, Role::Acceptor, &t, &[], &welcome.mac)
    {
        return Err(Refusal::new(
            RefusalKind::BadProof,
            format!(
                "{} did not prove that it holds the cluster secret",
                welcome.identity
            ),
        ));
    }
    let proof = Proof {
        mac: mac(hs.secret, Role::Dialer, &t, &[]),
    };
    write_all(stream, &encode(&proof, "proof")?, "proof").await?;

    let admitted: Admitted = recv(stream, "admission").await.map_err(|e| {
        Refusal::new(
            e.kind(),
            format!("{} did not admit this side: {e}", welcome.identity),
        )
    })?;
    if let Some(s) = hs.secret
        && !checks(s, Role::Admitted, &t, &admitted.extension, &admitted.mac)
    {
        return Err(Refusal::new(
            RefusalKind::BadProof,
            format!(
                "the admission from {} did not prove that it holds the cluster secret",
                welcome.identity
            ),
        ));
    }
    Ok(Dialed {
        peer: welcome.identity,
        extension: admitted.extension,
    })
}

/// The acceptor's side: returns the dialer, proven (with a secret), to
/// whom it sent `extension` after the proof (never before, NET-5). The
/// caller checks that the dialer may connect as who it claims.
///
/// # Errors
/// A [`Refusal`], as [`dial`]; `extension` over the message limit is
/// refused too.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    hs: &Handshake<'_>,
    extension: &[u8],
) -> Result<Identity, Refusal> {
    timed(hs, accept_untimed(stream, hs, extension)).await
}

async fn accept_untimed<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    hs: &Handshake<'_>,
    extension: &[u8],
) -> Result<Identity, Refusal> {
    let binding = hs.binding;
    read_magic(stream, binding).await?;
    let hello: Hello = recv(stream, "hello").await?;
    check_version(hello.version, binding)?;
    let nonce_a = random_bytes::<32>();
    let t = Transcript {
        binding,
        dialer: &hello.identity,
        acceptor: hs.identity,
        nonce_d: &hello.nonce,
        nonce_a: &nonce_a,
    };
    let mut welcome = binding.protocol().magic().to_vec();
    welcome.extend(encode(
        &Welcome {
            version: VERSION,
            has_secret: hs.secret.is_some(),
            identity: hs.identity.clone(),
            nonce: nonce_a,
            mac: mac(hs.secret, Role::Acceptor, &t, &[]),
        },
        "welcome",
    )?);
    write_all(stream, &welcome, "welcome").await?;
    // After the welcome, so the dialer learns the mismatch too (NET-3).
    if hello.has_secret != hs.secret.is_some() {
        return Err(secret_mismatch(hs.secret.is_some()));
    }
    let proof: Proof = recv(stream, "proof").await.map_err(|e| {
        Refusal::new(
            e.kind(),
            format!("a connection announcing {}: {e}", hello.identity),
        )
    })?;
    if let Some(s) = hs.secret
        && !checks(s, Role::Dialer, &t, &[], &proof.mac)
    {
        return Err(Refusal::new(
            RefusalKind::BadProof,
            format!(
                "a connection announcing {} did not prove that it holds the cluster secret",
                hello.identity
            ),
        ));
    }
    let admitted = Admitted {
        extension: extension.to_vec(),
        mac: mac(hs.secret, Role::Admitted, &t, extension),
    };
    write_all(stream, &encode(&admitted, "admission")?, "admission").await?;
    Ok(hello.identity)
}
