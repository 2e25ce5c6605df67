//! Folder grants: the host folders an operator lets one plugin use, under
//! guest paths, and every file access a plugin makes through them.
//!
//! A plugin reaches no file by default. The operator grants a plugin (by
//! namespace) a host folder under a guest path, read-only or read-write,
//! with an optional byte quota (`--grant-dir
//! param_server:/ckpt=/srv/ckpt:rw,quota=1G`, [`FolderGrant::parse`]).
//! What this module owns:
//! - parsing and opening grants ([`FolderGrants`], one per worker; the
//!   grants of one plugin are a [`Folders`], shared by its instances);
//! - resolving a guest path to a granted folder and a path inside it, and
//!   the file operations a core-module plugin's host requests make
//!   ([`Folders::read`], [`Folders::write`], [`Folders::list`],
//!   [`Folders::remove`]), through `cap-std`, so `..`, absolute paths and
//!   symlinks leading out of a granted folder are refused by construction;
//! - the WASI preopens of a component plugin (`Folders::preopen`), so a
//!   Python plugin's `open()` sees the same folders.
//!
//! It must not know what a file holds (tensor formats are the host's).
//!
//! Invariants:
//! - FG-1: a plugin reaches only files under a folder its operator granted
//!   to its namespace (a plugin deployed at run time only those granted
//!   with `deployed`); every other guest path is refused before any system
//!   call touches it.
//! - FG-2: a read-only grant is never written, through host requests or
//!   WASI.
//! - FG-3: only regular files with one link are read or written through
//!   host requests: no device, FIFO or socket, and no hard link that could
//!   name a file outside the folder.
//! - FG-4: the files of a grant with a quota never exceed it through host
//!   requests; WASI sees such a grant read-only (wasmtime's WASI cannot
//!   count bytes), so its writes go through the host requests.
//! - FG-5: a write is atomic: readers see the old file or the whole new
//!   one (a temporary file in the same folder, then a rename).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use cap_std::fs::{Dir, MetadataExt, OpenOptions};
use wasmrpc_abi::{ErrorKind, RemoteError};

mod grants;

pub use grants::FolderGrants;

/// How a plugin may use a granted folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read files and list folders.
    ReadOnly,
    /// Also write and remove files and make folders.
    ReadWrite,
}

/// One folder an operator grants to one plugin: what `--grant-dir` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FolderGrant {
    /// The plugin's namespace (`param_server`).
    pub namespace: String,
    /// Where the plugin sees the folder: an absolute guest path (`/data`).
    pub guest: String,
    /// The folder on the worker's machine.
    pub host: PathBuf,
    /// Read-only or read-write.
    pub access: Access,
    /// For a read-write grant: the most bytes its files may hold.
    pub quota: Option<u64>,
    /// Whether a plugin of this namespace deployed at run time gets the
    /// grant too (by default only a plugin the operator loaded does).
    pub deployed: bool,
}

fn value_error(message: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorKind::ValueError, message)
}

fn runtime_error(message: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorKind::RuntimeError, message)
}

/// `512`, `64K`, `10M`, `1G` (powers of 1024).
fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let scale: u64 = match unit
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(scale)
}

/// The components of an absolute guest path, or why it is not one.
fn guest_components(path: &str) -> Result<Vec<&str>, RemoteError> {
    if !path.starts_with('/') {
        return Err(value_error(format!(
            "{path:?} is not an absolute path: a plugin names files by the guest path of a \
             granted folder (e.g. /data/train.csv)"
        )));
    }
    if path.contains('\0') {
        return Err(value_error(format!("{path:?} holds a NUL byte")));
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                return Err(value_error(format!(
                    "{path:?} holds '..': a plugin names files inside its granted folders only"
                )));
            }
            p => parts.push(p),
        }
    }
    Ok(parts)
}

