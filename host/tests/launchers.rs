//! The deployment recipes under `examples/deploy/` (issue 47), checked by
//! what runs on a machine with no image builder, no cluster and no Slurm:
//!
//! - `Containerfile`, statically: every `COPY` source is in the release
//!   bundle's layout, the entrypoint is where the bundle's `bin/wasmrpc`
//!   lands, the user is numeric and not root, the base a slim Debian; a
//!   Containerfile breaking each rule is refused, by its text.
//! - `kubernetes/`: every manifest passes `kubernetes-validate --strict`
//!   (the API's schemas, offline) and a misspelt field does not; the
//!   manifests agree with each other and with the image (names, ports,
//!   world size, user); then the Job runs here as a kubelet would run its
//!   pods on one host: its init container's script picks each pod's own
//!   certificate out of a Secret made by `wasmrpc cert`, and its worker
//!   container's command line, with the manifest's environment, forms the
//!   group and runs the parameter-server demo.
//! - `slurm/wasmrpc.sbatch`: run by bash under a faked Slurm (`srun` and
//!   `scontrol` on `PATH`, `SLURM_*` variables) with the real binary as the
//!   bundle's: 3 workers, TLS, an entry whose result is checked; a failing
//!   entry fails the job, and the script refuses to run outside Slurm.
//!
//! The bundle is a stand-in built per test with the release bundle's layout
//! ([`BUNDLE_LAYOUT`]), its `bin/wasmrpc` the binary cargo built.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

#[allow(dead_code, reason = "helpers shared with the CLI tests")]
mod common;

use common::demo::{checkpointed_step, data_dir};
use common::{CREDENTIAL_ENV, run_with_deadline, text, wasmrpc};

/// The release bundle's layout (`wasmrpc-VERSION-x86_64-linux-FLAVOUR/`),
/// folders ending in `/`: what the recipes may rely on.
const BUNDLE_LAYOUT: &[&str] = &[
    "bin/wasmrpc",
    "lib/",
    "share/wasmrpc/plugins/",
    "share/wasmrpc/examples/data/",
    "share/wasmrpc/deploy/",
    "share/wasmrpc/sdk/",
    "BUNDLE.txt",
];

/// A file of `examples/deploy/`.
fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/deploy")
        .join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Makes a stand-in release bundle under `dir`: [`BUNDLE_LAYOUT`], with
/// cargo's `wasmrpc` as `bin/wasmrpc` (it finds its libtorch as the tests'
/// binary does), the param-server and seed-fns plugins, and the demo's
/// digits.
fn bundle(dir: &Path) -> PathBuf {
    let root = dir.join("wasmrpc-0.1.0-x86_64-linux-test");
    for entry in BUNDLE_LAYOUT {
        let path = root.join(entry);
        if entry.ends_with('/') {
            std::fs::create_dir_all(&path).expect("bundle folder");
        } else {
            std::fs::create_dir_all(path.parent().expect("a parent")).expect("bundle folder");
        }
    }
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_wasmrpc"), root.join("bin/wasmrpc"))
        .expect("bin/wasmrpc");
    std::fs::write(
        root.join("BUNDLE.txt"),
        "wasmrpc 0.1.0 (a test's stand-in)\n",
    )
    .expect("BUNDLE.txt");
    let plugins = root.join("share/wasmrpc/plugins");
    for (name, built) in [
        ("param_server.wasm", wasmrpc_plugins::PARAM_SERVER),
        ("seed_fns.wasm", wasmrpc_plugins::SEED_FNS),
    ] {
        std::os::unix::fs::symlink(built, plugins.join(name)).expect("plugin link");
    }
    std::fs::copy(
        data_dir().join("digits.csv.gz"),
        root.join("share/wasmrpc/examples/data/digits.csv.gz"),
    )
    .expect("the demo's digits");
    root
}

// ---------------------------------------------------------------------------
// Containerfile

