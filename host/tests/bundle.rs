//! The release bundle on a machine that has nothing: `cargo xtask dist`
//! packs the binary this test suite was built with (`--from-build`: the
//! same packing as a release, from the debug build), the tarball is
//! unpacked under `/tmp`, and everything after that runs in an "empty
//! root": a network namespace of its own, in a mount namespace where the
//! checkout, the cargo target folder, `$HOME` (with the Rust toolchain,
//! Python and the cache folder holding torch) and `/usr/local` are hidden
//! under empty tmpfs mounts, with `PATH=/usr/bin:/bin` and `HOME` a fresh
//! folder. There the bundle's own binary:
//!
//! 1. runs the demo with `wasmrpc launch`, from the bundle's plugin and
//!    data, to a trained model;
//! 2. makes a cluster CA and worker certificates (`wasmrpc cert`), and two
//!    "machines" (two such namespaces joined by a veth pair) form a group
//!    over mutual TLS, one calling a plugin function that calls back across.
//!
//! Needs root (namespaces, mounts) and `ip`; without them the test prints a
//! `wasmrpc-skip:` line and passes without checking anything.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::demo::accuracy;
use common::netns::TwoHosts;
use common::{ServingProcess, run_with_deadline, text};

/// The workspace root (the checkout).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the workspace root")
}

/// Packs the debug build with `cargo xtask dist --from-build` into `out`;
/// returns the tarball.
fn pack(out: &Path, flavour: Option<&str>) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace())
        .args([
            "run",
            "--quiet",
            "-p",
            "xtask",
            "--",
            "dist",
            "--from-build",
        ])
        .arg(env!("CARGO_BIN_EXE_wasmrpc"))
        .arg("--out")
        .arg(out)
        .args(["--level", "1"]);
    if let Some(flavour) = flavour {
        cmd.args(["--flavour", flavour]);
    }
    let done = run_with_deadline(&mut cmd, Duration::from_secs(600));
    let (stdout, stderr) = text(&done);
    assert!(
        done.status.success(),
        "cargo xtask dist failed:\n{stdout}\n{stderr}"
    );
    let tarballs: Vec<PathBuf> = std::fs::read_dir(out)
        .expect("the dist folder")
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.to_string_lossy().ends_with(".tar.zst"))
        .collect();
    assert_eq!(tarballs.len(), 1, "one tarball: {tarballs:?}\n{stdout}");
    tarballs[0].clone()
}

/// The folders the empty root hides: the checkout, the target folder the
/// test binaries run from, `$HOME`, the cache folder and `/usr/local`.
fn hidden() -> Vec<PathBuf> {
    let mut dirs = vec![workspace(), PathBuf::from("/usr/local")];
    let exe = Path::new(env!("CARGO_BIN_EXE_wasmrpc"));
    if let Some(target) = exe.parent().and_then(Path::parent) {
        dirs.push(target.to_path_buf());
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home));
    }
    if let Some(cache) = std::env::var_os("XDG_CACHE_HOME") {
        dirs.push(PathBuf::from(cache));
    }
    dirs.sort();
    dirs.dedup();
    // A folder inside another hidden one is hidden with it (and mounting
    // over it would fail once its parent is empty).
    let all = dirs.clone();
    dirs.retain(|d| !all.iter().any(|o| o != d && d.starts_with(o)));
    dirs.retain(|d| d.is_dir());
    dirs
}

/// `program ARGS` in the empty root of namespace `ns`, with `home` as
/// `HOME`.
fn in_empty_root(ns: &str, home: &Path, program: &Path, args: &[&str]) -> Command {
    let mut script = String::new();
    for dir in hidden() {
        script.push_str(&format!(
            "mount -t tmpfs -o size=1m wasmrpc-empty '{}' || exit 90; ",
            dir.display()
        ));
    }
    script.push_str("exec env -i HOME=\"$0\" PATH=/usr/bin:/bin RUST_LOG=info \"$@\"");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, "unshare", "--mount", "--", "sh", "-c"])
        .arg(script)
        .arg(home)
        .arg(program)
        .args(args);
    cmd
}

