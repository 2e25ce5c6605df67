//! Loading: manifests, the on-disk cache, identity by content, bad bytes.

use crate::{args, config, fake::FakeHost, timed};
use std::sync::Arc;
use wasmrpc_wasm::manifest::{self, ExportKind};
use wasmrpc_wasm::{Config, Error, LoadSource, Plugin, Runtime, Value};

#[test]
fn the_manifest_lists_every_export_with_its_parameters() {
    let bytes = std::fs::read(wasmrpc_plugins::SEED_FNS).unwrap();
    let m = manifest::read(&bytes).unwrap();
    assert_eq!(m.name, "wasmrpc-plugin-seed-fns");
    assert_eq!(m.version, env!("CARGO_PKG_VERSION"));
    assert!(m.abi_matches());
    let f = m.function("my_function").unwrap();
    assert_eq!(
        (f.kind, f.params.clone()),
        (
            ExportKind::Function,
            vec!["a".into(), "b".into(), "c".into()]
        )
    );
    assert_eq!(
        m.function("async_add").unwrap().kind,
        ExportKind::AsyncFunction
    );
    let ctor = m.constructor("MyClass").unwrap();
    assert_eq!(ctor.params, vec!["a".to_owned(), "delay".to_owned()]);
    assert_eq!(
        m.method("MyClass", "increment_value").unwrap().params,
        vec!["increment".to_owned()]
    );
    assert_eq!(
        m.method("MyClass", "bound_async_add").unwrap().kind,
        ExportKind::AsyncMethod
    );
    assert_eq!(
        m.function("MyClass.my_static_method").unwrap().kind,
        ExportKind::Function
    );
    assert!(m.method("MyClass", "my_static_method").is_none());

    let text = manifest::describe(&m);
    assert!(text.starts_with("wasmrpc-plugin-seed-fns "), "{text}");
    for expected in [
        "  fn my_function(a, b, c)\n",
        "  async fn async_add(to, x, y)\n",
        "  fn MyClass.my_static_method(f)\n",
        "  class MyClass(a, delay)\n    ",
        "    method MyClass.increment_value(increment)\n",
        "    async method MyClass.bound_async_add(to, x, y)\n",
    ] {
        assert!(text.contains(expected), "{expected:?} not in\n{text}");
    }

    let rt = Runtime::new(config()).unwrap();
    let plugin = rt.load(&bytes).unwrap();
    assert_eq!(plugin.manifest(), &m);
    // The manifest survives the abi encoding (what a CLI or a peer would send).
    let round: wasmrpc_abi::manifest::Manifest =
        wasmrpc_abi::decode(&wasmrpc_abi::encode(&m).unwrap()).unwrap();
    assert_eq!(round, m);
}

#[test]
fn loading_the_same_bytes_twice_gives_the_same_plugin() {
    let rt = Runtime::new(config()).unwrap();
    let a = rt.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
    let b = rt.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert!(Arc::ptr_eq(
        &rt.plugin("wasmrpc-plugin-seed-fns").unwrap(),
        &a
    ));
}