/// What is wrong with a Containerfile for the bundle at `bundle` (the build
/// context): one message per broken rule, none when it is right.
fn containerfile_problems(text: &str, bundle: &Path) -> Vec<String> {
    // Instructions, continuation lines joined, comments dropped.
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                instructions.push(std::mem::take(&mut current));
            }
        }
    }
    let mut args: BTreeMap<String, String> = BTreeMap::new();
    let substitute = |s: &str, args: &BTreeMap<String, String>| {
        args.iter().fold(s.to_string(), |s, (k, v)| {
            s.replace(&format!("${{{k}}}"), v)
                .replace(&format!("${k}"), v)
        })
    };
    let mut problems = Vec::new();
    let (mut from, mut user, mut entrypoint) = (None, None, None);
    let mut copies: Vec<(String, String)> = Vec::new();
    for instruction in &instructions {
        let (keyword, rest) = instruction
            .split_once(char::is_whitespace)
            .unwrap_or((instruction.as_str(), ""));
        let rest = rest.trim();
        match keyword.to_ascii_uppercase().as_str() {
            "ARG" => {
                let (name, default) = rest.split_once('=').unwrap_or((rest, ""));
                args.insert(name.to_string(), substitute(default, &args));
            }
            "FROM" => from = Some(substitute(rest, &args)),
            "USER" => user = Some(substitute(rest, &args)),
            "ENTRYPOINT" => {
                entrypoint = Some(serde_json::from_str::<Vec<String>>(rest).map_err(|_| rest))
            }
            kw @ ("COPY" | "ADD") => {
                let words: Vec<String> = match serde_json::from_str::<Vec<String>>(rest) {
                    Ok(words) => words,
                    Err(_) => rest.split_whitespace().map(str::to_string).collect(),
                };
                let mut words: Vec<String> = words
                    .into_iter()
                    .filter(|w| {
                        if w.starts_with("--from") {
                            problems.push(format!("{kw} {w}: not from the bundle"));
                        }
                        !w.starts_with("--")
                    })
                    .map(|w| substitute(&w, &args))
                    .collect();
                let Some(dest) = words.pop() else {
                    problems.push(format!("{kw} without a destination"));
                    continue;
                };
                for source in words {
                    let mut relative = source.as_str();
                    while let Some(r) = relative.strip_prefix("./") {
                        relative = r;
                    }
                    let relative = match relative.trim_end_matches('/') {
                        "." => "",
                        r => r,
                    };
                    if !bundle.join(relative).exists() {
                        problems.push(format!(
                            "{kw} source {source} is not in the release bundle's layout"
                        ));
                    }
                    copies.push((relative.to_string(), dest.clone()));
                }
            }
            _ => {}
        }
    }
    match &from {
        Some(image) if image.starts_with("debian:") && image.contains("slim") => {}
        other => problems.push(format!("FROM {other:?} is not a slim Debian base")),
    }
    let numeric_non_root = user.as_deref().is_some_and(|u| {
        u.split(':')
            .next()
            .and_then(|uid| uid.parse::<u32>().ok())
            .is_some_and(|uid| uid != 0)
    });
    if !numeric_non_root {
        problems.push(format!(
            "USER {user:?} is not a numeric non-root user (Kubernetes' runAsNonRoot checks a \
             numeric one)"
        ));
    }
    // Where the bundle's binary lands in the image.
    let binary = "bin/wasmrpc";
    let landings: Vec<String> = copies
        .iter()
        .filter_map(|(source, dest)| {
            let dest = dest.trim_end_matches('/');
            if source.is_empty() {
                Some(format!("{dest}/{binary}"))
            } else if source == binary {
                Some(dest.to_string())
            } else {
                binary
                    .strip_prefix(&format!("{source}/"))
                    .map(|rest| format!("{dest}/{rest}"))
            }
        })
        .collect();
    match entrypoint {
        Some(Ok(words)) if words.first().is_some_and(|w| landings.contains(w)) => {}
        Some(Ok(words)) => problems.push(format!(
            "ENTRYPOINT {words:?} is not the bundle's binary ({binary} lands at {landings:?})"
        )),
        Some(Err(shell)) => problems.push(format!(
            "ENTRYPOINT {shell} is not in exec form (a JSON array)"
        )),
        None => problems.push("no ENTRYPOINT".to_string()),
    }
    problems
}