#[test]
fn the_bundle_runs_the_demo_and_a_tls_group_on_machines_that_have_nothing() {
    let hosts = match TwoHosts::create() {
        Ok(hosts) => hosts,
        Err(why) => {
            println!("wasmrpc-skip: needs root and `ip netns` for an empty root ({why})");
            return;
        }
    };
    let dist = tempfile::tempdir().expect("temp dir");
    let tarball = pack(dist.path(), None);
    // Unpacked where the empty root still sees it.
    let root = tempfile::Builder::new()
        .prefix("wasmrpc-bundle-")
        .tempdir_in("/tmp")
        .expect("temp dir in /tmp");
    let bundle = unpack(&tarball, root.path());
    drop(dist);
    let bin = bundle.join("bin/wasmrpc");
    let share = bundle.join("share/wasmrpc");
    for inside in [
        "BUNDLE.txt",
        "share/wasmrpc/plugins/param_server.wasm",
        "share/wasmrpc/plugins/hello.wasm",
        "share/wasmrpc/sdk/rust/guest-sdk/Cargo.toml",
        "share/wasmrpc/sdk/python/wasmrpc",
        "lib/libtorch_cpu.so",
    ] {
        assert!(bundle.join(inside).exists(), "the bundle has no {inside}");
    }
    // A CUDA build's binary links no CUDA library (it loads libtorch_cuda.so
    // at run time where a GPU is); its bundle carries CUDA's side through
    // c10d's NCCL library, which links it.
    let nccl_beside_binary = Path::new(env!("CARGO_BIN_EXE_wasmrpc"))
        .with_file_name("libwasmrpc_c10d_nccl.so")
        .is_file();
    if nccl_beside_binary {
        for inside in ["lib/libwasmrpc_c10d_nccl.so", "lib/libtorch_cuda.so"] {
            assert!(
                bundle.join(inside).exists(),
                "the CUDA bundle has no {inside}"
            );
        }
    }
    // The container recipe the bundle carries copies what the bundle has.
    let containerfile = std::fs::read_to_string(share.join("deploy/Containerfile"))
        .expect("the bundle carries the container recipe");
    let copied: Vec<&str> = containerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY ${BUNDLE}/"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(copied.contains(&"bin"), "{containerfile}");
    for path in copied {
        assert!(
            bundle.join(path).exists(),
            "the Containerfile copies {path}, which the bundle lacks"
        );
    }
    let work = root.path().join("work");
    std::fs::create_dir_all(work.join("home")).expect("home");
    let home = work.join("home");
    let path = |p: &str| work.join(p).to_str().expect("UTF-8").to_string();

    // Nothing of the build machine is visible in the empty root.
    let cache = home_cache();
    let probe = run_with_deadline(
        &mut in_empty_root(
            &hosts.a,
            &home,
            Path::new("/bin/sh"),
            &[
                "-c",
                &format!(
                    "if command -v cargo || command -v rustc || [ -e '{}' ] || [ -e '{}' ]; \
                     then exit 1; fi; echo empty",
                    cache.display(),
                    workspace().join("Cargo.toml").display()
                ),
            ],
        ),
        Duration::from_secs(30),
    );
    let (stdout, stderr) = text(&probe);
    assert!(
        probe.status.success() && stdout.contains("empty"),
        "the empty root still sees the build machine: {stdout}\n{stderr}"
    );

    // 1. The demo, from the bundle's plugin and data.
    let result = path("result.json");
    std::fs::create_dir_all(work.join("ckpt")).expect("ckpt");
    let data_grant = format!(
        "param_server:/data={}:ro",
        share.join("examples/data").display()
    );
    let ckpt_grant = format!("param_server:/ckpt={}:rw", path("ckpt"));
    let plugin = share.join("plugins/param_server.wasm");
    let demo = run_with_deadline(
        &mut in_empty_root(
            &hosts.a,
            &home,
            &bin,
            &[
                "launch",
                "--nproc",
                "4",
                "--plugins",
                plugin.to_str().expect("UTF-8"),
                "--grant-dir",
                &data_grant,
                "--grant-dir",
                &ckpt_grant,
                "--entry",
                "param_server::run",
                "--result",
                &result,
                "--",
                "3",
                "2",
            ],
        ),
        Duration::from_secs(300),
    );
    let (stdout, stderr) = text(&demo);
    assert!(
        demo.status.success(),
        "the demo failed from the bundle:\n{stdout}\n{stderr}"
    );
    let accuracy = accuracy(Path::new(&result));
    assert_eq!(accuracy.len(), 2, "{accuracy:?}");
    assert!(
        accuracy[1] > 0.5,
        "the demo did not learn from the bundle: {accuracy:?}"
    );

    // 2. Credentials from the bundle's own `wasmrpc cert`, and a TLS group
    // across two machines.
    let cert = |args: &[&str]| {
        let out = run_with_deadline(
            &mut in_empty_root(&hosts.a, &home, &bin, args),
            Duration::from_secs(30),
        );
        assert!(out.status.success(), "{:?}", text(&out));
    };
    cert(&["cert", "init", "--out", &path("ca")]);
    for name in ["worker0", "worker1"] {
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
    let hello = share.join("plugins/hello.wasm");
    let store = format!("tcp://{}:29500", hosts.addr(1));
    let worker = |ns: &str, rank: u32, host: u32, extra: &[&str]| {
        let name = format!("worker{rank}");
        let mut args: Vec<String> = [
            "worker",
            "--rank",
            &rank.to_string(),
            "--world-size",
            "2",
            "--init-method",
            &store,
            "--listen",
            &format!("{}:0", hosts.addr(host)),
            "--init-timeout",
            "30",
            "--rpc-timeout",
            "20",
            "--plugins",
            hello.to_str().expect("UTF-8"),
            "--tls-ca",
            &path("ca/ca.pem"),
            "--tls-cert",
            &path(&format!("certs/{name}.pem")),
            "--tls-key",
            &path(&format!("certs/{name}.key")),
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|s| (*s).to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        in_empty_root(ns, &home, &bin, &args)
    };
    let mut w1 = ServingProcess::start("worker1", worker(&hosts.b, 1, 2, &[]));
    let answer = path("answer.json");
    let w0 = run_with_deadline(
        &mut worker(
            &hosts.a,
            0,
            1,
            &[
                "--entry",
                "hello::double_on",
                "--result",
                &answer,
                "--",
                "worker1",
                "5",
            ],
        ),
        Duration::from_secs(120),
    );
    let (stdout, stderr) = text(&w0);
    assert!(
        w0.status.success(),
        "worker0 failed:\n{stdout}\n{stderr}\nworker1:\n{}",
        w1.output()
    );
    assert!(
        stderr.contains("connections: TLS 1.3 with mutual authentication"),
        "{stderr}"
    );
    let answer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&answer).expect("worker0 wrote its answer"))
            .expect("JSON");
    assert_eq!(answer["data"], serde_json::json!([10.0]), "{answer}");
    // worker1 leaves with the group.
    let status = w1.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "worker1: {status}\n{}", w1.output());

    // What ran was the bundle's libtorch: without one of its libraries the
    // binary does not start (nothing falls back to the build machine's).
    std::fs::rename(bundle.join("lib/libc10.so"), work.join("libc10.so")).expect("move");
    let out = run_with_deadline(
        &mut in_empty_root(&hosts.a, &home, &bin, &["--version"]),
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "started without libc10.so");
    assert!(
        stderr.contains("libc10.so: cannot open shared object file"),
        "{stderr}"
    );
}