/// `my_function(1, 2, 3)` of the seed-fns plugin `plugin`, run by `rt`.
async fn my_function(rt: &Runtime, plugin: &Arc<Plugin>, host: &FakeHost) -> Value {
    rt.call(
        plugin,
        "my_function",
        args(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
        host.arc(),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_cache_is_hit_on_the_second_load() {
    timed(async {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            cache_dir: Some(dir.path().to_owned()),
            ..config()
        };
        let first = Runtime::new(cfg.clone()).unwrap();
        let p1 = first.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
        assert_eq!(p1.source(), LoadSource::Compiled);
        // Beside the module, the lock file under which it was compiled
        // (one compile per machine).
        let entries = || -> Vec<std::path::PathBuf> {
            std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_none_or(|x| x != "lock"))
                .collect()
        };
        assert_eq!(entries().len(), 1, "one compiled module in the cache");
        // CACHE-1: the runtime that compiled runs from the entry it wrote,
        // as later ones do, not from an anonymous copy of its own.
        let maps_entry = || {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            entries()
                .iter()
                .all(|entry| maps.contains(entry.to_str().unwrap()))
        };
        assert!(maps_entry(), "the compiling runtime does not map its entry");

        let second = Runtime::new(cfg).unwrap();
        let p2 = second.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
        assert_eq!(p2.source(), LoadSource::DiskCache);
        assert_eq!(p1.sha256(), p2.sha256());
        let host = FakeHost::new();
        assert_eq!(my_function(&second, &p2, &host).await, Value::Int(6));

        // CACHE-1: the second runtime's code is mapped from the entry.
        // Replacing the entry as the cache does (a whole new file renamed
        // into place) leaves it running.
        for path in entries() {
            let tmp = path.with_extension("replacing");
            std::fs::write(&tmp, b"not a module").unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        }
        assert_eq!(my_function(&second, &p2, &host).await, Value::Int(6));
        assert_eq!(my_function(&first, &p1, &host).await, Value::Int(6));
        drop((p1, p2, first, second));

        // A corrupt cache entry is ignored and rewritten.
        for path in entries() {
            std::fs::write(path, b"not a module").unwrap();
        }
        assert!(!maps_entry(), "an entry is mapped with no runtime left");
        let third = Runtime::new(Config {
            cache_dir: Some(dir.path().to_owned()),
            ..config()
        })
        .unwrap();
        let p3 = third.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
        assert_eq!(p3.source(), LoadSource::Compiled);
        assert!(maps_entry(), "the rewritten entry is not the code run");
        assert_eq!(my_function(&third, &p3, &host).await, Value::Int(6));
    })
    .await;
}

/// An earlier plugin's cache entry (CACHE-2's file name), `mib` MiB, last
/// used `hours_ago`, with its lock file.
fn old_entry(dir: &std::path::Path, n: u64, mib: usize, hours_ago: u64) -> std::path::PathBuf {
    let path = dir.join(format!("{n:064x}-{:016x}.cwasm", 7));
    std::fs::write(&path, vec![0u8; mib << 20]).unwrap();
    std::fs::write(path.with_extension("lock"), b"").unwrap();
    set_used(&path, hours_ago);
    path
}

fn set_used(path: &std::path::Path, hours_ago: u64) {
    let when = std::time::SystemTime::now() - std::time::Duration::from_secs(hours_ago * 3600);
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(when)
        .unwrap();
}

/// The size of `SEED_FNS`'s compiled entry, from a cache of its own.
fn seed_fns_entry_bytes() -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::new(Config {
        cache_dir: Some(dir.path().to_owned()),
        cache_max_bytes: None,
        ..config()
    })
    .unwrap();
    rt.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
    std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum()
}