/// `text` with `from` replaced by `to`, which must be there.
fn replaced(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "no {from:?} to replace in:\n{text}");
    text.replacen(from, to, 1)
}

#[test]
fn the_containerfile_copies_the_bundle_and_runs_its_binary_as_a_non_root_user() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bundle = bundle(dir.path());
    let containerfile = read(&deploy("Containerfile"));
    let problems = containerfile_problems(&containerfile, &bundle);
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(
        containerfile.contains("ENTRYPOINT [\"/opt/wasmrpc/bin/wasmrpc\"]"),
        "{containerfile}"
    );
    // Its header says why it is not built here.
    assert!(containerfile.contains("NOT BUILT BY wasmrpc's TESTS"));

    // The checks refuse what they are for.
    let broken = replaced(&containerfile, "${BUNDLE}/lib ", "${BUNDLE}/lib64 ");
    let broken = replaced(&broken, "USER 10001:10001", "USER wasmrpc");
    let broken = replaced(
        &broken,
        "ENTRYPOINT [\"/opt/wasmrpc/bin/wasmrpc\"]",
        "ENTRYPOINT [\"/usr/local/bin/wasmrpc\"]",
    );
    let broken = replaced(&broken, "BASE=debian:bookworm-slim", "BASE=debian:bookworm");
    let problems = containerfile_problems(&broken, &bundle).join("\n");
    for needle in [
        "COPY source ./lib64 is not in the release bundle's layout",
        "USER Some(\"wasmrpc\") is not a numeric non-root user",
        "ENTRYPOINT [\"/usr/local/bin/wasmrpc\"] is not the bundle's binary (bin/wasmrpc lands \
         at [\"/opt/wasmrpc/bin/wasmrpc\"])",
        "FROM Some(\"debian:bookworm\") is not a slim Debian base",
    ] {
        assert!(problems.contains(needle), "no {needle:?} in:\n{problems}");
    }
    let shell_form = replaced(
        &containerfile,
        "ENTRYPOINT [\"/opt/wasmrpc/bin/wasmrpc\"]",
        "ENTRYPOINT /opt/wasmrpc/bin/wasmrpc",
    );
    let problems = containerfile_problems(&shell_form, &bundle).join("\n");
    assert!(problems.contains("is not in exec form"), "{problems}");
}

// ---------------------------------------------------------------------------
// Kubernetes

/// The set-up's venv (`.wasmrpc-env/venv`): kubernetes-validate and PyYAML
/// are there (`cargo xtask setup`).
fn venv_tool(name: &str) -> PathBuf {
    let env = std::env::var_os("WASMRPC_ENV")
        .expect("WASMRPC_ENV is not set: run the tests through cargo (`cargo xtask test`)");
    let tool = Path::new(&env).join("venv/bin").join(name);
    assert!(
        tool.exists(),
        "no {} (kubernetes-validate is installed by `cargo xtask setup`)",
        tool.display()
    );
    tool
}

/// `kubernetes-validate --strict` against Kubernetes `version`.
fn kubernetes_validate(files: &[PathBuf], version: &str) -> Output {
    let mut cmd = Command::new(venv_tool("kubernetes-validate"));
    cmd.args(["--strict", "-k", version]).args(files);
    run_with_deadline(&mut cmd, Duration::from_secs(30))
}

