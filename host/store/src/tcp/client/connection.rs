//! One connection to the store's server: the requests of the protocol,
//! each sent and its answer read on this connection.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::super::protocol::{Frame, QueryType, STOP_WAITING, VALIDATION_MAGIC, WAIT_CANCELED};
use super::user_key;
use crate::store::{Error, Result};

/// One validated connection to a store server.
#[derive(Debug)]
pub(super) struct Connection {
    stream: BufReader<TcpStream>,
    pub(super) addr: String,
}

impl Connection {
    /// Connects and validates once (CLI-1).
    pub(super) async fn open(host: &str, port: u16) -> Result<Self> {
        let addr = format!("{host}:{port}");
        let stream = TcpStream::connect((host, port))
            .await
            .map_err(|e| Error::io(format!("connect to store at {addr}"), e))?;
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%addr, error = %e, "cannot set TCP_NODELAY");
        }
        let mut conn = Self {
            stream: BufReader::new(stream),
            addr,
        };
        let mut frame = Frame::request(QueryType::Validate);
        frame.u32(VALIDATION_MAGIC);
        conn.send(&frame).await?;
        conn.ping().await?;
        Ok(conn)
    }

    /// Connects, retrying with exponential backoff until `deadline` (CLI-1).
    pub(super) async fn open_with_retry(
        host: &str,
        port: u16,
        deadline: Option<Instant>,
    ) -> Result<Self> {
        let mut delay = Duration::from_millis(20);
        loop {
            let attempt = match deadline {
                Some(d) => tokio::time::timeout_at(d, Self::open(host, port))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::io(
                            format!("connect to store at {host}:{port}"),
                            std::io::ErrorKind::TimedOut.into(),
                        ))
                    }),
                None => Self::open(host, port).await,
            };
            match attempt {
                Ok(conn) => return Ok(conn),
                Err(e) => {
                    let now = Instant::now();
                    if deadline.is_some_and(|d| now + delay >= d) {
                        return Err(e);
                    }
                    tracing::debug!(%host, port, error = %e, ?delay, "store connect failed, retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    pub(super) fn io(&self, what: &str, e: std::io::Error) -> Error {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::ConnectionClosed {
                addr: self.addr.clone(),
            }
        } else {
            Error::io(format!("{what} store at {}", self.addr), e)
        }
    }

    pub(super) async fn send(&mut self, frame: &Frame) -> Result<()> {
        let result = self.stream.get_mut().write_all(&frame.0).await;
        result.map_err(|e| self.io("write to", e))
    }

    pub(super) async fn read_u8(&mut self) -> Result<u8> {
        let result = self.stream.read_u8().await;
        result.map_err(|e| self.io("read from", e))
    }

    pub(super) async fn read_u32(&mut self) -> Result<u32> {
        let result = self.stream.read_u32_le().await;
        result.map_err(|e| self.io("read from", e))
    }

    pub(super) async fn read_i64(&mut self) -> Result<i64> {
        let result = self.stream.read_i64_le().await;
        result.map_err(|e| self.io("read from", e))
    }

    pub(super) async fn read_bytes(&mut self) -> Result<Vec<u8>> {
        let len = self.stream.read_u64_le().await;
        let len = len.map_err(|e| self.io("read from", e))?;
        // Grow as bytes arrive instead of trusting the length.
        let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0).min(1 << 16));
        let read = (&mut self.stream).take(len).read_to_end(&mut out).await;
        read.map_err(|e| self.io("read from", e))?;
        if out.len() as u64 != len {
            return Err(Error::ConnectionClosed {
                addr: self.addr.clone(),
            });
        }
        Ok(out)
    }

    pub(super) async fn ping(&mut self) -> Result<()> {
        let nonce = std::process::id();
        let mut frame = Frame::request(QueryType::Ping);
        frame.u32(nonce);
        self.send(&frame).await?;
        let echoed = self.read_u32().await?;
        if echoed != nonce {
            return Err(Error::Protocol(format!(
                "Ping failed, invalid value returned from server. Expected: {nonce}, Got: {echoed} (store at {})",
                self.addr
            )));
        }
        Ok(())
    }

    /// PyTorch's `doWait`: `WAIT`, then `CANCEL_WAIT` if the timeout passes.
    pub(super) async fn wait(&mut self, wire_keys: &[String], timeout: Duration) -> Result<()> {
        let mut frame = Frame::request(QueryType::Wait);
        frame.keys(wire_keys);
        self.send(&frame).await?;
        let first = if timeout.is_zero() {
            Some(self.read_u8().await?)
        } else {
            match tokio::time::timeout(timeout, self.read_u8()).await {
                Ok(byte) => Some(byte?),
                Err(_) => None,
            }
        };
        match first {
            Some(STOP_WAITING) => return Ok(()),
            Some(other) => {
                return Err(Error::Protocol(format!(
                    "Stop_waiting response is expected, got {other} (store at {})",
                    self.addr
                )));
            }
            None => {}
        }
        self.send(&Frame::request(QueryType::CancelWait)).await?;
        // The server answers a cancel at once; bound it anyway so a hung
        // server cannot hang us.
        let bound = timeout.max(Duration::from_secs(1));
        let mut response = self.read_u8_within(bound).await?;
        if response == STOP_WAITING {
            // The keys arrived just before the cancel.
            response = self.read_u8_within(bound).await?;
        }
        if response != WAIT_CANCELED {
            return Err(Error::Protocol(format!(
                "wait_canceled response is expected, got {response} (store at {})",
                self.addr
            )));
        }
        Err(Error::Timeout {
            keys: wire_keys.iter().map(|k| user_key(k)).collect(),
            timeout,
        })
    }

    pub(super) async fn read_u8_within(&mut self, bound: Duration) -> Result<u8> {
        match tokio::time::timeout(bound, self.read_u8()).await {
            Ok(byte) => byte,
            Err(_) => Err(Error::Protocol(format!(
                "store at {} did not answer CANCEL_WAIT within {bound:?}",
                self.addr
            ))),
        }
    }
}
