//! What an idle `wasmrpc worker` process costs (issue 52): on a machine
//! without a GPU it maps none of CUDA's libraries and stays within
//! [`IDLE_RSS_LIMIT_KIB`] resident, in a CUDA build too, because libtorch's
//! CUDA side is loaded only where a device can use it
//! (`wasmrpc_torch_sys::cuda`); forced with `WASMRPC_LOAD_CUDA=1`, the
//! worker loads it and says so. On a GPU machine the worker loads CUDA by
//! itself, which the first test then checks instead of the limit. The
//! tests of a worker that compiles its plugins also check where the
//! compiled code goes (CACHE-3, CACHE-4).

use std::process::Command;

mod common;

use common::{CREDENTIAL_ENV, ServingProcess};

/// The most an idle worker without CUDA may hold resident: a CPU-only
/// build idles at about 128 MiB; a CUDA build that linked libtorch_cuda.so
/// into every process idled at 715 MiB.
const IDLE_RSS_LIMIT_KIB: u64 = 150 * 1024;

/// What a worker prints once it has joined and serves.
const SERVING: &str = "serving until interrupted";

/// CUDA's libraries, any of which an idle worker without a GPU must not map.
const CUDA_LIBRARIES: [&str; 4] = [
    "/libtorch_cuda.so",
    "/libc10_cuda.so",
    "/libcudnn",
    "/libnccl",
];

/// Starts a one-worker dynamic group that serves until dropped, with
/// `WASMRPC_LOAD_CUDA` set to `load` (or unset), and waits until it serves.
fn idle_worker(dir: &std::path::Path, load: Option<&str>) -> ServingProcess {
    idle_worker_with(dir, load, |_| {})
}

/// [`idle_worker`], its command changed by `configure` first.
fn idle_worker_with(
    dir: &std::path::Path,
    load: Option<&str>,
    configure: impl FnOnce(&mut Command),
) -> ServingProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    match load {
        Some(v) => cmd.env("WASMRPC_LOAD_CUDA", v),
        None => cmd.env_remove("WASMRPC_LOAD_CUDA"),
    };
    let url = format!("file://{}", dir.join("store").display());
    cmd.args(["worker", "--rank", "0", "--init-method", &url, "--serve"])
        .env("RUST_LOG", "info");
    configure(&mut cmd);
    let mut worker = ServingProcess::start("worker0", cmd);
    worker.wait_for(SERVING);
    worker
}

/// `VmRSS` of process `pid`, in KiB.
fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in:\n{status}"))
}

fn maps(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("its mappings")
}

/// A folder in `dir` holding the seed-fns plugin, for `--plugins`.
fn seed_plugin_folder(dir: &std::path::Path) -> std::path::PathBuf {
    let plugins = dir.join("plugins");
    std::fs::create_dir(&plugins).expect("plugin folder");
    std::fs::copy(wasmrpc_plugins::SEED_FNS, plugins.join("seed_fns.wasm")).expect("copy");
    plugins
}

/// Checks that `worker`, which compiled its plugin as `what` says, runs
/// from a file whose mapping `runs_from` recognises (a line of its
/// `/proc/PID/maps`), and that it idles within the limit where it loaded
/// no CUDA.
fn assert_runs_from_and_idles_small(
    worker: &ServingProcess,
    what: &str,
    runs_from: impl Fn(&str) -> bool,
) {
    let (rss, maps) = (resident_kib(worker.pid()), maps(worker.pid()));
    assert!(
        maps.lines().any(runs_from),
        "the worker does not run from the file its code was written to:\n{maps}"
    );
    println!("idle worker that {what}: VmRSS {rss} KiB");
    if !worker.output().contains("CUDA loaded (") {
        assert!(
            rss <= IDLE_RSS_LIMIT_KIB,
            "a worker that {what} holds {rss} KiB resident, more than {IDLE_RSS_LIMIT_KIB} KiB"
        );
    }
}

