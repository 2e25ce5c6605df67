//! The plugin manifest: which functions and classes a plugin exports, and
//! their parameter names.
//!
//! The guest macros write one [`Record`] per export into the wasm custom
//! section [`MANIFEST_SECTION`](crate::protocol::MANIFEST_SECTION), each
//! framed as a little-endian `u32` length followed by the postcard bytes. The
//! linker concatenates the records of every function into one section;
//! [`Manifest::from_section`] turns them back into a [`Manifest`]. Reading the
//! section out of a wasm module is the host's business.
//!
//! A plugin may also declare what it asks a worker to let it do beyond a
//! deployed plugin's defaults ([`Permissions`], written by
//! `wasmrpc_guest::permissions!`). The record kind was added after the
//! first plugins were built: sections without it (older plugins) read as
//! asking for nothing more, and a worker grants at most what its operator
//! allows whatever a plugin declares.

use crate::protocol::{ABI_VERSION, ExportKind};
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use serde::{Deserialize, Serialize};

/// One framed record of the manifest section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    /// The plugin's package name, version and protocol version. Every
    /// export repeats it; all copies must agree.
    Plugin {
        /// The plugin's name (its Cargo package name).
        name: String,
        /// The plugin's version.
        version: String,
        /// The [`ABI_VERSION`] it was built against.
        abi: u32,
    },
    /// One exported function, constructor or method.
    Export(Export),
    /// What the plugin asks to do beyond a deployed plugin's defaults.
    /// After the first three, so older sections (which never hold it)
    /// decode as before.
    Permissions(Permissions),
    /// Functions that reach the objects their RRef arguments hold
    /// (`rref.local_value()` in a Python plugin): the worker that owns such
    /// an object runs them beside it ([`Manifest::reaches_objects`]).
    /// Last but one, for the same reason.
    ReachesObjects(Vec<String>),
    /// The plugin runs in one instance per worker: every call of it there
    /// runs in that instance, one at a time, so its module-level state is
    /// shared by all of them, as in one Python process
    /// ([`Manifest::single_instance`]). Last, for the same reason.
    SingleInstance,
}

/// What a plugin asks a worker to let it do beyond what a deployed plugin
/// may do by default (the worker's op families; its own functions and
/// builtin ops as RPC targets). Patterns as the worker's op policy and
/// function names read them; the worker grants at most what its operator
/// allows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Permissions {
    /// Ops beyond the worker's families: `aten::from_file`,
    /// `aten::linalg_*`, `@random`.
    pub ops: Vec<String>,
    /// Registered functions of other plugins it calls by RPC:
    /// `other_ns::*`, `hello::greet`.
    pub calls: Vec<String>,
}

impl Permissions {
    /// Whether it asks for nothing.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.calls.is_empty()
    }

    /// Adds `other`'s patterns that are not already here.
    fn merge(&mut self, other: Permissions) {
        for op in other.ops {
            if !self.ops.contains(&op) {
                self.ops.push(op);
            }
        }
        for call in other.calls {
            if !self.calls.contains(&call) {
                self.calls.push(call);
            }
        }
    }
}

/// One entry of the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Export {
    /// The function's name; for a constructor, the class name.
    pub name: String,
    /// What it is.
    pub kind: ExportKind,
    /// The class it belongs to, for constructors and methods.
    pub class: Option<String>,
    /// Parameter names in order, so that keyword arguments work.
    pub params: Vec<String>,
}

/// A plugin's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The plugin's name.
    pub name: String,
    /// The plugin's version.
    pub version: String,
    /// The protocol version it was built against.
    pub abi: u32,
    /// Every export, sorted by class then name.
    pub exports: Vec<Export>,
    /// What it declares it needs (empty for plugins that declare nothing,
    /// and for those built before declarations existed).
    pub permissions: Permissions,
    /// Its functions that reach the objects their RRef arguments hold
    /// ([`Record::ReachesObjects`]); empty for Rust plugins.
    #[serde(default)]
    pub reaches_objects: Vec<String>,
    /// Whether it runs in one instance per worker ([`Record::SingleInstance`]).
    #[serde(default)]
    pub single_instance: bool,
}

/// Why a manifest section could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestError {
    /// A record's length runs past the end of the section.
    Truncated,
    /// A record's bytes do not decode.
    Malformed,
    /// The section names no plugin.
    NoPlugin,
    /// Two records name different plugins.
    Conflict,
    /// Two exports share a name and class.
    Duplicate(String),
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ManifestError::Truncated => f.write_str("manifest record is truncated"),
            ManifestError::Malformed => f.write_str("manifest record does not decode"),
            ManifestError::NoPlugin => f.write_str("manifest names no plugin"),
            ManifestError::Conflict => f.write_str("manifest records name different plugins"),
            ManifestError::Duplicate(n) => write!(f, "manifest exports `{n}` twice"),
        }
    }
}

impl Record {
    /// Frames this record as the macros write it: a `u32` little-endian
    /// length, then the postcard bytes.
    ///
    /// # Errors
    /// Fails only if postcard fails to encode, which it does not for records.
    pub fn frame(&self) -> Result<Vec<u8>, postcard::Error> {
        let body = crate::encode(self)?;
        let len = u32::try_from(body.len()).map_err(|_| postcard::Error::SerializeBufferFull)?;
        let mut out = Vec::with_capacity(body.len() + 4);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }
}

