//! The credential flags of `wasmrpc worker` and `wasmrpc plugin deploy`:
//! where a process gets the TLS credentials or the cluster secret it
//! authenticates its connections with. Credentials come from the operator only (a file only
//! its owner can read, or the environment), never from the store and never
//! from the command line, which every local user can read in `/proc`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use wasmrpc::RpcBackendOptions;

/// Credential flags shared by the commands that join a group.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct CredentialArgs {
    /// Read the cluster secret from this file (every worker of the group
    /// needs the same one; surrounding whitespace is ignored). The file must
    /// not be readable by group or others (`chmod 600 FILE`). Without it,
    /// the WASMRPC_CLUSTER_SECRET variable is used if set. Create one with
    /// `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`.
    #[arg(
        long,
        value_name = "FILE",
        env = "WASMRPC_CLUSTER_SECRET_FILE",
        hide_env_values = true
    )]
    cluster_secret_file: Option<PathBuf>,
    /// Run unauthenticated on a non-loopback address when no credentials
    /// are given (anyone who can reach the port can call this worker).
    /// Without credentials and without this flag, such a worker refuses to
    /// start; on a loopback address it runs unauthenticated with a warning.
    #[arg(long)]
    insecure: bool,
    /// TLS: the cluster CA's certificate (PEM; `wasmrpc cert init`). With
    /// --tls-cert and --tls-key, every connection is TLS 1.3 with mutual
    /// authentication, and peers must present a certificate of this CA
    /// naming the worker they claim to be.
    #[arg(
        long,
        value_name = "FILE",
        env = "WASMRPC_TLS_CA",
        requires_all = ["tls_cert", "tls_key"]
    )]
    tls_ca: Option<PathBuf>,
    /// TLS: this worker's certificate (PEM; `wasmrpc cert issue NAME`). It
    /// must name this worker. `{name}` in the path is replaced by the
    /// worker's name, so one setting serves every worker of a machine
    /// (e.g. under torchrun: `certs/{name}.pem`).
    #[arg(
        long,
        value_name = "FILE",
        env = "WASMRPC_TLS_CERT",
        requires_all = ["tls_ca", "tls_key"]
    )]
    tls_cert: Option<PathBuf>,
    /// TLS: this worker's private key (PEM), readable by its owner only.
    /// `{name}` in the path is replaced by the worker's name.
    #[arg(
        long,
        value_name = "FILE",
        env = "WASMRPC_TLS_KEY",
        requires_all = ["tls_ca", "tls_cert"]
    )]
    tls_key: Option<PathBuf>,
}

impl CredentialArgs {
    /// Puts these credentials into `options`, for worker `name` when known
    /// (it replaces `{name}` in the TLS paths).
    ///
    /// # Errors
    /// A secret file that cannot be read, is readable by group or others,
    /// or is empty; a TLS path with `{name}` when the name is not known;
    /// TLS files that cannot be read or used.
    pub(crate) fn apply(&self, options: &mut RpcBackendOptions, name: Option<&str>) -> Result<()> {
        if let Some(file) = &self.cluster_secret_file {
            options.cluster_secret = Some(read_secret_file(file)?);
        }
        options.insecure = self.insecure;
        if let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            let expand = |path: &Path| -> Result<PathBuf> {
                let text = path.to_string_lossy();
                if !text.contains("{name}") {
                    return Ok(path.to_path_buf());
                }
                match name {
                    Some(name) => Ok(PathBuf::from(text.replace("{name}", name))),
                    None => bail!(
                        "{} names the worker ({{name}}) but the worker's name is not known \
                         before the rendezvous: give --name or --rank (or RANK)",
                        path.display()
                    ),
                }
            };
            options.tls = Some(wasmrpc::TlsCredentials::from_files(
                ca,
                expand(cert)?,
                expand(key)?,
            )?);
        }
        Ok(())
    }
}

/// Reads a credential file that only its owner may read.
///
/// # Errors
/// The file cannot be read, is readable by group or others, or holds
/// nothing but whitespace.
pub(crate) fn read_secret_file(file: &Path) -> Result<Vec<u8>> {
    check_private(file)?;
    let bytes = std::fs::read(file)
        .with_context(|| format!("cannot read the secret file {}", file.display()))?;
    let secret = bytes.trim_ascii();
    if secret.is_empty() {
        bail!("the secret file {} is empty", file.display());
    }
    Ok(secret.to_vec())
}

/// Fails unless `file` is readable by its owner only.
///
/// # Errors
/// The file's metadata cannot be read, or group or others may read or
/// write it.
pub(crate) fn check_private(file: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file)
        .with_context(|| format!("cannot read {}", file.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        bail!(
            "{} is accessible to group or others (mode {:o}); credentials must be readable by \
             their owner only: run `chmod 600 {}`",
            file.display(),
            mode & 0o777,
            file.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_readable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, "s3cret\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_secret_file(&file).unwrap_err().to_string();
        assert!(e.contains("mode 644") && e.contains("chmod 600"), "{e}");
        assert!(!e.contains("s3cret"), "the error leaks the secret: {e}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret_file(&file).unwrap(), b"s3cret");
        std::fs::write(&file, " \n").unwrap();
        let e = read_secret_file(&file).unwrap_err().to_string();
        assert!(e.contains("is empty"), "{e}");
    }
}