impl FolderGrant {
    /// Parses `NAMESPACE:/GUEST=HOST[:ro|:rw][,quota=SIZE][,deployed]`, the
    /// form of `--grant-dir` (read-only unless `:rw`; `SIZE` as `512`,
    /// `64K`, `10M`, `1G`).
    ///
    /// # Errors
    /// `ValueError` saying what is wrong and what the form is.
    pub fn parse(spec: &str) -> Result<FolderGrant, RemoteError> {
        const FORM: &str = "the form is NAMESPACE:/GUEST=HOST[:ro|:rw][,quota=SIZE][,deployed], \
                            e.g. param_server:/ckpt=/srv/ckpt:rw,quota=1G";
        let bad = |why: String| value_error(format!("--grant-dir {spec:?}: {why}; {FORM}"));
        let (main, options) = match spec.split_once(',') {
            Some((m, o)) => (m, Some(o)),
            None => (spec, None),
        };
        let (namespace, rest) = main
            .split_once(':')
            .ok_or_else(|| bad("no plugin namespace before ':'".into()))?;
        if namespace.is_empty()
            || !namespace
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(bad(format!(
                "{namespace:?} is not a plugin namespace (letters, digits, '_')"
            )));
        }
        let (guest, host) = rest
            .split_once('=')
            .ok_or_else(|| bad("no '=' between the guest path and the host folder".into()))?;
        let parts = guest_components(guest).map_err(|e| bad(e.message))?;
        if parts.is_empty() {
            return Err(bad("the guest path cannot be '/'".into()));
        }
        let guest = format!("/{}", parts.join("/"));
        let (host, access) = match host.rsplit_once(':') {
            Some((h, "ro")) => (h, Access::ReadOnly),
            Some((h, "rw")) => (h, Access::ReadWrite),
            _ => (host, Access::ReadOnly),
        };
        if host.is_empty() {
            return Err(bad("no host folder".into()));
        }
        let mut grant = FolderGrant {
            namespace: namespace.to_owned(),
            guest,
            host: PathBuf::from(host),
            access,
            quota: None,
            deployed: false,
        };
        for option in options.into_iter().flat_map(|o| o.split(',')) {
            match option.split_once('=') {
                Some(("quota", size)) => {
                    grant.quota = Some(parse_bytes(size).ok_or_else(|| {
                        bad(format!("quota {size:?} is not a size (512, 64K, 10M, 1G)"))
                    })?);
                }
                None if option == "deployed" => grant.deployed = true,
                _ => return Err(bad(format!("unknown option {option:?}"))),
            }
        }
        if grant.quota.is_some() && access == Access::ReadOnly {
            return Err(bad("a quota needs a read-write grant (:rw)".into()));
        }
        Ok(grant)
    }

    /// The spec [`parse`](Self::parse) reads back into this grant.
    pub fn to_spec(&self) -> String {
        let mut spec = format!(
            "{}:{}={}:{}",
            self.namespace,
            self.guest,
            self.host.display(),
            match self.access {
                Access::ReadOnly => "ro",
                Access::ReadWrite => "rw",
            }
        );
        if let Some(q) = self.quota {
            spec.push_str(&format!(",quota={q}"));
        }
        if self.deployed {
            spec.push_str(",deployed");
        }
        spec
    }
}

/// One granted folder, opened.
#[derive(Debug)]
struct OpenFolder {
    grant: FolderGrant,
    dir: Dir,
    /// Bytes its files hold, counted on the first write of a grant with a
    /// quota and tracked from then on (FG-4).
    used: Mutex<Option<u64>>,
}

/// The folders one plugin may use on one worker (its operator's grants),
/// shared by the plugin's instances there.
#[derive(Debug, Default)]
pub struct Folders {
    folders: Vec<OpenFolder>,
}

/// What [`Folders::list`] reports of one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The entry's name.
    pub name: String,
    /// Whether it is a folder.
    pub is_dir: bool,
    /// Its size in bytes (0 for a folder).
    pub size: u64,
}

/// Counter for temporary file names (FG-5).
static TEMPORARIES: AtomicU64 = AtomicU64::new(0);

fn io_refusal(action: &str, path: &str, e: &std::io::Error) -> RemoteError {
    // cap-std reports an escape (a symlink out, an absolute symlink) as
    // PermissionDenied with this text; name the rule, not the syscall.
    let text = e.to_string();
    let why = if text.contains("outside of the filesystem") || text.contains("escape") {
        "it leads outside the granted folder (a symlink out of it?)".to_owned()
    } else {
        text
    };
    runtime_error(format!("cannot {action} {path}: {why}"))
}

impl Folders {
    /// Whether no folder is granted.
    pub fn is_empty(&self) -> bool {
        self.folders.is_empty()
    }

    /// The grants, in the operator's order.
    pub fn grants(&self) -> impl Iterator<Item = &FolderGrant> {
        self.folders.iter().map(|f| &f.grant)
    }

    /// The granted folder `path` lies in (the longest guest prefix) and the
    /// path inside it (FG-1).
    fn resolve(&self, path: &str) -> Result<(&OpenFolder, PathBuf), RemoteError> {
        let parts = guest_components(path)?;
        let mut best: Option<(&OpenFolder, usize)> = None;
        for folder in &self.folders {
            let prefix: Vec<&str> = folder
                .grant
                .guest
                .split('/')
                .filter(|p| !p.is_empty())
                .collect();
            if parts.len() >= prefix.len()
                && parts[..prefix.len()] == prefix[..]
                && best.is_none_or(|(_, n)| prefix.len() > n)
            {
                best = Some((folder, prefix.len()));
            }
        }
        let Some((folder, n)) = best else {
            let granted: Vec<&str> = self
                .folders
                .iter()
                .map(|f| f.grant.guest.as_str())
                .collect();
            return Err(runtime_error(if granted.is_empty() {
                format!(
                    "cannot open {path}: this plugin has no folder granted on this worker \
                         (the operator grants one with --grant-dir)"
                )
            } else {
                format!(
                    "cannot open {path}: no granted folder holds it (granted: {})",
                    granted.join(", ")
                )
            }));
        };
        let inside: PathBuf = parts[n..].iter().collect();
        Ok((folder, inside))
    }

