//! The cluster secret: a shared key every member of a group holds, read
//! from the operator (a file readable by its owner only, or the
//! environment) and never written anywhere by wasmrpc.

use std::path::Path;

use crate::{Error, Result};

/// The environment variable holding the cluster secret itself.
pub const SECRET_ENV: &str = "WASMRPC_CLUSTER_SECRET";
/// The environment variable naming a file that holds the cluster secret
/// (readable by its owner only).
pub const SECRET_FILE_ENV: &str = "WASMRPC_CLUSTER_SECRET_FILE";

/// Fails unless `file` is readable by its owner only.
///
/// # Errors
/// [`Error::Invalid`] naming the file, for a file that cannot be read or
/// whose mode lets group or others access it (with the `chmod` that fixes
/// it).
pub fn check_private(file: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file)
        .map_err(|e| Error::Invalid(format!("cannot read {}: {e}", file.display())))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(Error::Invalid(format!(
            "{} is accessible to group or others (mode {:o}); a private key or secret must be \
             readable by its owner only: run `chmod 600 {}`",
            file.display(),
            mode & 0o777,
            file.display()
        )));
    }
    Ok(())
}

/// Reads the cluster secret from `file`: it must be private
/// ([`check_private`]) and not empty; a trailing line break is dropped.
///
/// # Errors
/// [`Error::Invalid`] naming the file.
pub fn read_secret_file(file: &Path) -> Result<Vec<u8>> {
    check_private(file)?;
    let bytes = std::fs::read(file).map_err(|e| {
        Error::Invalid(format!(
            "cannot read the cluster secret file {}: {e}",
            file.display()
        ))
    })?;
    let text = bytes.trim_ascii();
    if text.is_empty() {
        return Err(Error::Invalid(format!(
            "the cluster secret file {} is empty",
            file.display()
        )));
    }
    Ok(text.to_vec())
}

/// The cluster secret the environment gives: [`SECRET_ENV`]'s value, else
/// the file [`SECRET_FILE_ENV`] names, else `None`.
///
/// # Errors
/// As [`read_secret_file`].
pub fn secret_from_env() -> Result<Option<Vec<u8>>> {
    if let Some(value) = std::env::var(SECRET_ENV).ok().filter(|s| !s.is_empty()) {
        return Ok(Some(value.into_bytes()));
    }
    match std::env::var(SECRET_FILE_ENV)
        .ok()
        .filter(|s| !s.is_empty())
    {
        Some(path) => read_secret_file(Path::new(&path)).map(Some),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_secret_file_must_be_private_and_not_empty() {
        let dir = std::env::temp_dir().join(format!("wasmrpc-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "s3cret\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_secret_file(&file).unwrap_err();
        assert!(
            e.message().contains("mode 644") && e.message().contains("chmod 600"),
            "{e}"
        );
        assert!(
            !e.message().contains("s3cret"),
            "the error leaks the secret: {e}"
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret_file(&file).unwrap(), b"s3cret");
        std::fs::write(&file, " \n").unwrap();
        let e = read_secret_file(&file).unwrap_err();
        assert!(e.message().contains("is empty"), "{e}");
        let e = read_secret_file(&dir.join("missing")).unwrap_err();
        assert!(e.message().contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