impl Manifest {
    /// Parses the concatenated records of a manifest section.
    ///
    /// Identical exports (the same item seen twice) are merged; exports are
    /// sorted by class then name.
    ///
    /// # Errors
    /// Fails on truncated or malformed records, a missing or conflicting
    /// plugin record, or two different exports with the same name.
    pub fn from_section(mut bytes: &[u8]) -> Result<Manifest, ManifestError> {
        let mut plugin: Option<(String, String, u32)> = None;
        let mut exports: Vec<Export> = Vec::new();
        let mut permissions = Permissions::default();
        let mut reaches_objects: Vec<String> = Vec::new();
        let mut single_instance = false;
        while !bytes.is_empty() {
            let (len, rest) = bytes.split_at_checked(4).ok_or(ManifestError::Truncated)?;
            let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let (body, rest) = rest.split_at_checked(len).ok_or(ManifestError::Truncated)?;
            bytes = rest;
            match crate::decode::<Record>(body).map_err(|_| ManifestError::Malformed)? {
                Record::Plugin { name, version, abi } => match &plugin {
                    None => plugin = Some((name, version, abi)),
                    Some(p) if *p == (name, version, abi) => {}
                    Some(_) => return Err(ManifestError::Conflict),
                },
                Record::Export(e) => {
                    if let Some(old) = exports
                        .iter()
                        .find(|o| o.name == e.name && o.class == e.class)
                    {
                        if *old != e {
                            return Err(ManifestError::Duplicate(e.name));
                        }
                    } else {
                        exports.push(e);
                    }
                }
                Record::Permissions(p) => permissions.merge(p),
                Record::SingleInstance => single_instance = true,
                Record::ReachesObjects(names) => {
                    for n in names {
                        if !reaches_objects.contains(&n) {
                            reaches_objects.push(n);
                        }
                    }
                }
            }
        }
        let (name, version, abi) = plugin.ok_or(ManifestError::NoPlugin)?;
        exports.sort_by(|a, b| (&a.class, &a.name).cmp(&(&b.class, &b.name)));
        Ok(Manifest {
            name,
            version,
            abi,
            exports,
            permissions,
            reaches_objects,
            single_instance,
        })
    }

    /// The records a section holding this manifest is made of
    /// ([`Manifest::from_section`] reads them back as this manifest).
    pub fn records(&self) -> Vec<Record> {
        let mut records = alloc::vec![Record::Plugin {
            name: self.name.clone(),
            version: self.version.clone(),
            abi: self.abi,
        }];
        records.extend(self.exports.iter().cloned().map(Record::Export));
        records.push(Record::Permissions(self.permissions.clone()));
        if !self.reaches_objects.is_empty() {
            records.push(Record::ReachesObjects(self.reaches_objects.clone()));
        }
        if self.single_instance {
            records.push(Record::SingleInstance);
        }
        records
    }

    /// Whether `function` reaches the objects its RRef arguments hold, so
    /// that the owner of such an object runs it beside the object.
    pub fn reaches_objects(&self, function: &str) -> bool {
        self.reaches_objects.iter().any(|f| f == function)
    }

    /// Whether the plugin was built against this crate's [`ABI_VERSION`].
    pub fn abi_matches(&self) -> bool {
        self.abi == ABI_VERSION
    }

    /// The function (plain or async) named `name`.
    pub fn function(&self, name: &str) -> Option<&Export> {
        self.exports.iter().find(|e| {
            e.class.is_none()
                && e.name == name
                && matches!(e.kind, ExportKind::Function | ExportKind::AsyncFunction)
        })
    }

    /// The constructor of `class`.
    pub fn constructor(&self, class: &str) -> Option<&Export> {
        self.exports
            .iter()
            .find(|e| e.kind == ExportKind::Constructor && e.class.as_deref() == Some(class))
    }

