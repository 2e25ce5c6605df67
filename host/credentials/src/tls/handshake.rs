//! The TLS 1.3 handshake, driven through rustls's unbuffered API on a TCP
//! socket, then handed over to the record layer of `stream`.
//!
//! rustls verifies everything here (certificates, names, the transcript);
//! this module only moves bytes between the socket and rustls, keeps what
//! arrived after the handshake, and takes the traffic keys from rustls
//! once it says the connection may carry application data.

use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::CertificateDer;
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, InsufficientSizeError, UnbufferedStatus};
use rustls::{ExtractedSecrets, SideData};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::record::{APPLICATION_DATA, Direction, HEADER, MAX_BODY};

/// The lowest TLS record type (RFC 8446 §5.1); `APPLICATION_DATA` is the
/// highest.
const CHANGE_CIPHER_SPEC: u8 = 20;
use super::SocketReaderFn;
use super::stream::{Kernel, KeySchedule, TlsStream};

/// The most handshake bytes held at once: rustls's largest handshake
/// message (64 KiB) and one more record. The buffer starts at one record
/// and grows only as far as what the peer sends needs, so a peer that has
/// proved nothing yet costs one record's worth of memory.
const HANDSHAKE_BUFFER: usize = (64 << 10) + HEADER + MAX_BODY;

/// Either side of an unbuffered rustls connection.
pub(crate) trait Side: Sized {
    type Data: SideData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn peer_chain(&self) -> Vec<CertificateDer<'static>>;
    fn into_kernel(self) -> Result<(ExtractedSecrets, Kernel), rustls::Error>;
}

/// The two sides differ only in their types: rustls gives each its own
/// `process_tls_records` and `dangerous_into_kernel_connection`.
macro_rules! side {
    ($connection:ty, $data:ty, $kernel:ident) => {
        impl Side for $connection {
            type Data = $data;
            fn process<'c, 'i>(
                &'c mut self,
                incoming: &'i mut [u8],
            ) -> UnbufferedStatus<'c, 'i, Self::Data> {
                self.process_tls_records(incoming)
            }
            fn peer_chain(&self) -> Vec<CertificateDer<'static>> {
                let common: &rustls::CommonState = self;
                owned(common.peer_certificates())
            }
            fn into_kernel(self) -> Result<(ExtractedSecrets, Kernel), rustls::Error> {
                let (secrets, kernel) = self.dangerous_into_kernel_connection()?;
                Ok((secrets, Kernel::$kernel(kernel)))
            }
        }
    };
}

side!(
    UnbufferedClientConnection,
    rustls::client::ClientConnectionData,
    Client
);
side!(
    UnbufferedServerConnection,
    rustls::server::ServerConnectionData,
    Server
);