    /// Refuses what is not a regular file with one link (FG-3).
    fn check_regular(path: &str, meta: &cap_std::fs::Metadata) -> Result<(), RemoteError> {
        if !meta.is_file() {
            let what = if meta.is_dir() {
                "a folder"
            } else {
                "not a regular file (a device, FIFO or socket)"
            };
            return Err(runtime_error(format!("cannot open {path}: it is {what}")));
        }
        if meta.nlink() > 1 {
            return Err(runtime_error(format!(
                "cannot open {path}: it has {} hard links, and a hard link can name a file \
                     outside the granted folder",
                meta.nlink()
            )));
        }
        Ok(())
    }

    /// The whole file at `path`, refused before it is read when it holds
    /// more than `max_bytes`.
    ///
    /// # Errors
    /// `ValueError` for a path that is not absolute or holds `..`;
    /// `RuntimeError` outside the grants (FG-1), for what is not a regular
    /// file with one link (FG-3), a missing file, and a file over
    /// `max_bytes`; each names the path and why.
    pub fn read(&self, path: &str, max_bytes: u64) -> Result<Vec<u8>, RemoteError> {
        let (folder, inside) = self.resolve(path)?;
        let meta = folder
            .dir
            .metadata(&inside)
            .map_err(|e| io_refusal("open", path, &e))?;
        Self::check_regular(path, &meta)?;
        if meta.len() > max_bytes {
            return Err(runtime_error(format!(
                "cannot read {path}: it holds {} bytes, more than the {max_bytes} this read may \
                 take (the worker's tensor memory budget)",
                meta.len()
            )));
        }
        let mut options = OpenOptions::new();
        options.read(true);
        let mut file = folder
            .dir
            .open_with(&inside, &options)
            .map_err(|e| io_refusal("open", path, &e))?;
        // The file may have changed between the two looks: check the one
        // opened, and read no more than was allowed.
        let meta = file.metadata().map_err(|e| io_refusal("open", path, &e))?;
        Self::check_regular(path, &meta)?;
        let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
        (&mut file)
            .take(max_bytes.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|e| io_refusal("read", path, &e))?;
        if bytes.len() as u64 > max_bytes {
            return Err(runtime_error(format!(
                "cannot read {path}: it grew past the {max_bytes} bytes this read may take"
            )));
        }
        Ok(bytes)
    }