/// Unpacks `tarball` into `into`; returns the bundle's folder.
fn unpack(tarball: &Path, into: &Path) -> PathBuf {
    let untar = Command::new("tar")
        .arg("--use-compress-program=zstd -d")
        .arg("-xf")
        .arg(tarball)
        .arg("-C")
        .arg(into)
        .status()
        .expect("tar");
    assert!(untar.success(), "unpacking {}", tarball.display());
    std::fs::read_dir(into)
        .expect("the unpacked bundle")
        .filter_map(|e| Some(e.ok()?.path()))
        .find(|p| p.is_dir() && p.to_string_lossy().contains("wasmrpc-"))
        .expect("one folder in the tarball")
}

/// A stand-in for `python3` that reports torch `version` with its
/// libraries in `lib` (or fails to import torch when `version` is empty).
fn fake_python(dir: &Path, version: &str, lib: &Path) -> PathBuf {
    let path = dir.join(format!(
        "python-{}",
        if version.is_empty() { "none" } else { version }
    ));
    let body = if version.is_empty() {
        "echo 'ModuleNotFoundError: No module named torch' >&2; exit 1".to_owned()
    } else {
        format!("echo '{version}'; echo '{}'", lib.display())
    };
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write");
    let status = Command::new("chmod").arg("+x").arg(&path).status();
    assert!(status.is_ok_and(|s| s.success()));
    path
}

