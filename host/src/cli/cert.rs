//! `wasmrpc cert`: the files of a cluster's TLS credentials. `init` makes a
//! cluster CA (`ca.pem`, `ca.key`); `issue NAME` makes worker NAME's
//! certificate and key (`NAME.pem`, `NAME.key`), signed by that CA and
//! naming the worker, so no other worker can present it as its own. Keys
//! are written readable by their owner only, and existing files are never
//! overwritten.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use wasmrpc::CertificateAuthority;

/// Flags of `wasmrpc cert`.
#[derive(clap::Args, Debug)]
pub(crate) struct CertArgs {
    #[command(subcommand)]
    command: CertCommand,
}

#[derive(clap::Subcommand, Debug)]
enum CertCommand {
    /// Create a cluster certificate authority: DIR/ca.pem (the certificate
    /// every worker is given with --tls-ca) and DIR/ca.key (its private
    /// key, mode 0600: keep it off the workers, it only issues).
    Init {
        /// The folder to write ca.pem and ca.key to (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Issue worker NAME a certificate signed by the cluster CA, naming
    /// it: DIR/NAME.pem (--tls-cert) and DIR/NAME.key (--tls-key, mode
    /// 0600). A worker must run under the name its certificate gives
    /// (`wasmrpc worker --name NAME`, or worker<RANK> by default); peers
    /// refuse a worker that announces another name. Start the worker with
    /// `--tls-ca CA_DIR/ca.pem --tls-cert DIR/NAME.pem --tls-key
    /// DIR/NAME.key` (or WASMRPC_TLS_CA, WASMRPC_TLS_CERT, WASMRPC_TLS_KEY,
    /// e.g. from a mounted Kubernetes secret).
    Issue {
        /// The worker's name (as `wasmrpc worker --name`).
        name: String,
        /// The folder `cert init` wrote ca.pem and ca.key to.
        #[arg(long, value_name = "DIR")]
        ca: PathBuf,
        /// The folder to write NAME.pem and NAME.key to (created if
        /// missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

/// Runs a `cert` subcommand.
pub(crate) fn run(args: CertArgs) -> Result<ExitCode> {
    match args.command {
        CertCommand::Init { out } => {
            let ca = CertificateAuthority::generate()?;
            create_dir(&out)?;
            let (cert, key) = (out.join("ca.pem"), out.join("ca.key"));
            write_new(&key, ca.key_pem().as_bytes(), 0o600)?;
            write_new(&cert, ca.cert_pem().as_bytes(), 0o644)?;
            println!(
                "cluster CA: {} (give it to every worker) and {} (private: it issues \
                 certificates)",
                cert.display(),
                key.display()
            );
        }
        CertCommand::Issue { name, ca, out } => {
            wasmrpc::validate_worker_name(&name)
                .with_context(|| format!("cannot issue a certificate for {name:?}"))?;
            let authority = read_authority(&ca)?;
            let ca_cert = ca.join("ca.pem");
            let (cert_pem, key_pem) = authority.issue(&name)?;
            create_dir(&out)?;
            let (cert, key) = (
                out.join(format!("{name}.pem")),
                out.join(format!("{name}.key")),
            );
            write_new(&key, key_pem.as_bytes(), 0o600)?;
            write_new(&cert, cert_pem.as_bytes(), 0o644)?;
            println!(
                "worker {name}: {} and {} (start it with --name {name} --tls-ca {} --tls-cert {} \
                 --tls-key {})",
                cert.display(),
                key.display(),
                ca_cert.display(),
                cert.display(),
                key.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The cluster CA `cert init` wrote to `dir` (`ca.pem`, and `ca.key`,
/// which must be readable by its owner only).
pub(crate) fn read_authority(dir: &Path) -> Result<CertificateAuthority> {
    let (ca_cert, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    super::credentials::check_private(&ca_key)?;
    let read = |p: &Path| {
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
    };
    CertificateAuthority::from_pem(&read(&ca_cert)?, &read(&ca_key)?)
        .with_context(|| format!("{} and {}", ca_cert.display(), ca_key.display()))
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

/// Writes a file that must not exist yet, with `mode` from the start (a
/// key is never readable by others, not even for a moment).
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot create {} (it must not exist yet)", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}
