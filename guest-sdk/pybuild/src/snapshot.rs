//! Copies of the sources componentize-py bundles.
//!
//! componentize-py's embedded Python writes bytecode (`__pycache__`) next to
//! every module it compiles, whatever `PYTHONDONTWRITEBYTECODE` or
//! `PYTHONPYCACHEPREFIX` say. Run on the guest kit and the plugin's folder,
//! a build wrote into them: in a checkout, into the folders the plugins'
//! build script watches, so every later Cargo command ran that script again
//! and rebuilt every crate downstream of it; in a release bundle, into its
//! installed `share/` folder. It runs on copies instead, and nothing a build
//! reads is written to.

use std::io;
use std::path::Path;

/// Folders nested deeper than this are refused: a symbolic link that
/// points to a folder above it would otherwise be followed forever.
const MAX_DEPTH: usize = 32;

/// Copies the tree `from` into `to` (created), following symbolic links,
/// leaving out `__pycache__` folders and `skip` (the build's own folder,
/// when the output was asked for inside the plugin's folder).
pub(crate) fn copy_sources(from: &Path, to: &Path, skip: &Path) -> io::Result<()> {
    let skip = skip.canonicalize().ok();
    copy_tree(from, to, skip.as_deref(), 0)
}

fn copy_tree(from: &Path, to: &Path, skip: Option<&Path>, depth: usize) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::other(format!(
            "{} is nested more than {MAX_DEPTH} folders deep (a symbolic link to a folder above it?)",
            from.display()
        )));
    }
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_name() == "__pycache__" {
            continue;
        }
        if skip.is_some_and(|s| path.canonicalize().is_ok_and(|p| p == s)) {
            continue;
        }
        // `metadata` follows links: a linked file or folder is copied as
        // what it points to.
        let meta = std::fs::metadata(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let target = to.join(entry.file_name());
        if meta.is_dir() {
            copy_tree(&path, &target, skip, depth + 1)?;
        } else {
            std::fs::copy(&path, &target)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_leaves_out_bytecode_and_the_builds_own_folder() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("app");
        std::fs::create_dir_all(src.join("pkg/__pycache__")).unwrap();
        std::fs::create_dir_all(src.join("out.build")).unwrap();
        std::fs::write(src.join("app.py"), "x = 1\n").unwrap();
        std::fs::write(src.join("pkg/__init__.py"), "").unwrap();
        std::fs::write(src.join("pkg/__pycache__/a.pyc"), "").unwrap();
        std::fs::write(src.join("out.build/entry.py"), "").unwrap();
        let to = dir.path().join("copy");
        copy_sources(&src, &to, &src.join("out.build")).unwrap();
        assert_eq!(
            std::fs::read_to_string(to.join("app.py")).unwrap(),
            "x = 1\n"
        );
        assert!(to.join("pkg/__init__.py").is_file());
        assert!(!to.join("pkg/__pycache__").exists());
        assert!(!to.join("out.build").exists());
    }

    #[cfg(unix)]
    #[test]
    fn a_link_to_a_folder_above_is_refused_not_followed_forever() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("app");
        std::fs::create_dir_all(&src).unwrap();
        std::os::unix::fs::symlink(&src, src.join("loop")).unwrap();
        let e = copy_sources(&src, &dir.path().join("copy"), &dir.path().join("none")).unwrap_err();
        assert!(e.to_string().contains("nested more than 32"), "{e}");
    }
}
