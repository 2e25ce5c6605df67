//! The future's own tests: completion, callbacks, blocking waits.

use super::*;

#[test]
fn waiting_blocked_on_a_runtime_worker_lets_that_workers_next_task_run() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let f = Future::new();
        let c = f.clone();
        // Spawned from this worker, the task is the one it runs next,
        // which no other worker takes.
        tokio::spawn(async move { c.set_result(7) });
        let _ = tx.send(f.wait_blocking().and_then(|p| p.as_int()));
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(10));
    rt.shutdown_background();
    assert_eq!(got.expect("wait_blocking returned").unwrap(), 7);
}

#[test]
fn set_twice_fails_and_errors_are_sticky() {
    let f = Future::new();
    f.set_error(Error::value("Expected error")).unwrap();
    assert_eq!(
        f.set_result(1).unwrap_err().message(),
        FUTURE_COMPLETED_TWICE
    );
    for _ in 0..2 {
        assert_eq!(f.wait_blocking().unwrap_err().message(), "Expected error");
    }
    assert!(f.done());
}

#[test]
fn a_future_is_not_serialized() {
    let e = serde_json::to_string(&Future::new()).unwrap_err();
    assert_eq!(e.to_string(), FUTURE_PICKLE);
    assert!(postcard::to_allocvec(&Future::new()).is_err());
}

#[test]
fn then_chains_and_callback_errors_fail_the_child() {
    let f = Future::new();
    let child = f.then(|p| Ok((p.wait_blocking()?.as_int()? + 1).into()));
    let bad = f.then(|_| Err(Error::runtime("Another expected error")));
    f.set_result(1).unwrap();
    assert_eq!(child.wait_blocking().unwrap().as_int().unwrap(), 2);
    assert_eq!(
        bad.wait_blocking().unwrap_err().message(),
        "Another expected error"
    );
    assert_eq!(f.wait_blocking().unwrap().as_int().unwrap(), 1);
}
