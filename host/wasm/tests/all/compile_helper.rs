//! CACHE-3: compiling a plugin missing from the cache in a helper process,
//! and what a helper that misbehaves costs (a compile in process, never a
//! wrong plugin or a lost error).
//!
//! The helpers here are `sh` scripts, so each test controls exactly what
//! the helper does; `$1`..`$4` are the runtime's `--kind KIND --out PATH`.
//! The real helper (`wasmrpc compile-plugin-entry`) is the `wasmrpc`
//! binary's and is tested with it.

use crate::{args, config, fake::FakeHost, timed};
use std::path::{Path, PathBuf};
use std::time::Duration;
use wasmrpc_wasm::{
    CodeKind, CompileHelper, Config, Error, INVALID_WASM_EXIT, LoadSource, Runtime, Value,
    compile_entry,
};

/// A helper that runs `script` with `sh`.
fn sh_helper(script: &str) -> CompileHelper {
    CompileHelper {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into(), "helper".into()],
        timeout: Duration::from_secs(60),
    }
}

fn runtime(cache: &Path, helper: Option<CompileHelper>) -> Runtime {
    Runtime::new(Config {
        cache_dir: Some(cache.to_owned()),
        compile_helper: helper,
        ..config()
    })
    .unwrap()
}

/// The cache's entries (not their lock files).
fn entries(cache: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cache)
        .map(|d| {
            d.map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
                .collect()
        })
        .unwrap_or_default()
}