/// A YAML manifest as JSON (PyYAML, in the venv with kubernetes-validate).
fn manifest(path: &Path) -> serde_json::Value {
    let mut cmd = Command::new(venv_tool("python"));
    cmd.args([
        "-c",
        "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
    ])
    .arg(path)
    .env("PYTHONDONTWRITEBYTECODE", "1");
    let out = run_with_deadline(&mut cmd, Duration::from_secs(30));
    assert!(out.status.success(), "{:?}", text(&out));
    serde_json::from_slice(&out.stdout).expect("JSON from PyYAML")
}

fn manifests() -> Vec<PathBuf> {
    vec![
        deploy("kubernetes/service.yaml"),
        deploy("kubernetes/job.yaml"),
    ]
}

#[test]
fn the_kubernetes_manifests_pass_the_api_schemas_and_a_misspelt_field_does_not() {
    // The oldest Kubernetes with the labels the recipe selects on
    // (batch.kubernetes.io/job-name: 1.27), and the newest the validator has.
    for version in ["1.27.0", "1.37.0"] {
        let out = kubernetes_validate(&manifests(), version);
        let (stdout, stderr) = text(&out);
        assert!(
            out.status.success(),
            "Kubernetes {version}:\n{stdout}\n{stderr}"
        );
        for resource in ["job/wasmrpc", "service/wasmrpc"] {
            assert!(
                stdout.contains(&format!("passed for resource {resource}")),
                "{stdout}\n{stderr}"
            );
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let job = read(&deploy("kubernetes/job.yaml"));
    let misspelt = dir.path().join("job.yaml");
    std::fs::write(
        &misspelt,
        replaced(&job, "completionMode: Indexed", "completionMod: Indexed"),
    )
    .expect("write the copy");
    let out = kubernetes_validate(&[misspelt], "1.37.0");
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        format!("{stdout}{stderr}").contains("'completionMod' was unexpected"),
        "{stdout}\n{stderr}"
    );
}

/// A container's environment from the manifest: its values, and what the
/// downward API would give pod `index` (the completion index; the pod's
/// IP, here 127.0.0.1).
fn container_env(container: &serde_json::Value, index: usize) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().expect("env name").to_string();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_string()
        } else {
            match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("metadata.annotations['batch.kubernetes.io/job-completion-index']") => {
                    index.to_string()
                }
                Some("status.podIP") => "127.0.0.1".to_string(),
                other => panic!("{name}: no stand-in for {other:?}"),
            }
        };
        env.push((name, value));
    }
    env
}

fn env_value<'a>(env: &'a [(String, String)], name: &str) -> &'a str {
    env.iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name} in {env:?}"))
}

