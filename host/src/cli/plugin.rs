//! `wasmrpc plugin`: tools for plugin files. `inspect` prints a plugin's
//! manifest (what the guest SDK's macros wrote into the module) without
//! compiling it: its name and the namespace its functions are served under,
//! version, protocol version, sha256, and every export with its kind and
//! parameters.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use wasmrpc::wasm::manifest;

/// Flags of `wasmrpc plugin`.
#[derive(clap::Args, Debug)]
pub(crate) struct PluginArgs {
    #[command(subcommand)]
    command: PluginCommand,
}

#[derive(clap::Subcommand, Debug)]
enum PluginCommand {
    /// Print a plugin's manifest: name, version, sha256, and its exports
    /// with their kind and parameters.
    Inspect {
        /// The plugin's `.wasm` file.
        file: PathBuf,
    },
}

/// Runs a `plugin` subcommand.
pub(crate) fn run(args: PluginArgs) -> Result<ExitCode> {
    match args.command {
        PluginCommand::Inspect { file } => {
            print!("{}", inspect(&file)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The report `inspect` prints: the manifest as the runtime describes it,
/// then the namespace the functions are served under and the sha256.
fn inspect(file: &PathBuf) -> Result<String> {
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let m = manifest::read(&bytes)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{} is not a wasmrpc plugin", file.display()))?;
    let namespace = wasmrpc::plugin_namespace(&m.name);
    let sha256: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut out = manifest::describe(&m);
    if !m.abi_matches() {
        out.push_str("this host speaks another protocol version and cannot load it\n");
    }
    out.push_str(&format!(
        "namespace: {namespace} (functions are served as {namespace}::<fn>; classes need RRefs and are not served yet)\n"
    ));
    out.push_str(&format!("sha256:    {sha256}\n"));
    Ok(out)
}
