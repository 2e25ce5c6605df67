//! Scratch folders of compiled code (CACHE-4): where a worker without a
//! module cache folder it can write has its plugins' code written, to map
//! it from there.
//!
//! Each folder is made in the temporary folder (`$TMPDIR`), readable by its
//! user alone, and named after the process that made it
//! (`wasmrpc-code-PID-RANDOM`). Its process removes it as soon as the code
//! is mapped. A process that dies first (killed while its helper compiles)
//! leaves it, a Python plugin's 35 MiB: the next scratch folder made on the
//! machine removes the folders of processes that no longer run, so a
//! worker restarted again and again does not fill the temporary folder.
//!
//! This module owns the folders' names, their making and their sweeping;
//! what is written in them and when it is mapped is the cache's (`cache`).

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The start of every scratch folder's name.
const PREFIX: &str = "wasmrpc-code-";

/// A scratch folder of this process's, removed when dropped or closed.
pub(super) struct ScratchDir {
    dir: tempfile::TempDir,
    code: PathBuf,
}

impl ScratchDir {
    /// Makes a folder in the temporary folder, after removing those of
    /// processes that have ended.
    ///
    /// # Errors
    /// The folder cannot be made (no temporary folder, or one this process
    /// cannot write).
    pub(super) fn new() -> io::Result<ScratchDir> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{PREFIX}{}-", std::process::id()))
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()?;
        if let Ok(meta) = std::fs::metadata(dir.path()) {
            sweep_ended(dir.path().parent().unwrap_or(Path::new("/")), meta.uid());
        }
        let code = dir.path().join("code.cwasm");
        Ok(ScratchDir { dir, code })
    }

    /// The folder.
    pub(super) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The file the compiled code goes to.
    pub(super) fn code(&self) -> &Path {
        &self.code
    }

    /// Removes the folder and what it holds; mappings of its files stay
    /// valid.
    pub(super) fn close(self) {
        if let Err(e) = self.dir.close() {
            tracing::warn!("cannot remove a scratch folder of compiled code: {e}");
        }
    }
}

/// Removes the scratch folders in `parent` that belong to user `uid` and
/// were made by processes that no longer run. A folder whose process id
/// names a live process stays, whoever that process is now.
///
/// Without `/proc` nothing is removed: no process could be told alive. A
/// folder removed while its process runs (one of another PID namespace
/// sharing the folder) costs that process its scratch file, not its code:
/// code already mapped stays valid, and a compile whose file is gone runs
/// from memory.
fn sweep_ended(parent: &Path, uid: u32) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(listing) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in listing.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| process_id(pid))
        else {
            continue;
        };
        // `symlink_metadata`: a link named as a scratch folder is not
        // followed, and not ours to remove.
        let ours =
            std::fs::symlink_metadata(entry.path()).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        if !ours || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        match std::fs::remove_dir_all(entry.path()) {
            Ok(()) => tracing::info!(
                "removed {}, a scratch folder of compiled code left by process {pid}, which ended",
                entry.path().display()
            ),
            Err(e) => tracing::debug!("cannot remove {}: {e}", entry.path().display()),
        }
    }
}

/// The process id a scratch folder's name gives, spelled exactly as this
/// module spells one: `0123` or `+123` would name `/proc/0123`, which no
/// process has, and make a live process's folder look ended.
fn process_id(text: &str) -> Option<u32> {
    let pid = text.parse::<u32>().ok()?;
    (pid.to_string() == text).then_some(pid)
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_a_process_id_spelled_as_ours_names_a_process() {
        assert_eq!(super::process_id("123"), Some(123));
        for odd in ["0123", "+123", "", "12a", " 123", "-1", "99999999999"] {
            assert_eq!(super::process_id(odd), None, "{odd:?}");
        }
    }
}