#[test]
fn the_kubernetes_manifests_agree_with_each_other_and_with_the_image() {
    let service = manifest(&deploy("kubernetes/service.yaml"));
    let job = manifest(&deploy("kubernetes/job.yaml"));
    let job_name = job["metadata"]["name"].as_str().expect("job name");
    let service_name = service["metadata"]["name"].as_str().expect("service name");
    let spec = &job["spec"];
    let pod = &spec["template"]["spec"];
    assert_eq!(service["spec"]["clusterIP"], "None", "not headless");
    assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
    assert_eq!(
        service["spec"]["selector"]["batch.kubernetes.io/job-name"],
        job_name
    );
    assert_eq!(spec["completionMode"], "Indexed");
    assert_eq!(pod["subdomain"], service_name);
    let worker = &pod["containers"][0];
    let env = container_env(worker, 0);
    assert_eq!(
        env_value(&env, "MASTER_ADDR"),
        format!("{job_name}-0.{service_name}")
    );
    let world = env_value(&env, "WORLD_SIZE");
    assert_eq!(spec["completions"].to_string(), world);
    assert_eq!(spec["parallelism"].to_string(), world);
    let service_port = |name: &str| {
        service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no {name} port"))["port"]
            .to_string()
    };
    let container_ports: Vec<String> = worker["ports"]
        .as_array()
        .expect("container ports")
        .iter()
        .map(|p| p["containerPort"].to_string())
        .collect();
    let master_port = env_value(&env, "MASTER_PORT");
    assert_eq!(service_port("store"), master_port);
    assert!(container_ports.iter().any(|p| p == master_port));
    let args: Vec<&str> = worker["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("a string"))
        .collect();
    assert_eq!(args.first(), Some(&"worker"), "{args:?}");
    let rpc = service_port("rpc");
    assert!(
        args.contains(&format!("--listen=$(POD_IP):{rpc}").as_str()),
        "{args:?}"
    );
    assert!(container_ports.contains(&rpc));
    // The image's entrypoint runs the worker (no command of its own), as
    // the image's user.
    assert!(worker.get("command").is_none(), "{worker}");
    let containerfile = read(&deploy("Containerfile"));
    let uid = pod["securityContext"]["runAsUser"].to_string();
    assert!(
        containerfile.contains(&format!("USER {uid}:")),
        "runAsUser {uid} is not the image's user"
    );
}

/// Kubernetes' `$(VAR)` references to the container's environment.
fn expand(arg: &str, env: &[(String, String)]) -> String {
    env.iter().fold(arg.to_string(), |a, (k, v)| {
        a.replace(&format!("$({k})"), v)
    })
}

/// `s` with each of the pod's paths replaced by where it is here.
fn mapped(s: &str, paths: &[(String, PathBuf)]) -> String {
    paths.iter().fold(s.to_string(), |s, (from, to)| {
        s.replace(from.as_str(), to.to_str().expect("UTF-8 path"))
    })
}

#[test]
fn the_kubernetes_job_runs_here_as_a_kubelet_would_run_its_pods() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bundle = bundle(dir.path());
    let job = manifest(&deploy("kubernetes/job.yaml"));
    let pod = &job["spec"]["template"]["spec"];
    let pods = job["spec"]["completions"].as_u64().expect("completions") as usize;

    // The Secret, as README.md makes it: a CA, one certificate per worker.
    let path = |p: &Path| p.to_str().expect("UTF-8").to_string();
    let (ca, secret) = (dir.path().join("ca"), dir.path().join("secret"));
    let out = wasmrpc(
        &["cert", "init", "--out", &path(&ca)],
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{:?}", text(&out));
    for n in 0..pods {
        let out = wasmrpc(
            &[
                "cert",
                "issue",
                &format!("worker{n}"),
                "--ca",
                &path(&ca),
                "--out",
                &path(&secret),
            ],
            Duration::from_secs(30),
        );
        assert!(out.status.success(), "{:?}", text(&out));
    }
    std::fs::copy(ca.join("ca.pem"), secret.join("ca.pem")).expect("ca.pem");
    // Mounted with the pod's fsGroup, the Secret's files are readable by
    // the group (defaultMode 0440): a worker refuses such a key as it is.
    let mode = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find_map(|v| v["secret"]["defaultMode"].as_u64())
        .expect("the Secret's defaultMode") as u32;
    {
        use std::os::unix::fs::PermissionsExt;
        for file in std::fs::read_dir(&secret)
            .expect("the secret")
            .map(|e| e.expect("entry").path())
        {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).expect("chmod");
        }
    }
    let direct = wasmrpc(
        &[
            "worker",
            "--rank",
            "0",
            "--world-size",
            "1",
            "--init-method",
            &format!("file://{}", path(&dir.path().join("direct-store"))),
            "--tls-ca",
            &path(&secret.join("ca.pem")),
            "--tls-cert",
            &path(&secret.join("worker0.pem")),
            "--tls-key",
            &path(&secret.join("worker0.key")),
        ],
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&direct);
    assert!(!direct.status.success());
    assert!(
        stderr.contains("worker0.key is accessible to group or others (mode 440)"),
        "{stderr}"
    );

    // Each pod: its volumes (emptyDirs of its own, the Secret), the bundle
    // at /opt/wasmrpc.
    let master_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("address").port().to_string()
    };
    let mut workers = Vec::new();
    for index in 0..pods {
        let pod_dir = dir.path().join(format!("pod{index}"));
        let mut volumes: BTreeMap<String, PathBuf> = BTreeMap::new();
        for volume in pod["volumes"].as_array().expect("volumes") {
            let name = volume["name"].as_str().expect("volume name");
            let host = if volume.get("secret").is_some() {
                secret.clone()
            } else {
                assert!(volume.get("emptyDir").is_some(), "{volume}");
                pod_dir.join(name)
            };
            std::fs::create_dir_all(&host).expect("volume");
            volumes.insert(name.to_string(), host);
        }
        let paths = |container: &serde_json::Value| {
            let mut paths: Vec<(String, PathBuf)> = container["volumeMounts"]
                .as_array()
                .expect("mounts")
                .iter()
                .map(|m| {
                    let name = m["name"].as_str().expect("mount name");
                    (
                        m["mountPath"].as_str().expect("mountPath").to_string(),
                        volumes[name].clone(),
                    )
                })
                .collect();
            paths.push(("/opt/wasmrpc".to_string(), bundle.clone()));
            paths
        };

        // The init container: its script, as `sh -c` in the image.
        let init = &pod["initContainers"][0];
        let init_paths = paths(init);
        let mut argv: Vec<String> = init["command"]
            .as_array()
            .expect("command")
            .iter()
            .chain(init["args"].as_array().expect("args"))
            .map(|a| a.as_str().expect("a string").to_string())
            .collect();
        assert_eq!(argv[0], "/bin/sh");
        argv[0] = "sh".to_string();
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .env("PATH", "/usr/bin:/bin");
        for (name, value) in container_env(init, index) {
            cmd.env(name, mapped(&value, &init_paths));
        }
        let out = run_with_deadline(&mut cmd, Duration::from_secs(10));
        assert!(
            out.status.success(),
            "pod {index}'s init container: {:?}",
            text(&out)
        );
        let tls = &volumes["tls"];
        let mut copied: Vec<String> = std::fs::read_dir(tls)
            .expect("the tls volume")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        copied.sort();
        assert_eq!(
            copied,
            [
                "ca.pem".to_string(),
                format!("worker{index}.key"),
                format!("worker{index}.pem")
            ]
        );

        // The worker container: the image's entrypoint with its args.
        let container = &pod["containers"][0];
        let worker_paths = paths(container);
        let mut env = container_env(container, index);
        for (name, value) in &mut env {
            match name.as_str() {
                // The stand-ins for the cluster's DNS and for the pods'
                // own network namespaces (here all pods share one).
                "MASTER_ADDR" => *value = "127.0.0.1".to_string(),
                "MASTER_PORT" => value.clone_from(&master_port),
                _ => {}
            }
        }
        let mut args: Vec<String> = container["args"]
            .as_array()
            .expect("args")
            .iter()
            .map(|a| mapped(&expand(a.as_str().expect("a string"), &env), &worker_paths))
            .collect();
        for arg in &mut args {
            if arg.starts_with("--listen=127.0.0.1:") {
                *arg = "--listen=127.0.0.1:0".to_string();
            }
        }
        // One epoch instead of the demo's 10: the run, not the training, is
        // what is checked.
        let epochs = args.last_mut().expect("the entry's arguments");
        assert_eq!(epochs, "10", "the demo's epochs");
        *epochs = "1".to_string();
        let mut cmd = Command::new(bundle.join("bin/wasmrpc"));
        cmd.args(&args);
        for var in CREDENTIAL_ENV {
            cmd.env_remove(var);
        }
        cmd.envs(env);
        workers.push(std::thread::spawn(move || {
            run_with_deadline(&mut cmd, Duration::from_secs(90))
        }));
    }
    for (index, worker) in workers.into_iter().enumerate() {
        let out = worker.join().expect("a pod's thread");
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "pod {index}:\n{stdout}\n{stderr}");
        assert!(
            stderr.contains("connections: TLS 1.3 with mutual authentication"),
            "pod {index}:\n{stderr}"
        );
        assert!(
            stderr.contains(&format!("worker{index}: shut down")),
            "pod {index}:\n{stderr}"
        );
        if index == 0 {
            assert!(
                stdout.contains("param_server::run returned"),
                "pod 0:\n{stdout}\n{stderr}"
            );
            assert!(stdout.contains("accuracy"), "pod 0:\n{stdout}");
        }
    }
    // worker0 saved its checkpoint in the volume granted at /ckpt.
    assert!(
        checkpointed_step(&dir.path().join("pod0/ckpt")).is_some(),
        "no checkpoint in pod 0's ckpt volume"
    );
}