fn owned(chain: Option<&[CertificateDer<'_>]>) -> Vec<CertificateDer<'static>> {
    chain
        .unwrap_or_default()
        .iter()
        .map(|c| c.clone().into_owned())
        .collect()
}

/// What to do after one call into rustls.
enum Step {
    Continue,
    Transmit,
    Read,
    Established,
    Failed(String),
}

/// Encodes what rustls has to send into `out`.
fn encode<D>(
    state: &mut rustls::unbuffered::EncodeTlsData<'_, D>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let used = out.len();
    out.resize(used + HEADER + MAX_BODY, 0);
    let written = match state.encode(&mut out[used..]) {
        Ok(n) => n,
        Err(EncodeError::InsufficientSize(InsufficientSizeError { required_size })) => {
            out.resize(used + required_size, 0);
            state.encode(&mut out[used..]).map_err(|e| e.to_string())?
        }
        Err(e) => return Err(e.to_string()),
    };
    out.truncate(used + written);
    Ok(())
}

/// Runs the handshake of `conn` on `tcp` to its end: the established
/// stream, or why it failed (after sending rustls's alert, if it has one).
/// `records_per_key`: how many records the writer seals under one key;
/// `socket_reader`: what the established stream reads its socket through.
pub(crate) async fn establish<S: Side>(
    mut conn: S,
    mut tcp: TcpStream,
    records_per_key: u64,
    socket_reader: &SocketReaderFn,
) -> Result<TlsStream, String> {
    let mut incoming = vec![0u8; HEADER + MAX_BODY];
    let mut used = 0;
    let mut outgoing = Vec::new();
    // Application data rustls opened with the handshake's last records.
    let mut plaintext = Vec::new();
    // rustls sees one more record only when it asks for more: what follows
    // the handshake's last record must reach the record layer, not rustls
    // (which would answer a key update itself, and keep the answer).
    let mut records = 1;
    loop {
        let fed = records_end(&incoming[..used], records)?;
        let UnbufferedStatus { discard, state } = conn.process(&mut incoming[..fed.0]);
        let step = match state {
            Err(e) => Step::Failed(e.to_string()),
            Ok(ConnectionState::EncodeTlsData(mut s)) => match encode(&mut s, &mut outgoing) {
                Ok(()) => Step::Continue,
                Err(e) => Step::Failed(e),
            },
            Ok(ConnectionState::TransmitTlsData(s)) => {
                s.done();
                Step::Transmit
            }
            Ok(ConnectionState::BlockedHandshake) => Step::Read,
            Ok(ConnectionState::ReadTraffic(mut s)) => loop {
                match s.next_record() {
                    None => break Step::Continue,
                    Some(Ok(record)) => plaintext.extend_from_slice(record.payload),
                    Some(Err(e)) => break Step::Failed(e.to_string()),
                }
            },
            Ok(ConnectionState::WriteTraffic(_)) => Step::Established,
            Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => {
                Step::Failed("the peer closed the connection during the TLS handshake".into())
            }
            Ok(other) => Step::Failed(format!("unexpected TLS state {other:?}")),
        };
        incoming.copy_within(discard..used, 0);
        used -= discard;
        if discard > 0 {
            records = 1;
        }
        match step {
            Step::Continue => {}
            // A handshake message in several records: show rustls the next.
            Step::Read if discard == 0 && fed.1 == records && fed.0 < used => {
                records += 1;
            }
            Step::Read if discard > 0 && records_end(&incoming[..used], 1)?.1 == 1 => {}
            Step::Transmit => {
                tcp.write_all(&outgoing).await.map_err(|e| e.to_string())?;
                outgoing.clear();
            }
            Step::Read => {
                if used == incoming.len() {
                    if used == HANDSHAKE_BUFFER {
                        return Err("the peer's TLS handshake message is too large".into());
                    }
                    incoming.resize((2 * used).min(HANDSHAKE_BUFFER), 0);
                }
                match tcp.read(&mut incoming[used..]).await {
                    Ok(0) => {
                        return Err(
                            "the peer closed the connection during the TLS handshake".into()
                        );
                    }
                    Ok(n) => used += n,
                    Err(e) => return Err(e.to_string()),
                }
            }
            Step::Established => break,
            Step::Failed(e) => {
                send_alert(&mut conn, &mut tcp, &mut incoming[..used], outgoing).await;
                return Err(e);
            }
        }
    }
    let peer_certificates = conn.peer_chain();
    let (secrets, kernel) = conn.into_kernel().map_err(|e| e.to_string())?;
    let keys = KeySchedule::new(kernel, records_per_key);
    let rx = Direction::new(secrets.rx, keys.limit(false))?;
    let tx = Direction::new(secrets.tx, keys.limit(true))?;
    let (read, write) = tcp.into_split();
    Ok(TlsStream::new(
        (socket_reader(read), write),
        rx,
        tx,
        keys,
        (&incoming[..used], plaintext),
        peer_certificates,
    ))
}

/// The end of the first `count` whole records in `buf`, and how many
/// whole records that is (fewer when `buf` holds fewer). Fails on a header
/// no TLS peer sends: an unknown record type, a version not 3.x, or a
/// length over the limit.
fn records_end(buf: &[u8], count: usize) -> Result<(usize, usize), String> {
    let (mut end, mut whole) = (0, 0);
    while whole < count {
        let Some(header) = buf.get(end..end + HEADER) else {
            break;
        };
        // A peer that is not speaking TLS is refused on its first five
        // bytes, not after it has sent as many as their length claims.
        if !(CHANGE_CIPHER_SPEC..=APPLICATION_DATA).contains(&header[0]) || header[1] != 3 {
            return Err(format!(
                "received bytes that are not a TLS record (they begin {:?})",
                String::from_utf8_lossy(&header[..HEADER])
            ));
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len > MAX_BODY {
            return Err(format!("received a TLS record of invalid length {len}"));
        }
        if end + HEADER + len > buf.len() {
            break;
        }
        end += HEADER + len;
        whole += 1;
    }
    Ok((end, whole))
}

/// Sends what rustls queued after a failure (its alert), best effort: the
/// peer learns why, as `CertificateRequired` or `UnknownCA`. `incoming`:
/// what rustls was shown last, less what it discarded (its deframer may
/// still point into it).
async fn send_alert<S: Side>(
    conn: &mut S,
    tcp: &mut TcpStream,
    incoming: &mut [u8],
    mut outgoing: Vec<u8>,
) {
    for _ in 0..4 {
        let UnbufferedStatus { state, .. } = conn.process(incoming);
        match state {
            Ok(ConnectionState::EncodeTlsData(mut s)) => {
                if encode(&mut s, &mut outgoing).is_err() {
                    break;
                }
            }
            Ok(ConnectionState::TransmitTlsData(s)) => s.done(),
            _ => break,
        }
    }
    if !outgoing.is_empty() {
        let _ = tcp.write_all(&outgoing).await;
    }
}
