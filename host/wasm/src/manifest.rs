//! Reading a plugin's manifest out of its wasm bytes, without compiling it
//! (what `wasmrpc plugin inspect FILE` prints).

use crate::{Error, Result};
use wasmrpc_abi::protocol::MANIFEST_SECTION;

pub use wasmrpc_abi::manifest::{Export, Manifest};
pub use wasmrpc_abi::protocol::ExportKind;

/// Reads the manifest the guest macros wrote into `module`.
///
/// # Errors
/// [`Error::InvalidModule`] if the bytes are not a wasm module, have no
/// manifest section, or the manifest is malformed. Never panics, whatever
/// the bytes.
pub fn read(module: &[u8]) -> Result<Manifest> {
    let mut section = Vec::new();
    for (name, payload) in custom_sections(module)? {
        if name == MANIFEST_SECTION.as_bytes() {
            section.extend_from_slice(payload);
        }
    }
    if section.is_empty() {
        return Err(Error::InvalidModule(format!(
            "no `{MANIFEST_SECTION}` section: not built with the wasmrpc guest SDK"
        )));
    }
    Manifest::from_section(&section).map_err(|e| Error::InvalidModule(e.to_string()))
}

/// A plugin's manifest as text, one export a line (what `wasmrpc plugin
/// inspect` prints):
///
/// ```text
/// wasmrpc-plugin-seed-fns 0.1.0 (protocol 1)
///   fn my_function(a, b, c)
///   async fn async_add(to, x, y)
///   class MyClass(a, delay)
///     method MyClass.get_value()
///     async method MyClass.bound_async_add(to, x, y)
/// ```
///
/// What the plugin declares it needs (`wasmrpc_guest::permissions!`)
/// follows, if anything: `  asks to run ops: aten::from_file` and `  asks
/// to call: hello::*`.
pub fn describe(manifest: &Manifest) -> String {
    let mut out = format!(
        "{} {} (protocol {})\n",
        manifest.name, manifest.version, manifest.abi
    );
    let line = |e: &Export| {
        let params = e.params.join(", ");
        let class = e.class.as_deref().unwrap_or("");
        match e.kind {
            ExportKind::Function => format!("  fn {}({params})\n", e.name),
            ExportKind::AsyncFunction => format!("  async fn {}({params})\n", e.name),
            ExportKind::Constructor => format!("  class {}({params})\n", e.name),
            ExportKind::Method => format!("    method {class}.{}({params})\n", e.name),
            ExportKind::AsyncMethod => format!("    async method {class}.{}({params})\n", e.name),
        }
    };
    for e in manifest.exports.iter().filter(|e| e.class.is_none()) {
        out.push_str(&line(e));
    }
    for ctor in manifest
        .exports
        .iter()
        .filter(|e| e.kind == ExportKind::Constructor)
    {
        out.push_str(&line(ctor));
        for m in manifest
            .exports
            .iter()
            .filter(|e| e.class == ctor.class && e.kind != ExportKind::Constructor)
        {
            out.push_str(&line(m));
        }
    }
    let asks = &manifest.permissions;
    if !asks.ops.is_empty() {
        out.push_str(&format!("  asks to run ops: {}\n", asks.ops.join(", ")));
    }
    if !asks.calls.is_empty() {
        out.push_str(&format!("  asks to call: {}\n", asks.calls.join(", ")));
    }
    if manifest.single_instance {
        out.push_str("  runs in one instance per worker (single_instance)\n");
    }
    if !manifest.reaches_objects.is_empty() {
        out.push_str(&format!(
            "  runs beside its objects (local_value): {}\n",
            manifest.reaches_objects.join(", ")
        ));
    }
    out
}

fn bad(what: &str) -> Error {
    Error::InvalidModule(what.to_owned())
}

/// Reads an unsigned LEB128 `u32` at `*pos`.
fn leb_u32(bytes: &[u8], pos: &mut usize) -> Result<u32> {
    let mut result: u32 = 0;
    for shift in (0..35).step_by(7) {
        let byte = *bytes
            .get(*pos)
            .ok_or_else(|| bad("truncated section header"))?;
        *pos += 1;
        result |= u32::from(byte & 0x7f).checked_shl(shift).unwrap_or(0);
        if byte & 0x80 == 0 {
            return Ok(result);
        }
    }
    Err(bad("overlong LEB128 number"))
}