#[test]
fn the_kubernetes_init_container_names_a_certificate_the_secret_lacks() {
    let job = manifest(&deploy("kubernetes/job.yaml"));
    let init = &job["spec"]["template"]["spec"]["initContainers"][0];
    let script = init["args"][0].as_str().expect("the script");
    let dir = tempfile::tempdir().expect("temp dir");
    let (secret, tls) = (dir.path().join("secret"), dir.path().join("tls"));
    std::fs::create_dir_all(&secret).expect("secret");
    std::fs::create_dir_all(&tls).expect("tls");
    std::fs::write(secret.join("ca.pem"), "a CA").expect("ca.pem");
    let mut cmd = Command::new("sh");
    cmd.args(["-c", script])
        .env("RANK", "5")
        .env("TLS_SECRET_DIR", &secret)
        .env("TLS_DIR", &tls);
    let out = run_with_deadline(&mut cmd, Duration::from_secs(10));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "the Secret wasmrpc-tls has no worker5.pem: issue it with 'wasmrpc cert issue worker5'"
        ),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(&tls).expect("tls").count(), 0);
}

// ---------------------------------------------------------------------------
// Slurm

/// A faked Slurm on one host: `srun` runs `SLURM_NTASKS` copies of its
/// command at once (after its own options), each with `SLURM_PROCID` and
/// `SLURMD_NODENAME=localhost`, fails if any fails and, given
/// `--kill-on-bad-exit=1`, then ends the others (as Slurm does); `scontrol
/// show hostnames` prints `localhost`.
fn fake_slurm(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("fake-slurm");
    std::fs::create_dir_all(&bin).expect("fake-slurm");
    for (name, script) in [
        (
            "srun",
            r#"#!/usr/bin/env bash
kill_on_bad_exit=0
while [[ $# -gt 0 && $1 == --* ]]; do
    [[ $1 == --kill-on-bad-exit=1 ]] && kill_on_bad_exit=1
    shift
done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURMD_NODENAME=localhost "$@" &
    pids+=($!)
done
status=0
for ((i = 0; i < SLURM_NTASKS; i++)); do
    if ! wait -n; then
        status=1
        if ((kill_on_bad_exit)); then kill "${pids[@]}" 2>/dev/null; fi
    fi
done
exit $status
"#,
        ),
        (
            "scontrol",
            r#"#!/bin/sh
if [ "$1 $2" != "show hostnames" ]; then
    echo "fake scontrol: only 'show hostnames' is faked" >&2
    exit 1
fi
echo localhost
"#,
        ),
    ] {
        let path = bin.join(name);
        std::fs::write(&path, script).expect("fake command");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    bin
}

/// `bash wasmrpc.sbatch` in a faked allocation of 3 tasks on this host,
/// submitted from `dir`, with `vars` on top (`{bundle}` in a value is the
/// stand-in bundle's folder).
fn sbatch(dir: &Path, vars: &[(&str, &str)]) -> Output {
    let bundle = bundle(dir);
    let path = format!(
        "{}:{}",
        fake_slurm(dir).display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    let mut cmd = Command::new("bash");
    cmd.arg(deploy("slurm/wasmrpc.sbatch"))
        .current_dir(dir)
        .env("PATH", path)
        .env("RUST_LOG", "info")
        .env("SLURM_NTASKS", "3")
        .env("SLURM_JOB_NODELIST", "localhost")
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_SUBMIT_DIR", dir)
        .env("SLURM_CPUS_PER_TASK", "1")
        .env("WASMRPC_HOME", &bundle)
        .env("MASTER_PORT", port);
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    for (name, value) in vars {
        cmd.env(
            name,
            value.replace("{bundle}", bundle.to_str().expect("UTF-8")),
        );
    }
    run_with_deadline(&mut cmd, Duration::from_secs(90))
}

/// The seed-fns plugin in the stand-in bundle.
const SEED_FNS_IN_BUNDLE: &str = "{bundle}/share/wasmrpc/plugins/seed_fns.wasm";

#[test]
fn the_slurm_script_runs_a_worker_per_task_and_the_entry_on_rank_0() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = sbatch(
        dir.path(),
        &[
            ("WASMRPC_PLUGINS", SEED_FNS_IN_BUNDLE),
            ("WASMRPC_ENTRY", "seed_fns::nested_udf"),
            // worker0 calls my_function(10, 1, 2) on worker2.
            ("WASMRPC_ENTRY_ARGS", "worker2 10"),
            ("WASMRPC_GRANTS", ""),
        ],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("seed_fns::nested_udf returned Int(13)"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("3 workers, store at localhost:"),
        "{stdout}"
    );
    for rank in 0..3 {
        assert!(
            stderr.contains(&format!(
                "worker{rank}: rank {rank} of 3 workers, serving on 127.0.0.1:"
            )),
            "worker{rank}:\n{stderr}"
        );
        assert!(
            stderr.contains(&format!("worker{rank}: shut down")),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains("connections: TLS 1.3 with mutual authentication"),
        "{stderr}"
    );
    assert!(
        stderr.contains("1 op thread(s)"),
        "SLURM_CPUS_PER_TASK did not set the op threads:\n{stderr}"
    );
    let work = dir.path().join("wasmrpc-4242");
    assert_eq!(read(&work.join("result.json")).trim(), "13");
    assert!(!work.join("tls/ca.key").exists(), "the CA's key was kept");
    assert!(work.join("tls/worker2.key").exists());
}

#[test]
fn the_slurm_script_fails_when_the_entry_fails_and_refuses_to_run_outside_slurm() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = sbatch(
        dir.path(),
        &[
            ("WASMRPC_PLUGINS", SEED_FNS_IN_BUNDLE),
            ("WASMRPC_ENTRY", "seed_fns::no_such_function"),
            ("WASMRPC_ENTRY_ARGS", ""),
            ("WASMRPC_GRANTS", ""),
        ],
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("worker0: entry seed_fns::no_such_function on worker0 failed"),
        "{stderr}"
    );
    assert!(!stdout.contains("wasmrpc.sbatch: done"), "{stdout}");

    let mut outside = Command::new("bash");
    outside
        .arg(deploy("slurm/wasmrpc.sbatch"))
        .env_remove("SLURM_NTASKS")
        .env_remove("SLURM_JOB_NODELIST")
        .env_remove("SLURM_JOB_ID");
    let out = run_with_deadline(&mut outside, Duration::from_secs(10));
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("wasmrpc.sbatch: not inside a Slurm allocation"),
        "{stderr}"
    );

    let elsewhere = tempfile::tempdir().expect("temp dir");
    let no_bundle = sbatch(
        elsewhere.path(),
        &[("WASMRPC_HOME", "/nonexistent/wasmrpc")],
    );
    let (_, stderr) = text(&no_bundle);
    assert_eq!(no_bundle.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "no wasmrpc binary at /nonexistent/wasmrpc/bin/wasmrpc: set WASMRPC_HOME to the \
             unpacked release bundle"
        ),
        "{stderr}"
    );
}
