//! The credential flags of `wasmrpc worker` and `wasmrpc plugin deploy`:
//! where a process gets the TLS credentials or the cluster secret it
//! authenticates its connections with. Credentials come from the operator only (a file only
//! its owner can read, or the environment), never from the store and never
//! from the command line, which every local user can read in `/proc`.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
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

/// Reads the cluster secret from a file only its owner may read.
///
/// # Errors
/// As [`wasmrpc_credentials::secret::read_secret_file`].
fn read_secret_file(file: &Path) -> Result<Vec<u8>> {
    Ok(wasmrpc_credentials::secret::read_secret_file(file)?)
}

/// Fails unless `file` is readable by its owner only.
///
/// # Errors
/// As [`wasmrpc_credentials::secret::check_private`].
pub(crate) fn check_private(file: &Path) -> Result<()> {
    Ok(wasmrpc_credentials::secret::check_private(file)?)
}