#[test]
fn the_disk_cache_keeps_within_its_cap_by_removing_the_least_recently_used_entries() {
    let entry = seed_fns_entry_bytes();
    assert!(entry > 0, "the plugin's compiled code was cached");
    let dir = tempfile::tempdir().unwrap();
    // Four earlier plugins, oldest first.
    let old: Vec<_> = (0..4)
        .map(|n| old_entry(dir.path(), n, 1, 40 - n * 10))
        .collect();
    // What is not an entry stays, however old or large: the operator's
    // files, a name that is not an entry's, a folder named as an entry,
    // and a link named as an entry counts as a link, not as its target.
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, vec![1u8; 5 << 20]).unwrap();
    set_used(&notes, 100);
    let odd = dir.path().join(format!("{:064x}.cwasm", 9));
    std::fs::write(&odd, vec![1u8; 1 << 20]).unwrap();
    set_used(&odd, 100);
    let folder = dir.path().join(format!("{:064x}-{:016x}.cwasm", 10, 7));
    std::fs::create_dir(&folder).unwrap();
    let link = dir.path().join(format!("{:064x}-{:016x}.cwasm", 11, 7));
    std::os::unix::fs::symlink(&notes, &link).unwrap();

    // Room for the new entry and two and a half old ones: the two least
    // recently used go, with their lock files.
    let rt = Runtime::new(Config {
        cache_dir: Some(dir.path().to_owned()),
        cache_max_bytes: Some(entry + (5 << 19)),
        ..config()
    })
    .unwrap();
    assert_eq!(
        rt.load_file(wasmrpc_plugins::SEED_FNS).unwrap().source(),
        LoadSource::Compiled
    );
    for (n, path) in old.iter().enumerate() {
        let kept = n >= 2;
        assert_eq!(path.exists(), kept, "entry {n} (kept: {kept})");
        assert_eq!(path.with_extension("lock").exists(), kept, "lock {n}");
    }
    for path in [&notes, &odd, &folder, &link] {
        assert!(
            std::fs::symlink_metadata(path).is_ok(),
            "{} was removed",
            path.display()
        );
    }
    assert_eq!(std::fs::metadata(&notes).unwrap().len(), 5 << 20);

    // A load from the cache marks its entry used: made the oldest, it
    // outlives an entry used since, when the next compile needs room.
    let new_entry = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "cwasm")
                && !old.contains(p)
                && p.is_file()
                && *p != odd
                && *p != link
        })
        .expect("the new entry");
    set_used(&new_entry, 1000);
    let again = Runtime::new(Config {
        cache_dir: Some(dir.path().to_owned()),
        cache_max_bytes: Some(entry + (5 << 19)),
        ..config()
    })
    .unwrap();
    assert_eq!(
        again.load_file(wasmrpc_plugins::SEED_FNS).unwrap().source(),
        LoadSource::DiskCache
    );
    let age = std::fs::metadata(&new_entry)
        .unwrap()
        .modified()
        .unwrap()
        .elapsed()
        .unwrap_or_default();
    assert!(age.as_secs() < 3600, "the entry was last used {age:?} ago");
    // Another plugin compiled under a cap that holds one entry: every
    // other entry goes, the one just used last, and the new one stays
    // (however large it is against the cap).
    let tight = Runtime::new(Config {
        cache_dir: Some(dir.path().to_owned()),
        cache_max_bytes: Some(1),
        ..config()
    })
    .unwrap();
    let hello = tight.load_file(wasmrpc_plugins::HELLO).unwrap();
    assert_eq!(hello.source(), LoadSource::Compiled);
    assert!(!new_entry.exists(), "the older entry stayed over the cap");
    assert!(!old[3].exists() && !old[2].exists());
    let entries: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "cwasm")
                && p.is_file()
                && *p != odd
                && !p.is_symlink()
        })
        .collect();
    assert_eq!(entries.len(), 1, "only the new entry: {entries:?}");

    // Without a cap nothing is removed.
    let unbounded = Runtime::new(Config {
        cache_dir: Some(dir.path().to_owned()),
        cache_max_bytes: None,
        ..config()
    })
    .unwrap();
    unbounded.load_file(wasmrpc_plugins::SEED_FNS).unwrap();
    assert!(entries[0].exists(), "an unbounded cache removed an entry");
}

#[test]
fn load_dir_loads_every_wasm_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(wasmrpc_plugins::SEED_FNS, dir.path().join("seed_fns.wasm")).unwrap();
    std::fs::write(dir.path().join("README.txt"), "not a plugin").unwrap();
    let rt = Runtime::new(config()).unwrap();
    let loaded = rt.load_dir(dir.path()).unwrap();
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].name(), "wasmrpc-plugin-seed-fns");
    assert!(
        wasmrpc_plugins::PLUGINS.contains(&("wasmrpc-plugin-seed-fns", wasmrpc_plugins::SEED_FNS)),
        "{:?}",
        wasmrpc_plugins::PLUGINS
    );
}

