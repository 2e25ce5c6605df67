use super::*;

#[test]
fn waiter_fires_once_every_key_is_set() {
    let mut inner = Inner::default();
    let waiter = inner.wait(vec![b"a".to_vec(), b"b".to_vec()]).unwrap();
    inner.set(b"a".to_vec(), b"1".to_vec());
    assert!(!waiter.has_fired());
    inner.set(b"b".to_vec(), b"2".to_vec());
    assert!(waiter.has_fired());
    assert!(inner.waiting.is_empty());
    assert!(inner.wait(vec![b"a".to_vec()]).is_none());
}

#[test]
fn cancel_removes_the_waiter_everywhere() {
    let mut inner = Inner::default();
    let waiter = inner.wait(vec![b"a".to_vec(), b"b".to_vec()]).unwrap();
    inner.cancel(&waiter);
    assert!(inner.waiting.is_empty());
    inner.set(b"a".to_vec(), vec![]);
    assert!(!waiter.has_fired());
}

#[test]
fn queue_push_wakes_one_waiter() {
    let mut inner = Inner::default();
    let first = inner.wait(vec![b"q".to_vec()]).unwrap();
    let second = inner.wait(vec![b"q".to_vec()]).unwrap();
    inner
        .queues
        .entry(b"q".to_vec())
        .or_default()
        .push_back(vec![1]);
    inner.wake_one(b"q");
    assert!(first.has_fired());
    assert!(!second.has_fired());
}

/// Sends `bytes` after a valid `VALIDATE` on a fresh connection, closes
/// the writing half and reads until the server closes. Returns an error
/// if the server takes over 5 s to close.
async fn send_and_drain(addr: SocketAddr, bytes: &[u8]) -> Result<(), String> {
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut validate = Frame::request(QueryType::Validate);
    validate.u32(VALIDATION_MAGIC);
    // The server may close on bad bytes before taking them all.
    let _ = stream.write_all(&validate.0).await;
    let _ = stream.write_all(bytes).await;
    let _ = stream.shutdown().await;
    let mut sink = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        let _ = stream.read_to_end(&mut sink).await;
    })
    .await
    .map_err(|_| "the server did not close a connection whose client closed".to_string())
}

/// A valid client still gets an answer.
async fn still_serves(addr: SocketAddr) -> Result<(), String> {
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut f = Frame::request(QueryType::Validate);
    f.u32(VALIDATION_MAGIC);
    f.u8(QueryType::Ping as u8).u32(0xDEAD_BEEF);
    stream.write_all(&f.0).await.map_err(|e| e.to_string())?;
    let mut echo = [0u8; 4];
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        stream.read_exact(&mut echo),
    )
    .await
    .map_err(|_| "no PING reply within 5 s".to_string())?
    .map_err(|e| format!("PING: {e}"))?;
    if u32::from_le_bytes(echo) != 0xDEAD_BEEF {
        return Err(format!("PING echoed {echo:?}"));
    }
    Ok(())
}

fn serve_bytes(bytes: &[u8]) -> Result<(), proptest::test_runner::TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
    rt.block_on(async {
        let server = crate::tcp::TcpStoreServer::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = server.local_addr();
        send_and_drain(addr, bytes).await?;
        still_serves(addr).await?;
        server.shutdown().await;
        Ok::<(), String>(())
    })
    .map_err(proptest::test_runner::TestCaseError::fail)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Arbitrary bytes after `VALIDATE`: the server answers or closes,
    /// never panics or hangs, and keeps serving others.
    #[test]
    fn arbitrary_requests_leave_the_server_serving(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
    ) {
        serve_bytes(&bytes)?;
    }

    /// Mutated valid requests (flipped bytes, cuts, huge lengths), a few
    /// in a row on one connection.
    #[test]
    fn mutated_requests_leave_the_server_serving(
        picks in proptest::collection::vec(
            (proptest::prelude::any::<usize>(),
             proptest::collection::vec(crate::tcp::protocol::tests::mutation(), 0..3)),
            1..4,
        ),
    ) {
        use crate::tcp::protocol::tests::{mutate, valid_requests};
        let valid = valid_requests();
        let mut bytes = Vec::new();
        for (which, ms) in &picks {
            bytes.extend(mutate(valid[which % valid.len()].clone(), ms));
        }
        serve_bytes(&bytes)?;
    }
}