#[test]
fn an_idle_worker_without_a_gpu_maps_no_cuda_and_stays_small() {
    let dir = tempfile::tempdir().expect("temp dir");
    let worker = idle_worker(dir.path(), None);
    // A moment for the start-up's transient allocations to be given back.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let output = worker.output();
    let (rss, maps) = (resident_kib(worker.pid()), maps(worker.pid()));
    if output.contains("CUDA loaded (") {
        // A GPU machine: the worker must see its devices, so CUDA is in.
        assert!(output.contains("CUDA device(s) present"), "{output}");
        assert!(maps.contains("/libtorch_cuda.so"), "{maps}");
        println!("wasmrpc-skip: the idle-memory limit holds on machines without a GPU");
        return;
    }
    assert!(output.contains("CUDA not loaded: "), "{output}");
    for lib in CUDA_LIBRARIES {
        assert!(!maps.contains(lib), "an idle worker maps {lib}:\n{maps}");
    }
    println!("idle worker: VmRSS {rss} KiB");
    assert!(
        rss <= IDLE_RSS_LIMIT_KIB,
        "an idle worker holds {rss} KiB resident, more than {IDLE_RSS_LIMIT_KIB} KiB"
    );
}

/// CACHE-3: a worker that finds its plugin missing from the module cache
/// has this binary compile it in a helper process (`wasmrpc
/// compile-plugin-entry`), then runs from the entry the helper wrote, and
/// idles within the limit of a worker without plugins: what the compile
/// left resident went with the helper.
#[test]
fn a_worker_compiles_a_plugin_missing_from_the_cache_in_a_helper_process() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (plugins, cache) = (seed_plugin_folder(dir.path()), dir.path().join("cache"));
    let worker = idle_worker_with(dir.path(), None, |cmd| {
        cmd.arg("--plugins")
            .arg(&plugins)
            .env("WASMRPC_CACHE_DIR", &cache);
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    let output = worker.output();
    assert!(
        output.contains("compiled plugin `wasmrpc-plugin-seed-fns` in a helper process in "),
        "{output}"
    );
    let entries: Vec<_> = std::fs::read_dir(&cache)
        .expect("the cache folder")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .collect();
    let [entry] = entries.as_slice() else {
        panic!("expected one entry in the cache: {entries:?}");
    };
    let entry = entry.to_str().expect("a UTF-8 path");
    assert_runs_from_and_idles_small(&worker, "had its plugin compiled", |l| l.contains(entry));
}

/// CACHE-4: a worker whose module cache folder cannot be written (here a
/// folder under a file) has its helper compile the plugin into a scratch
/// file of its own in `$TMPDIR`, runs from it, removes it, and idles
/// within the same limit.
#[test]
fn a_worker_without_a_writable_cache_folder_runs_from_a_removed_scratch_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (plugins, tmp) = (seed_plugin_folder(dir.path()), dir.path().join("tmp"));
    std::fs::create_dir(&tmp).expect("temporary folder");
    std::fs::write(dir.path().join("file"), b"").expect("a file");
    // Scratch folders of earlier processes: one whose process ended (no
    // PID reaches 999999999), one of a live process (this test's), one not
    // named by a process, one whose live process id has a leading zero,
    // and a link named as one, to a folder elsewhere.
    let target = dir.path().join("elsewhere");
    std::fs::create_dir(&target).expect("a folder");
    std::fs::write(target.join("keep"), b"").expect("a file");
    let ended = tmp.join("wasmrpc-code-999999999-abc");
    let live = tmp.join(format!("wasmrpc-code-{}-abc", std::process::id()));
    let unnamed = tmp.join("wasmrpc-code-abc");
    let link = tmp.join("wasmrpc-code-999999998-abc");
    // This test's live process, spelled so `/proc` has no such entry.
    let padded = tmp.join(format!("wasmrpc-code-0{}-abc", std::process::id()));
    for d in [&ended, &live, &unnamed, &padded] {
        std::fs::create_dir(d).expect("a folder");
        std::fs::write(d.join("code.cwasm"), b"compiled").expect("a file");
    }
    std::os::unix::fs::symlink(&target, &link).expect("a link");
    // An ended process's folder of another user, where this test may give
    // one away (as root): not the worker's to remove.
    let foreign = tmp.join("wasmrpc-code-999999997-abc");
    std::fs::create_dir(&foreign).expect("a folder");
    let given_away = std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).is_ok();
    if !given_away {
        std::fs::remove_dir(&foreign).expect("remove");
    }
    let worker = idle_worker_with(dir.path(), None, |cmd| {
        cmd.arg("--plugins")
            .arg(&plugins)
            .env("WASMRPC_CACHE_DIR", dir.path().join("file").join("cache"))
            .env("TMPDIR", &tmp);
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    let output = worker.output();
    assert!(
        output.contains("cannot be written: compiling plugin"),
        "{output}"
    );
    assert!(
        output.contains("compiled plugin `wasmrpc-plugin-seed-fns` in a helper process in "),
        "{output}"
    );
    // Its own folder is gone, and of the others only the ended process's.
    let mut left: Vec<_> = std::fs::read_dir(&tmp)
        .expect("tmp")
        .map(|e| e.expect("an entry").path())
        .collect();
    left.sort();
    let mut kept = vec![live, unnamed, link, padded];
    if given_away {
        kept.push(foreign);
    }
    kept.sort();
    assert_eq!(left, kept);
    assert!(target.join("keep").exists(), "the link was followed");
    assert!(
        output.contains("left by process 999999999, which ended"),
        "{output}"
    );
    let scratch = format!("{}/wasmrpc-code-", tmp.display());
    assert_runs_from_and_idles_small(&worker, "compiled without a cache", |l| {
        l.contains(&scratch) && l.ends_with("/code.cwasm (deleted)")
    });
}

/// An empty `WASMRPC_CACHE_DIR` counts as unset: the entry goes to the
/// next folder in line (`$XDG_CACHE_HOME/wasmrpc/modules`), not to the
/// worker's current folder, where an empty path would put it.
#[test]
fn an_empty_cache_variable_counts_as_unset() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (plugins, cwd, xdg) = (
        seed_plugin_folder(dir.path()),
        dir.path().join("cwd"),
        dir.path().join("xdg"),
    );
    std::fs::create_dir(&cwd).expect("a folder");
    let worker = idle_worker_with(dir.path(), None, |cmd| {
        cmd.arg("--plugins")
            .arg(&plugins)
            .current_dir(&cwd)
            .env("WASMRPC_CACHE_DIR", "")
            .env("XDG_CACHE_HOME", &xdg);
    });
    let cwasm = |d: &std::path::Path| -> usize {
        std::fs::read_dir(d).map_or(0, |l| {
            l.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "cwasm"))
            })
            .count()
        })
    };
    assert_eq!(
        cwasm(&xdg.join("wasmrpc").join("modules")),
        1,
        "{}",
        worker.output()
    );
    assert_eq!(cwasm(&cwd), 0, "an entry in the current folder");
}

#[test]
fn a_worker_told_to_load_cuda_loads_it_without_a_gpu() {
    let dir = tempfile::tempdir().expect("temp dir");
    if !cuda_build() {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
        let url = format!("file://{}", dir.path().join("store").display());
        cmd.args(["worker", "--rank", "0", "--world-size", "1"])
            .args(["--init-method", &url])
            .env("WASMRPC_LOAD_CUDA", "1");
        let out = common::run_with_deadline(&mut cmd, std::time::Duration::from_secs(60));
        let (_, stderr) = common::text(&out);
        assert!(!out.status.success());
        assert!(stderr.contains("built without CUDA"), "{stderr}");
        return;
    }
    let worker = idle_worker(dir.path(), Some("1"));
    let output = worker.output();
    assert!(
        output.contains("CUDA loaded (WASMRPC_LOAD_CUDA=1; CUDA runtime "),
        "{output}"
    );
    assert!(maps(worker.pid()).contains("/libtorch_cuda.so"));
}

/// Whether the binary under test is a CUDA build: the same test as its
/// build script's (a libtorch with `libtorch_cuda.so`, no `WASMRPC_CUDA=0`).
fn cuda_build() -> bool {
    wasmrpc_torch_sys::cuda::BUILT_WITH_CUDA
}