    /// The method `name` of `class`.
    pub fn method(&self, class: &str, name: &str) -> Option<&Export> {
        self.exports.iter().find(|e| {
            matches!(e.kind, ExportKind::Method | ExportKind::AsyncMethod)
                && e.class.as_deref() == Some(class)
                && e.name == name
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::borrow::ToOwned;
    use alloc::vec;

    fn plugin() -> Record {
        Record::Plugin {
            name: "p".to_owned(),
            version: "1.0.0".to_owned(),
            abi: ABI_VERSION,
        }
    }

    fn export(name: &str, kind: ExportKind, class: Option<&str>) -> Record {
        Record::Export(Export {
            name: name.to_owned(),
            kind,
            class: class.map(ToOwned::to_owned),
            params: vec!["a".to_owned()],
        })
    }

    #[test]
    fn parses_concatenated_records_and_merges_repeats() {
        let mut section = Vec::new();
        for r in [
            plugin(),
            export("g", ExportKind::Function, None),
            plugin(),
            export("C", ExportKind::Constructor, Some("C")),
            export("m", ExportKind::Method, Some("C")),
            export("g", ExportKind::Function, None),
        ] {
            section.extend(r.frame().unwrap());
        }
        let m = Manifest::from_section(&section).unwrap();
        assert_eq!(m.name, "p");
        assert_eq!(m.exports.len(), 3);
        assert!(m.function("g").is_some());
        assert!(m.constructor("C").is_some());
        assert!(m.method("C", "m").is_some());
        assert!(m.method("C", "g").is_none());
        assert!(m.abi_matches());
    }

    #[test]
    fn functions_that_reach_objects_round_trip_through_the_records() {
        let mut section = Vec::new();
        for r in [
            plugin(),
            export("call_method", ExportKind::Function, None),
            export("g", ExportKind::Function, None),
            Record::ReachesObjects(alloc::vec!["call_method".into()]),
            Record::ReachesObjects(alloc::vec!["call_method".into()]),
        ] {
            section.extend(r.frame().unwrap());
        }
        let m = Manifest::from_section(&section).unwrap();
        assert!(m.reaches_objects("call_method"));
        assert!(!m.reaches_objects("g"));
        assert_eq!(m.reaches_objects, ["call_method"]);
        let again: Vec<u8> = m
            .records()
            .iter()
            .flat_map(|r| r.frame().unwrap())
            .collect();
        assert_eq!(Manifest::from_section(&again).unwrap(), m);
        // A manifest without such functions writes no such record, so its
        // section reads in hosts that predate it.
        let plain = Manifest {
            reaches_objects: Vec::new(),
            ..m.clone()
        };
        assert!(
            !plain
                .records()
                .iter()
                .any(|r| matches!(r, Record::ReachesObjects(_)))
        );
        // A single-instance plugin says so in a record of its own.
        assert!(!m.single_instance);
        let single = Manifest {
            single_instance: true,
            ..m
        };
        let again: Vec<u8> = single
            .records()
            .iter()
            .flat_map(|r| r.frame().unwrap())
            .collect();
        assert!(Manifest::from_section(&again).unwrap().single_instance);
    }

    /// A section as plugins built before permission records wrote it (the
    /// bytes of `plugin()` and one function export, framed): it reads as
    /// before, asking for nothing more.
    #[test]
    fn sections_without_permissions_still_parse() {
        let old: &[u8] = &[
            10,
            0,
            0,
            0,
            0,
            1,
            b'p',
            5,
            b'1',
            b'.',
            b'0',
            b'.',
            b'0',
            ABI_VERSION as u8, //
            8,
            0,
            0,
            0,
            1,
            1,
            b'g',
            0,
            0,
            1,
            1,
            b'a',
        ];
        const { assert!(ABI_VERSION < 128, "one varint byte above") };
        let m = Manifest::from_section(old).unwrap();
        assert_eq!(m.name, "p");
        assert!(m.function("g").is_some());
        assert!(m.permissions.is_empty());
        // The same records framed today are the same bytes.
        let mut now = plugin().frame().unwrap();
        now.extend(export("g", ExportKind::Function, None).frame().unwrap());
        assert_eq!(now, old);
    }

    #[test]
    fn permission_records_merge() {
        let ask = |ops: &[&str], calls: &[&str]| {
            Record::Permissions(Permissions {
                ops: ops.iter().map(|s| (*s).to_owned()).collect(),
                calls: calls.iter().map(|s| (*s).to_owned()).collect(),
            })
        };
        let mut section = plugin().frame().unwrap();
        section.extend(ask(&["aten::from_file"], &["hello::*"]).frame().unwrap());
        section.extend(ask(&["@random", "aten::from_file"], &[]).frame().unwrap());
        let m = Manifest::from_section(&section).unwrap();
        assert_eq!(m.permissions.ops, ["aten::from_file", "@random"]);
        assert_eq!(m.permissions.calls, ["hello::*"]);
    }

    #[test]
    fn rejects_bad_sections() {
        assert_eq!(Manifest::from_section(&[]), Err(ManifestError::NoPlugin));
        assert_eq!(
            Manifest::from_section(&[9, 0, 0, 0, 1]),
            Err(ManifestError::Truncated)
        );
        assert_eq!(
            Manifest::from_section(&[1, 0]),
            Err(ManifestError::Truncated)
        );
        assert_eq!(
            Manifest::from_section(&[1, 0, 0, 0, 0xff]),
            Err(ManifestError::Malformed)
        );
        let mut two = plugin().frame().unwrap();
        two.extend(
            Record::Plugin {
                name: "q".to_owned(),
                version: "1".to_owned(),
                abi: 1,
            }
            .frame()
            .unwrap(),
        );
        assert_eq!(Manifest::from_section(&two), Err(ManifestError::Conflict));
        let mut dup = plugin().frame().unwrap();
        dup.extend(export("g", ExportKind::Function, None).frame().unwrap());
        dup.extend(
            export("g", ExportKind::AsyncFunction, None)
                .frame()
                .unwrap(),
        );
        assert_eq!(
            Manifest::from_section(&dup),
            Err(ManifestError::Duplicate("g".to_owned()))
        );
    }
}