/// The `system-torch` flavour runs with the machine's torch of the release
/// it was built against, and refuses, by name, any other torch, a Python
/// without torch, and a torch missing a library the binary links.
#[test]
fn the_system_torch_bundle_runs_only_with_the_torch_it_was_built_against() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tarball = pack(&dir.path().join("dist"), Some("system-torch"));
    let bundle = unpack(&tarball, dir.path());
    assert!(
        !bundle.join("lib").exists(),
        "a system-torch bundle ships no libtorch"
    );
    let bin = bundle.join("bin/wasmrpc");
    let run = |python: &Path| {
        let mut cmd = Command::new(&bin);
        cmd.arg("--version")
            .env("WASMRPC_PYTHON", python)
            .env_remove("LD_LIBRARY_PATH");
        run_with_deadline(&mut cmd, Duration::from_secs(60))
    };

    // The torch the binary was linked against (the set-up's, or another
    // release under `cargo xtask test --torch`), and a stand-in Python that
    // reports it; the set-up's own Python too when it is that release.
    let (built_version, built_lib) = linked_torch();
    let python = fake_python(dir.path(), &built_version, &built_lib);
    let out = run(&python);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.starts_with("wasmrpc "), "{stdout}");
    let setup_python = home_cache().join("torch-2.13.0/bin/python");
    if built_version.split('+').next() == Some("2.13.0") {
        let out = run(&setup_python);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
    }
    let real_lib = built_lib.clone();
    // A Python plugin built with the bundle's binary uses the guest kit the
    // bundle carries (not the checkout's), and the bundle's binary serves it.
    let plugin_dir = dir.path().join("adder");
    std::fs::create_dir_all(&plugin_dir).expect("mkdir");
    std::fs::write(
        plugin_dir.join("app.py"),
        "from wasmrpc import remote\n\n\n@remote\ndef add(a, b):\n    return a + b\n",
    )
    .expect("write app.py");
    let wasm = dir.path().join("adder.wasm");
    let mut build = Command::new(&bin);
    build
        .args(["plugin", "build-py"])
        .arg(&plugin_dir)
        .arg("-o")
        .arg(&wasm)
        .env("WASMRPC_PYTHON", &python)
        .env_remove("WASMRPC_SDK_DIR");
    let out = run_with_deadline(&mut build, Duration::from_secs(240));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let kit = bundle.join("share/wasmrpc/sdk/python");
    assert!(
        stdout.contains(&format!("(guest kit: {})", kit.display())),
        "built against another kit than the bundle's: {stdout}"
    );
    let mut serve = Command::new(&bin);
    serve
        .args(["launch", "--nproc", "1", "--plugins"])
        .arg(&wasm)
        .args(["--entry", "adder::add", "--", "2", "3"])
        .env("WASMRPC_PYTHON", &python);
    let out = run_with_deadline(&mut serve, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("adder::add returned Int(5)"), "{stdout}");

    // Another release: refused before the binary is loaded.
    let base = built_version.split('+').next().unwrap_or(&built_version);
    let out = run(&fake_python(dir.path(), "2.10.0+cu130", &real_lib));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("this bundle was built against torch {base}, but"))
            && stderr.contains("has torch 2.10.0+cu130"),
        "{stderr}"
    );
    // No torch at all.
    let out = run(&fake_python(dir.path(), "", &real_lib));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("cannot import torch"), "{stderr}");
    // The right release, but a torch folder without the binary's libraries
    // (a CPU-only torch for a CUDA build).
    let empty = dir.path().join("empty-lib");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let out = run(&fake_python(dir.path(), base, &empty));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("this bundle needs lib") && stderr.contains("has none"),
        "{stderr}"
    );
}

/// The version (`torch/version.py`'s `__version__`) and the `lib` folder
/// of the libtorch this test suite's binary is linked against.
fn linked_torch() -> (String, PathBuf) {
    let out = Command::new("ldd")
        .arg(env!("CARGO_BIN_EXE_wasmrpc"))
        .output()
        .expect("ldd");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let path = text
        .lines()
        .find_map(|l| {
            let (name, rest) = l.trim().split_once(" => ")?;
            (name == "libtorch_cpu.so").then(|| rest.split(" (").next().unwrap_or(rest).to_owned())
        })
        .unwrap_or_else(|| panic!("the binary links no libtorch_cpu.so:\n{text}"));
    let lib = std::fs::canonicalize(path)
        .expect("libtorch_cpu.so resolves")
        .parent()
        .expect("its folder")
        .to_path_buf();
    let version_py = std::fs::read_to_string(lib.join("../version.py")).expect("torch/version.py");
    let version = version_py
        .lines()
        .find_map(|l| {
            let (lhs, rhs) = l.split_once('=')?;
            (lhs.split(':').next()?.trim() == "__version__")
                .then(|| rhs.trim().trim_matches(['\'', '"']).to_owned())
        })
        .expect("a __version__ line");
    (version, lib)
}

/// The cache folder the set-up installs torch into.
fn home_cache() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
        })
        .join("wasmrpc")
}