/// The `(name, payload)` of every top-level custom section of a core wasm
/// module or a component.
fn custom_sections(module: &[u8]) -> Result<Vec<(&[u8], &[u8])>> {
    // A core module, or a component (whose top-level custom sections the
    // Python build appends the manifest to).
    let header = module.get(..8);
    if header != Some(b"\0asm\x01\0\0\0".as_slice()) && !crate::component::is_component(module) {
        return Err(bad(
            "not a wasm core module or component (bad magic or version)",
        ));
    }
    let mut out = Vec::new();
    let mut pos = 8;
    while pos < module.len() {
        let id = module[pos];
        pos += 1;
        let size = leb_u32(module, &mut pos)? as usize;
        let end = pos
            .checked_add(size)
            .filter(|e| *e <= module.len())
            .ok_or_else(|| bad("section runs past the end"))?;
        if id == 0 {
            let mut p = pos;
            let name_len = leb_u32(module, &mut p)? as usize;
            let name_end = p
                .checked_add(name_len)
                .filter(|e| *e <= end)
                .ok_or_else(|| bad("custom section name runs past its section"))?;
            out.push((&module[p..name_end], &module[name_end..end]));
        }
        pos = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(read(b"").is_err());
        assert!(read(b"hello world, not wasm").is_err());
        assert!(read(b"\0asm\x01\0\0\0\0\xff\xff\xff\xff\x0f").is_err());
        assert!(read(b"\0asm\x01\0\0\0\0\x05\x09abc").is_err());
        // A valid module without a manifest.
        let err = read(b"\0asm\x01\0\0\0").unwrap_err();
        assert!(
            err.to_string().contains("no `wasmrpc-manifest` section"),
            "{err}"
        );
        // Every prefix of a module with a section must fail cleanly.
        let mut m = b"\0asm\x01\0\0\0".to_vec();
        m.extend([0, 20, 16]);
        m.extend(b"wasmrpc-manifest");
        m.extend([1, 0, 0]);
        for cut in 0..m.len() {
            assert!(read(&m[..cut]).is_err());
        }
    }

    use proptest::prelude::*;
    use wasmrpc_abi::manifest::Record;

    fn leb(mut n: usize, out: &mut Vec<u8>) {
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

    /// A module with a type section, the manifest of `exports` split over
    /// two custom sections (as the linker may leave it), and another
    /// custom section.
    fn module(exports: &[(String, Vec<String>)]) -> Vec<u8> {
        let mut records = Record::Plugin {
            name: "p".into(),
            version: "0.1.0".into(),
            abi: 1,
        }
        .frame()
        .unwrap();
        for (name, params) in exports {
            records.extend(
                Record::Export(Export {
                    name: name.clone(),
                    kind: ExportKind::Function,
                    class: None,
                    params: params.clone(),
                })
                .frame()
                .unwrap(),
            );
        }
        let mut m = b"\0asm\x01\0\0\0".to_vec();
        // An empty type section.
        m.extend([1, 1, 0]);
        let split = records.len() / 2;
        for (name, payload) in [
            (MANIFEST_SECTION.as_bytes(), &records[..split]),
            (b"producers".as_slice(), b"x".as_slice()),
            (MANIFEST_SECTION.as_bytes(), &records[split..]),
        ] {
            let mut body = Vec::new();
            leb(name.len(), &mut body);
            body.extend_from_slice(name);
            body.extend_from_slice(payload);
            m.push(0);
            leb(body.len(), &mut m);
            m.extend(body);
        }
        m
    }

    fn exports() -> impl Strategy<Value = Vec<(String, Vec<String>)>> {
        proptest::collection::btree_map(
            "[a-z_]{1,12}",
            proptest::collection::vec("[a-z]{1,6}", 0..4),
            0..6,
        )
        .prop_map(|m| m.into_iter().collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn manifests_round_trip_through_modules(exports in exports()) {
            let m = read(&module(&exports)).unwrap();
            let got: Vec<_> = m.exports.iter().map(|e| (e.name.clone(), e.params.clone())).collect();
            prop_assert_eq!(got, exports);
        }

        #[test]
        fn arbitrary_module_bytes_never_panic(
            tail in proptest::collection::vec(any::<u8>(), 0..512),
        ) {
            let mut m = b"\0asm\x01\0\0\0".to_vec();
            m.extend(tail);
            let _ = read(&m);
        }

        #[test]
        fn mutated_modules_never_panic(
            exports in exports(),
            flips in proptest::collection::vec((any::<usize>(), 1..=255u8), 1..4),
            cut in any::<usize>(),
        ) {
            let mut m = module(&exports);
            for (at, x) in flips {
                let len = m.len();
                m[at % len] ^= x;
            }
            let keep = m.len() - cut % 8;
            m.truncate(keep);
            let _ = read(&m);
        }
    }
}