    fn writable<'a>(
        &'a self,
        path: &str,
        action: &str,
    ) -> Result<(&'a OpenFolder, PathBuf), RemoteError> {
        let (folder, inside) = self.resolve(path)?;
        if folder.grant.access == Access::ReadOnly {
            return Err(runtime_error(format!(
                "cannot {action} {path}: the folder {} is granted read-only",
                folder.grant.guest
            )));
        }
        if inside.as_os_str().is_empty() {
            return Err(value_error(format!(
                "cannot {action} {path}: it is the granted folder itself"
            )));
        }
        Ok((folder, inside))
    }

    /// Bytes the regular files under `dir` hold (for a quota).
    fn usage(dir: &Dir, depth: usize) -> std::io::Result<u64> {
        let mut total = 0u64;
        for entry in dir.entries()? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() && depth < 64 {
                total = total.saturating_add(Self::usage(&entry.open_dir()?, depth + 1)?);
            } else if meta.is_file() {
                total = total.saturating_add(meta.len());
            }
        }
        Ok(total)
    }

    /// Writes `bytes` to the file at `path` atomically (FG-5), making its
    /// parent folders inside the grant; replaces a file already there.
    ///
    /// # Errors
    /// As [`read`](Self::read); `RuntimeError` for a read-only grant
    /// (FG-2) and for a write that would take a grant's files past its
    /// quota (FG-4).
    pub fn write(&self, path: &str, bytes: &[u8]) -> Result<(), RemoteError> {
        let (folder, inside) = self.writable(path, "write")?;
        let parent = inside.parent().unwrap_or(Path::new(""));
        let name = inside
            .file_name()
            .ok_or_else(|| value_error(format!("cannot write {path}: it names no file")))?;
        let dir = if parent.as_os_str().is_empty() {
            folder.dir.try_clone()
        } else {
            // Opened first, so a symlink out of the folder is refused as
            // such, and made only when it is missing.
            match folder.dir.open_dir(parent) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => folder
                    .dir
                    .create_dir_all(parent)
                    .and_then(|()| folder.dir.open_dir(parent)),
                opened => opened,
            }
        }
        .map_err(|e| io_refusal("write", path, &e))?;
        // Serializes writes to one grant, so a quota's count stays right.
        let mut used = folder.used.lock().unwrap_or_else(|p| p.into_inner());
        let replaced = match dir.symlink_metadata(name) {
            Ok(meta) if meta.is_file() => {
                Self::check_regular(path, &meta)?;
                meta.len()
            }
            Ok(meta) if meta.is_dir() => {
                return Err(value_error(format!("cannot write {path}: it is a folder")));
            }
            Ok(_) => {
                return Err(runtime_error(format!(
                    "cannot write {path}: a symlink or special file is there"
                )));
            }
            Err(_) => 0,
        };
        if let Some(quota) = folder.grant.quota {
            let now = match *used {
                Some(n) => n,
                None => Self::usage(&folder.dir, 0).map_err(|e| io_refusal("write", path, &e))?,
            };
            let after = now
                .saturating_sub(replaced)
                .saturating_add(bytes.len() as u64);
            if after > quota {
                *used = Some(now);
                return Err(runtime_error(format!(
                    "cannot write {path}: {} bytes would take the folder {} to {after} \
                         bytes, over its quota of {quota}",
                    bytes.len(),
                    folder.grant.guest
                )));
            }
            *used = Some(after);
        }
        let temporary = format!(
            ".{}.wasmrpc-{}-{}",
            name.to_string_lossy(),
            std::process::id(),
            TEMPORARIES.fetch_add(1, Ordering::Relaxed)
        );
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        let written = dir.open_with(&temporary, &options).and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_data()
        });
        let renamed = written.and_then(|()| dir.rename(&temporary, &dir, name));
        if let Err(e) = renamed {
            let _ = dir.remove_file(&temporary);
            if let (Some(quota_used), Some(_)) = (used.as_mut(), folder.grant.quota) {
                *quota_used = quota_used
                    .saturating_sub(bytes.len() as u64)
                    .saturating_add(replaced);
            }
            return Err(io_refusal("write", path, &e));
        }
        Ok(())
    }

    /// Removes the file, or the empty folder, at `path`.
    ///
    /// # Errors
    /// As [`write`](Self::write), and for a folder that is not empty.
    pub fn remove(&self, path: &str) -> Result<(), RemoteError> {
        let (folder, inside) = self.writable(path, "remove")?;
        let mut used = folder.used.lock().unwrap_or_else(|p| p.into_inner());
        let meta = folder
            .dir
            .symlink_metadata(&inside)
            .map_err(|e| io_refusal("remove", path, &e))?;
        if meta.is_dir() {
            return folder
                .dir
                .remove_dir(&inside)
                .map_err(|e| io_refusal("remove", path, &e));
        }
        folder
            .dir
            .remove_file(&inside)
            .map_err(|e| io_refusal("remove", path, &e))?;
        if let Some(n) = used.as_mut()
            && meta.is_file()
        {
            *n = n.saturating_sub(meta.len());
        }
        Ok(())
    }

    /// The entries of the folder at `path`, by name.
    ///
    /// # Errors
    /// As [`read`](Self::read), for a folder.
    pub fn list(&self, path: &str) -> Result<Vec<Entry>, RemoteError> {
        let (folder, inside) = self.resolve(path)?;
        let dir = if inside.as_os_str().is_empty() {
            folder.dir.try_clone()
        } else {
            folder.dir.open_dir(&inside)
        }
        .map_err(|e| io_refusal("list", path, &e))?;
        let mut entries = Vec::new();
        for entry in dir.entries().map_err(|e| io_refusal("list", path, &e))? {
            let entry = entry.map_err(|e| io_refusal("list", path, &e))?;
            let meta = entry.metadata().map_err(|e| io_refusal("list", path, &e))?;
            entries.push(Entry {
                name: entry.file_name().to_string_lossy().into_owned(),
                is_dir: meta.is_dir(),
                size: if meta.is_file() { meta.len() } else { 0 },
            });
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    /// Adds these folders to a WASI context as preopens: read-only grants
    /// and grants with a quota read-only (FG-2, FG-4), the others
    /// read-write.
    pub(crate) fn preopen(
        &self,
        builder: &mut wasmtime_wasi::WasiCtxBuilder,
    ) -> wasmtime::Result<()> {
        use wasmtime_wasi::FsPerms;
        for folder in &self.folders {
            let writable = folder.grant.access == Access::ReadWrite && folder.grant.quota.is_none();
            let perms = if writable {
                FsPerms::ReadWrite
            } else {
                FsPerms::ReadOnly
            };
            builder.preopened_dir(&folder.grant.host, &folder.grant.guest, perms)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
