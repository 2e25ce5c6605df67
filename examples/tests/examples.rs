//! Each example, run small on a local cluster, with its outcome checked.

use wasmrpc_examples::{param_server, pipeline, rl};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Runs `fut` under a deadline, so a lost message fails instead of hanging.
fn timed<T>(fut: impl std::future::Future<Output = anyhow::Result<T>>) -> T {
    runtime()
        .block_on(async { tokio::time::timeout(std::time::Duration::from_secs(50), fut).await })
        .expect("the example ran out of time")
        .unwrap_or_else(|e| panic!("{e:#}"))
}

fn check_learns(out: &rl::Outcome) {
    let (first, last) = (out.quarter_mean(true), out.quarter_mean(false));
    assert!(
        last > 1.5 * first,
        "the average return did not rise: first quarter {first:.1}, last quarter {last:.1} ({:?})",
        out.returns
    );
}

#[test]
fn rl_batched_answers_all_observers_at_once_and_learns() {
    let config = rl::Config {
        iterations: 20,
        ..rl::Config::default()
    };
    let out = timed(rl::run(config));
    let expected = i64::from(config.observers * config.steps * config.iterations);
    assert_eq!(out.requests, expected, "every step asked for one action");
    assert_eq!(
        out.batches * i64::from(config.observers),
        out.requests,
        "every policy pass answered one request per observer"
    );
    check_learns(&out);
}

#[test]
fn rl_unbatched_answers_each_request_and_learns() {
    let config = rl::Config {
        iterations: 20,
        batch: false,
        ..rl::Config::default()
    };
    let out = timed(rl::run(config));
    assert_eq!(out.batches, out.requests, "one policy pass per request");
    check_learns(&out);
}

#[test]
fn param_server_serves_the_digits_and_evaluates_its_model_from_another_worker() {
    let (summary, eval) = timed(param_server::untrained(32, 1));
    assert_eq!(summary.train + summary.test, 1797, "{summary:?}");
    assert_eq!(
        summary.test, 359,
        "every fifth image is held out: {summary:?}"
    );
    assert_eq!(summary.per_class.iter().sum::<i64>(), 1797, "{summary:?}");
    assert!(
        summary.per_class.iter().all(|&c| (170..=190).contains(&c)),
        "about 180 images per digit: {summary:?}"
    );
    // An untrained 10-way classifier: near-uniform logits and chance-level
    // accuracy.
    assert!((eval.loss - 10f64.ln()).abs() < 0.5, "{eval:?}");
    assert!(eval.accuracy < 0.35, "{eval:?}");
}

#[test]
fn param_server_trains_the_digits_mlp_to_at_least_90_percent_held_out() {
    let config = param_server::Config::default();
    let history = timed(param_server::train(config));
    assert_eq!(
        history.accuracy.len(),
        config.epochs as usize,
        "{history:?}"
    );
    let last = *history.accuracy.last().expect("one accuracy per epoch");
    assert!(
        last >= 0.90,
        "held-out accuracy {last:.3} < 0.90: {history:?}"
    );
    assert!(
        history.train_loss.last() < history.train_loss.first(),
        "the training loss did not fall: {history:?}"
    );
}

/// Both schedules compute the same training (the same micro-batches, the
/// same summed gradients), so their losses agree; and training works.
#[test]
fn pipeline_pipelined_and_sequential_train_the_same_and_the_loss_falls() {
    let config = pipeline::Config {
        steps: 12,
        ..pipeline::Config::default()
    };
    let pipelined = timed(pipeline::run(config));
    let sequential = timed(pipeline::run(pipeline::Config {
        pipelined: false,
        ..config
    }));
    assert_eq!(pipelined.losses.len(), 12, "{pipelined:?}");
    for (a, b) in pipelined.losses.iter().zip(&sequential.losses) {
        assert!(
            (a - b).abs() < 1e-4,
            "the schedules diverged: {pipelined:?} vs {sequential:?}"
        );
    }
    let first = pipelined.losses[..3].iter().sum::<f64>() / 3.0;
    let last = pipelined.losses[9..].iter().sum::<f64>() / 3.0;
    assert!(last < 0.8 * first, "the loss did not fall: {pipelined:?}");
}
