//! [`FolderGrants`]: a worker's folder grants by plugin namespace, each
//! namespace's [`Folders`] opened once and shared.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cap_std::fs::Dir;
use wasmrpc_abi::RemoteError;

use super::{FolderGrant, Folders, OpenFolder, value_error};

/// A worker's folder grants, by plugin namespace: each namespace's
/// [`Folders`] are opened once and shared.
#[derive(Debug, Default, Clone)]
pub struct FolderGrants {
    by_namespace: HashMap<String, (Arc<Folders>, Arc<Folders>)>,
    specs: Vec<FolderGrant>,
}

impl FolderGrants {
    /// Opens every granted folder.
    ///
    /// # Errors
    /// `ValueError` for a host folder that does not exist or is not a
    /// folder, or two grants of one plugin under the same guest path.
    pub fn open(grants: Vec<FolderGrant>) -> Result<FolderGrants, RemoteError> {
        let mut operator: HashMap<String, Vec<OpenFolder>> = HashMap::new();
        let mut deployed: HashMap<String, Vec<OpenFolder>> = HashMap::new();
        for grant in &grants {
            let open = || -> Result<OpenFolder, RemoteError> {
                let dir = Dir::open_ambient_dir(&grant.host, cap_std::ambient_authority())
                    .map_err(|e| {
                        value_error(format!(
                            "--grant-dir {}: cannot open the folder {}: {e}",
                            grant.to_spec(),
                            grant.host.display()
                        ))
                    })?;
                Ok(OpenFolder {
                    grant: grant.clone(),
                    dir,
                    used: Mutex::new(None),
                })
            };
            let list = operator.entry(grant.namespace.clone()).or_default();
            if list.iter().any(|f| f.grant.guest == grant.guest) {
                return Err(value_error(format!(
                    "--grant-dir {}: plugin {} already has a folder at {}",
                    grant.to_spec(),
                    grant.namespace,
                    grant.guest
                )));
            }
            list.push(open()?);
            if grant.deployed {
                deployed
                    .entry(grant.namespace.clone())
                    .or_default()
                    .push(open()?);
            }
        }
        let mut by_namespace = HashMap::new();
        for (namespace, folders) in operator {
            let for_deployed = deployed.remove(&namespace).unwrap_or_default();
            by_namespace.insert(
                namespace,
                (
                    Arc::new(Folders { folders }),
                    Arc::new(Folders {
                        folders: for_deployed,
                    }),
                ),
            );
        }
        Ok(FolderGrants {
            by_namespace,
            specs: grants,
        })
    }

    /// The folders of plugin `namespace`: all its grants for a plugin the
    /// operator loaded, those marked `deployed` for one deployed at run
    /// time (FG-1); `None` when it has none.
    pub fn for_plugin(&self, namespace: &str, deployed: bool) -> Option<Arc<Folders>> {
        let (operator, for_deployed) = self.by_namespace.get(namespace)?;
        let folders = if deployed { for_deployed } else { operator };
        (!folders.is_empty()).then(|| folders.clone())
    }

    /// The grants, as given.
    pub fn grants(&self) -> &[FolderGrant] {
        &self.specs
    }
}