#[test]
fn bad_modules_are_errors_and_the_runtime_keeps_working() {
    let rt = Runtime::new(config()).unwrap();
    for bytes in [
        &b"garbage"[..],
        b"",
        b"\0asm\x01\0\0\0",
        b"\0asm\x01\0\0\0\x01\x05garbage",
    ] {
        let e = rt.load(bytes).unwrap_err();
        assert!(matches!(e, Error::InvalidModule(_)), "{e:?}");
    }
    // A manifest glued onto a module that lacks the exports it lists.
    let real = std::fs::read(wasmrpc_plugins::SEED_FNS).unwrap();
    let mut section = Vec::new();
    let name = b"wasmrpc-manifest";
    let start = real.windows(name.len()).position(|w| w == name).unwrap();
    // Copy the section bytes after the name: the rest of the custom section.
    let payload_len = manifest_payload_len(&real, start);
    section.extend_from_slice(&real[start + name.len()..start + name.len() + payload_len]);
    let mut fake = b"\0asm\x01\0\0\0".to_vec();
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name);
    body.extend_from_slice(&section);
    fake.push(0);
    leb(&mut fake, body.len());
    fake.extend(body);
    let e = rt.load(&fake).unwrap_err();
    assert!(e.to_string().contains("does not export"), "{e}");
    assert!(rt.load_file(wasmrpc_plugins::SEED_FNS).is_ok());
}

fn leb(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The payload length of the custom section whose name starts at `name_at`.
fn manifest_payload_len(module: &[u8], name_at: usize) -> usize {
    // Layout: 0x00, LEB size, LEB name length (1 byte: 16), name, payload.
    let mut i = name_at - 2;
    while module[i] != 0 {
        i -= 1;
    }
    let (mut size, mut shift, mut p) = (0usize, 0, i + 1);
    loop {
        let b = module[p];
        size |= usize::from(b & 0x7f) << shift;
        p += 1;
        shift += 7;
        if b & 0x80 == 0 {
            break;
        }
    }
    size - 1 - 16
}

/// The hello plugin with its version marker replaced (same length: the
/// module stays valid): other bytes and behaviour, same plugin name.
fn hello_version(marker: u8) -> Vec<u8> {
    let bytes = std::fs::read(wasmrpc_plugins::HELLO).unwrap();
    let old = b"hello-version-AAAAAAAAAAAAAAAAAA";
    let mut new = *old;
    new[14..].fill(marker);
    let mut out = bytes.clone();
    let mut found = 0;
    for i in 0..=out.len() - old.len() {
        if &bytes[i..i + old.len()] == old {
            out[i..i + old.len()].copy_from_slice(&new);
            found += 1;
        }
    }
    assert!(found > 0, "the version marker is in the module");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_of_one_plugin_load_side_by_side_and_unload() {
    timed(async {
        let rt = Runtime::new(config()).unwrap();
        let (v1, v2) = (hello_version(b'A'), hello_version(b'B'));
        let a = rt.load(&v1).unwrap();
        assert!(
            matches!(rt.load(&v2), Err(Error::DuplicatePlugin(_))),
            "load keeps refusing another version"
        );
        let b = rt.load_version(&v2).unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        assert!(Arc::ptr_eq(&rt.load_version(&v2).unwrap(), &b));
        assert_eq!(rt.loaded().len(), 2);
        assert!(Arc::ptr_eq(&rt.plugin("wasmrpc-plugin-hello").unwrap(), &a));
        let host = crate::fake::FakeHost::new();
        for (p, marker) in [(&a, "A"), (&b, "B")] {
            let r = rt
                .call(p, "version", args(vec![]), host.arc())
                .await
                .unwrap();
            assert_eq!(
                r,
                Value::Str(format!("hello-version-{}", marker.repeat(18)))
            );
        }
        assert!(rt.unload(&a));
        assert!(!rt.unload(&a));
        assert!(Arc::ptr_eq(&rt.plugin("wasmrpc-plugin-hello").unwrap(), &b));
        // Unloaded, it still runs for whoever holds it.
        let r = rt
            .call(&a, "version", args(vec![]), host.arc())
            .await
            .unwrap();
        assert!(matches!(r, Value::Str(s) if s.ends_with('A')));
    })
    .await;
}
