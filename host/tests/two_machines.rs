//! A cluster across two "machines": two network namespaces joined by a
//! virtual Ethernet pair, each worker listening on its namespace's own
//! (non-loopback) address, credentials made with `wasmrpc cert`. The group
//! runs over TLS; processes that try to join without a certificate of the
//! cluster CA are refused and the group serves on.
//!
//! Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and
//! `ip` from iproute2; without them the test prints a `wasmrpc-skip:` line
//! and passes without checking anything.

mod common;

use std::time::Duration;

use common::netns::TwoHosts;
use common::{ServingProcess, run_with_deadline, text};

#[test]
fn two_network_namespaces_run_a_tls_group_that_refuses_intruders() {
    let hosts = match TwoHosts::create() {
        Ok(hosts) => hosts,
        Err(why) => {
            println!("wasmrpc-skip: needs root and `ip netns` to make two hosts ({why})");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let path = |p: &str| dir.path().join(p).to_str().expect("UTF-8").to_string();
    let cert = |args: &[&str]| {
        let out = common::wasmrpc(args, Duration::from_secs(30));
        assert!(out.status.success(), "{:?}", text(&out));
    };
    cert(&["cert", "init", "--out", &path("ca")]);
    cert(&["cert", "init", "--out", &path("other-ca")]);
    for name in ["worker0", "worker1", "worker5"] {
        cert(&[
            "cert",
            "issue",
            name,
            "--ca",
            &path("ca"),
            "--out",
            &path("certs"),
        ]);
    }
    // A certificate from a CA the group does not trust.
    cert(&[
        "cert",
        "issue",
        "worker3",
        "--ca",
        &path("other-ca"),
        "--out",
        &path("foreign"),
    ]);

    let (a, b) = (hosts.a.clone(), hosts.b.clone());
    let store = format!("tcp://{}:29500", hosts.addr(1));
    let worker = |ns: &str, rank: u32, host: u32, extra: &[String]| {
        let mut args: Vec<String> = [
            "worker",
            "--rank",
            &rank.to_string(),
            "--init-method",
            &store,
            "--listen",
            &format!("{}:0", hosts.addr(host)),
            "--init-timeout",
            "20",
            "--rpc-timeout",
            "10",
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        hosts.wasmrpc(ns, &args)
    };
    let tls_of = |ca: &str, dir: &str, name: &str| -> Vec<String> {
        vec![
            "--tls-ca".into(),
            path(&format!("{ca}/ca.pem")),
            "--tls-cert".into(),
            path(&format!("{dir}/{name}.pem")),
            "--tls-key".into(),
            path(&format!("{dir}/{name}.key")),
        ]
    };
    let tls = |dir: &str, name: &str| tls_of("ca", dir, name);
    let serve = |mut flags: Vec<String>| {
        flags.push("--serve".into());
        flags
    };

    // worker0 on host a (it hosts the store), worker1 on host b.
    let mut w0 =
        ServingProcess::start("worker0", worker(&a, 0, 1, &serve(tls("certs", "worker0"))));
    w0.wait_for("serving until interrupted");
    let mut w1 =
        ServingProcess::start("worker1", worker(&b, 1, 2, &serve(tls("certs", "worker1"))));
    w1.wait_for("serving until interrupted");
    assert!(
        w0.output()
            .contains("connections: TLS 1.3 with mutual authentication"),
        "{}",
        w0.output()
    );

    // Intruders on host b.
    // No credentials on a non-loopback address: refuses to start.
    let out = run_with_deadline(&mut worker(&b, 2, 2, &[]), Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("wasmrpc cert"), "{stderr}");
    // No credentials, --insecure: starts, but no member talks to it.
    let out = run_with_deadline(
        &mut worker(&b, 2, 2, &["--insecure".into(), "--ping-all".into()]),
        Duration::from_secs(60),
    );
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "an unauthenticated joiner got in:\n{stdout}\n{stderr}"
    );
    assert!(stderr.contains("handshake"), "{stderr}");
    assert!(!stdout.contains("answered"), "{stdout}");
    // A certificate of another CA (and that CA as the one it trusts).
    let mut foreign = tls_of("other-ca", "foreign", "worker3");
    foreign.push("--ping-all".into());
    let out = run_with_deadline(&mut worker(&b, 3, 2, &foreign), Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "a foreign certificate got in:\n{stdout}\n{stderr}"
    );
    assert!(stderr.contains("TLS"), "{stderr}");
    assert!(!stdout.contains("answered"), "{stdout}");

    // The group serves on: a member with a certificate of the cluster CA
    // joins from host b and reaches both workers.
    let mut member = tls("certs", "worker5");
    member.push("--ping-all".into());
    let out = run_with_deadline(&mut worker(&b, 5, 2, &member), Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for peer in ["worker0", "worker1"] {
        assert!(
            stdout.contains(&format!("worker5 -> {peer}: answered")),
            "{stdout}\n{stderr}"
        );
    }

    let w1_log = w1.stop();
    let w0_log = w0.stop();
    // The refusals were logged as warnings by the members they reached.
    let refusals = format!("{w0_log}\n{w1_log}");
    assert!(refusals.contains("WARN"), "{refusals}");
}

/// The link between the two "machines" drops (the veth goes down: no
/// reset, no close, packets just stop): each side declares the other
/// failed within the failure window, with the cause.
#[test]
fn a_dropped_link_is_reported_by_both_sides_within_the_window() {
    let hosts = match TwoHosts::create() {
        Ok(hosts) => hosts,
        Err(why) => {
            println!("wasmrpc-skip: needs root and `ip netns` to make two hosts ({why})");
            return;
        }
    };
    let store = format!("tcp://{}:29500", hosts.addr(1));
    let worker = |ns: &str, rank: u32, host: u32, extra: &[&str]| {
        let rank = rank.to_string();
        let listen = format!("{}:0", hosts.addr(host));
        let mut args = vec![
            "worker",
            "--rank",
            &rank,
            "--init-method",
            &store,
            "--listen",
            &listen,
            "--init-timeout",
            "20",
            "--serve",
        ];
        args.extend_from_slice(extra);
        let mut cmd = hosts.wasmrpc(ns, &args);
        cmd.env("WASMRPC_CLUSTER_SECRET", "two-machines-link-drop");
        cmd
    };
    let mut w0 = ServingProcess::start("worker0", worker(&hosts.a, 0, 1, &[]));
    w0.wait_for("serving until interrupted");
    // worker1 calls worker0 once: the two share a connection, idle after.
    let mut w1 = ServingProcess::start("worker1", worker(&hosts.b, 1, 2, &["--ping-all"]));
    w1.wait_for("worker1 -> worker0: answered");
    w1.wait_for("serving until interrupted");
    // Idle for longer than the window: heartbeats keep it alive.
    std::thread::sleep(Duration::from_secs(3));
    assert!(!w0.output().contains("worker1 failed"), "{}", w0.output());
    assert!(!w1.output().contains("worker0 failed"), "{}", w1.output());

    hosts.cut_link().expect("the link goes down");
    let dropped = std::time::Instant::now();
    // Both sides, within the 2 s window and some slack for the test's own
    // polling and a loaded machine; far below any call timeout.
    w0.wait_for("worker1 failed: no heartbeat for 2.0 s");
    w1.wait_for("worker0 failed: no heartbeat for 2.0 s");
    let took = dropped.elapsed();
    assert!(took < Duration::from_secs(15), "reported after {took:?}");
    eprintln!("both sides reported the dropped link {took:.1?} after it went down");
}