/// Loads seed-fns with `runtime` and calls `my_function(1, 2, 3)`.
async fn load_and_call(runtime: &Runtime) -> LoadSource {
    let plugin = runtime.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
    let host = FakeHost::new();
    let six = runtime
        .call(
            &plugin,
            "my_function",
            args(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
            host.arc(),
        )
        .await
        .unwrap();
    assert_eq!(six, Value::Int(6));
    plugin.source()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_missing_from_the_cache_is_compiled_by_the_helper_and_mapped() {
    timed(async {
        let work = tempfile::tempdir().unwrap();
        let cache = work.path().join("cache");
        let bytes = std::fs::read(wasmrpc_plugins::SEED_FNS).unwrap();
        // What the real helper would write, made by its body.
        let precompiled = work.path().join("precompiled.cwasm");
        compile_entry(CodeKind::Module, bytes.as_slice(), &precompiled).unwrap();
        let helper = sh_helper(&format!(
            "cat > '{dir}/input'; echo \"$@\" > '{dir}/args'; cp '{dir}/precompiled.cwasm' \"$4\"",
            dir = work.path().display()
        ));

        let rt = runtime(&cache, Some(helper));
        assert_eq!(load_and_call(&rt).await, LoadSource::Compiled);
        // The helper got the plugin's bytes and the entry's path, and the
        // runtime runs from the entry it wrote (CACHE-1).
        let [entry] = entries(&cache).try_into().expect("one entry");
        assert_eq!(std::fs::read(work.path().join("input")).unwrap(), bytes);
        assert_eq!(
            std::fs::read_to_string(work.path().join("args")).unwrap(),
            format!("--kind module --out {}\n", entry.display())
        );
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(
            maps.contains(entry.to_str().unwrap()),
            "the entry is not mapped"
        );

        // The next runtime finds the entry.
        assert_eq!(
            load_and_call(&runtime(&cache, None)).await,
            LoadSource::DiskCache
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_that_fails_costs_a_compile_in_process_and_a_good_entry() {
    timed(async {
        for (what, script) in [
            (
                "exits 1",
                "cat > /dev/null; echo 'out of memory' >&2; exit 1",
            ),
            ("is killed", "cat > /dev/null; kill -9 $$"),
            ("writes nothing", "cat > /dev/null"),
            (
                "writes garbage",
                "cat > /dev/null; echo 'not a module' > \"$4\"",
            ),
            (
                "writes wasm instead of compiled code",
                "cat > /dev/null; printf '\\0asm\\1\\0\\0\\0' > \"$4\"",
            ),
            ("does not read its input", "echo 'not a module' > \"$4\""),
        ] {
            let work = tempfile::tempdir().unwrap();
            let rt = runtime(work.path(), Some(sh_helper(script)));
            assert_eq!(load_and_call(&rt).await, LoadSource::Compiled, "{what}");
            assert_eq!(
                load_and_call(&runtime(work.path(), None)).await,
                LoadSource::DiskCache,
                "a helper that {what} left no good entry"
            );
        }
        // A helper that cannot start.
        let work = tempfile::tempdir().unwrap();
        let missing = CompileHelper {
            program: work.path().join("no-such-helper"),
            args: Vec::new(),
            timeout: Duration::from_secs(60),
        };
        let rt = runtime(work.path(), Some(missing));
        assert_eq!(load_and_call(&rt).await, LoadSource::Compiled);
        // A helper that hangs is killed at its timeout.
        let work = tempfile::tempdir().unwrap();
        let hanging = CompileHelper {
            timeout: Duration::from_millis(500),
            ..sh_helper("cat > /dev/null; exec sleep 60")
        };
        let started = std::time::Instant::now();
        let rt = runtime(work.path(), Some(hanging));
        assert_eq!(load_and_call(&rt).await, LoadSource::Compiled);
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the hanging helper was waited for ({:?})",
            started.elapsed()
        );
        assert_eq!(
            load_and_call(&runtime(work.path(), None)).await,
            LoadSource::DiskCache
        );
    })
    .await;
}

#[test]
fn a_helper_that_refuses_the_bytes_gives_its_message_as_the_load_error() {
    let work = tempfile::tempdir().unwrap();
    let script = format!(
        "cat > /dev/null; echo 'failed to parse WebAssembly module' >&2; exit {INVALID_WASM_EXIT}"
    );
    let rt = runtime(work.path(), Some(sh_helper(&script)));
    match rt.load_file(wasmrpc_plugins::SEED_FNS) {
        Err(Error::InvalidModule(message)) => {
            assert_eq!(message, "failed to parse WebAssembly module");
        }
        other => panic!("expected the helper's refusal, got {:?}", other.map(|_| ())),
    }
    assert!(
        entries(work.path()).is_empty(),
        "a refused plugin left an entry"
    );
}

#[test]
fn the_helpers_body_refuses_bytes_that_do_not_compile_and_unknown_kinds() {
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("entry.cwasm");
    for kind in [CodeKind::Module, CodeKind::Component] {
        match compile_entry(kind, &b"\0asm\x01\0\0\0\x01"[..], &out) {
            Err(Error::InvalidModule(message)) => assert!(!message.is_empty()),
            other => panic!("{kind:?}: expected InvalidModule, got {other:?}"),
        }
        assert!(
            !out.exists(),
            "{kind:?}: bytes that do not compile left an entry"
        );
    }
    // A core module is not a component.
    assert!(matches!(
        compile_entry(CodeKind::Component, &b"\0asm\x01\0\0\0"[..], &out),
        Err(Error::InvalidModule(_))
    ));
    assert_eq!(CodeKind::from_flag("module").unwrap(), CodeKind::Module);
    assert_eq!(
        CodeKind::from_flag("component").unwrap(),
        CodeKind::Component
    );
    let e = CodeKind::from_flag("Module").unwrap_err();
    assert!(
        e.to_string().contains("expected module or component"),
        "{e}"
    );
    assert_eq!(
        wasmrpc_wasm::helper_main("core", &out),
        std::process::ExitCode::from(1)
    );
    assert!(!out.exists());
}

/// A helper `sh` script that records its arguments in `dir/args` (one line
/// per run) and the mode of the folder it is told to write in, in
/// `dir/modes`, then writes `dir/precompiled.cwasm` (the real helper's
/// output for seed-fns) where it is told to.
fn recording_helper(dir: &Path) -> CompileHelper {
    let bytes = std::fs::read(wasmrpc_plugins::SEED_FNS).unwrap();
    compile_entry(
        CodeKind::Module,
        bytes.as_slice(),
        &dir.join("precompiled.cwasm"),
    )
    .unwrap();
    sh_helper(&format!(
        "cat > /dev/null; echo \"$@\" >> '{dir}/args'; stat -c %a \"$(dirname \"$4\")\" >> '{dir}/modes'; \
         cp '{dir}/precompiled.cwasm' \"$4\"",
        dir = dir.display()
    ))
}

/// The `--out` paths the recording helper was given, run by run.
fn outs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string(dir.join("args"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let out = l.strip_prefix("--kind module --out ").expect(l);
            PathBuf::from(out)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cache_folder_the_helper_compiles_into_a_scratch_file_removed_once_mapped() {
    timed(async {
        let work = tempfile::tempdir().unwrap();
        let rt = Runtime::new(Config {
            cache_dir: None,
            compile_helper: Some(recording_helper(work.path())),
            ..config()
        })
        .unwrap();
        assert_eq!(load_and_call(&rt).await, LoadSource::Compiled);
        // CACHE-4: the helper wrote into a folder of this process's own in
        // the temporary folder, readable by this user alone; the runtime
        // maps the file and has removed it and its folder.
        let [out] = outs(work.path()).try_into().expect("one run of the helper");
        let folder = out.parent().unwrap();
        assert_eq!(folder.parent().unwrap(), std::env::temp_dir());
        assert!(
            folder
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("wasmrpc-code-"),
            "{}",
            out.display()
        );
        assert_eq!(
            std::fs::read_to_string(work.path().join("modes")).unwrap(),
            "700\n"
        );
        assert!(
            !folder.exists(),
            "the scratch folder {} is left",
            folder.display()
        );
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(
            maps.contains(&format!("{} (deleted)", out.display())),
            "the code does not run from the scratch file"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_folder_that_cannot_be_written_costs_one_compile_per_load_and_no_entry() {
    timed(async {
        let work = tempfile::tempdir().unwrap();
        // A folder under a file: nothing can be made there, by root either.
        std::fs::write(work.path().join("file"), b"").unwrap();
        let cache = work.path().join("file").join("cache");
        let helper = recording_helper(work.path());
        for (run, _) in [(), ()].iter().enumerate() {
            let rt = runtime(&cache, Some(helper.clone()));
            assert_eq!(load_and_call(&rt).await, LoadSource::Compiled, "load {run}");
        }
        // Each load ran the helper once, told to write a scratch file, not
        // the entry it could not write (which cost a second compile, in
        // process, before CACHE-4).
        let outs = outs(work.path());
        assert_eq!(outs.len(), 2, "{outs:?}");
        for out in &outs {
            assert!(!out.starts_with(work.path()), "{}", out.display());
            assert!(!out.exists(), "{} is left", out.display());
        }
        // Without a helper, the load compiles in process, once.
        assert_eq!(
            load_and_call(&runtime(&cache, None)).await,
            LoadSource::Compiled
        );
    })
    .await;
}

/// A `noexec` tmpfs mounted at a folder for as long as it lives.
struct NoexecMount(PathBuf);

impl NoexecMount {
    /// Mounts one at `dir`; `None` where this process may not mount.
    fn at(dir: &Path) -> Option<NoexecMount> {
        std::fs::create_dir_all(dir).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "noexec,size=64m", "tmpfs"])
            .arg(dir)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        mounted.then(|| NoexecMount(dir.to_owned()))
    }
}

impl Drop for NoexecMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_in_a_folder_that_forbids_executable_mappings_is_read_not_compiled_again() {
    timed(async {
        let work = tempfile::tempdir().unwrap();
        let Some(mount) = NoexecMount::at(&work.path().join("noexec")) else {
            println!("wasmrpc-skip: needs root to mount a noexec tmpfs");
            return;
        };
        let cache = mount.0.join("cache");
        // Compiled (in process, then by the helper), written to the entry,
        // which cannot be mapped executable there: the code is read.
        assert_eq!(
            load_and_call(&runtime(&cache, None)).await,
            LoadSource::Compiled
        );
        // The next load reads the entry instead of compiling again, as it
        // did while entries there were ignored.
        assert_eq!(
            load_and_call(&runtime(&cache, None)).await,
            LoadSource::DiskCache
        );
        // A helper's entry is read too: one compile, by the helper.
        std::fs::remove_dir_all(&cache).unwrap();
        let helped = work.path().join("helped");
        std::fs::create_dir(&helped).unwrap();
        let rt = runtime(&cache, Some(recording_helper(&helped)));
        assert_eq!(load_and_call(&rt).await, LoadSource::Compiled);
        assert_eq!(outs(&helped).len(), 1);
        assert_eq!(
            load_and_call(&runtime(&cache, None)).await,
            LoadSource::DiskCache
        );
    })
    .await;
}
