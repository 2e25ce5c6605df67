//! Folder grants on the command line: `--grant-dir` and `--grant-file`,
//! defined once for `worker` and `launch` (which passes them to every
//! worker it starts), so both read grants the same way
//! ([`wasmrpc::wasm::FolderGrant::parse`]).

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use wasmrpc::wasm::{FolderGrant, FolderGrants};

/// The folder grant flags of `worker` and `launch`.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct FolderGrantArgs {
    /// Grant plugin NAMESPACE the host folder HOST under the guest path
    /// /GUEST: `NAMESPACE:/GUEST=HOST[:ro|:rw][,quota=SIZE][,deployed]`,
    /// read-only unless `:rw` (e.g. `param_server:/data=/srv/digits:ro`,
    /// `param_server:/ckpt=/srv/ckpt:rw,quota=1G`). A plugin reaches no
    /// file without one; `..`, absolute paths and symlinks out of the folder
    /// are refused. `deployed`: a plugin of that namespace deployed at run
    /// time gets it too (by default only one the operator loaded).
    /// Repeatable.
    #[arg(long = "grant-dir", value_name = "SPEC", value_parser = parse_grant)]
    grants: Vec<FolderGrant>,
    /// Read more grants from FILE: one `--grant-dir` SPEC a line, `#`
    /// comments.
    #[arg(long = "grant-file", value_name = "FILE")]
    grant_file: Option<PathBuf>,
}

fn parse_grant(spec: &str) -> std::result::Result<FolderGrant, String> {
    FolderGrant::parse(spec).map_err(|e| e.message)
}

impl FolderGrantArgs {
    /// Every grant the flags and the file name, host folders made absolute.
    ///
    /// # Errors
    /// An unreadable grant file, or a bad line in it (with its line).
    pub(crate) fn grants(&self) -> Result<Vec<FolderGrant>> {
        let mut grants = Vec::new();
        if let Some(file) = &self.grant_file {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read the grant file {}", file.display()))?;
            for (n, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or("").trim();
                if line.is_empty() {
                    continue;
                }
                let grant = FolderGrant::parse(line)
                    .map_err(|e| anyhow!("{}:{}: {}", file.display(), n + 1, e.message))?;
                grants.push(grant);
            }
        }
        grants.extend(self.grants.iter().cloned());
        for grant in &mut grants {
            grant.host = std::path::absolute(&grant.host)
                .with_context(|| format!("bad host folder {}", grant.host.display()))?;
        }
        Ok(grants)
    }

    /// The grants, opened: every host folder must exist.
    ///
    /// # Errors
    /// As [`grants`](Self::grants), or a folder that cannot be opened.
    pub(crate) fn open(&self) -> Result<FolderGrants> {
        FolderGrants::open(self.grants()?).map_err(|e| anyhow!(e.message))
    }

    /// The same grants for a child `wasmrpc worker`, as `--grant-dir` flags.
    ///
    /// # Errors
    /// As [`grants`](Self::grants).
    pub(crate) fn child_args(&self) -> Result<Vec<OsString>> {
        Ok(self
            .grants()?
            .iter()
            .flat_map(|g| ["--grant-dir".into(), g.to_spec().into()])
            .collect())
    }
}
