//! Worker identity: names by PyTorch's rules, and [`WorkerInfo`]s made
//! from them. Shared by the agent (`init_rpc`, `get_worker_info`) and the
//! transport (a certificate names its worker).

use crate::abi::WorkerInfo;
use crate::error::{Error, MAX_NAME_LEN, Result, invalid_worker_name_message};

/// Checks a worker name against PyTorch's rule: 1 to 127 characters among
/// `[A-Za-z0-9-_:]`.
///
/// # Errors
/// `RuntimeError` "Worker name must match ..." otherwise.
pub fn validate_worker_name(name: &str) -> Result<()> {
    let valid_size = !name.is_empty() && name.len() < MAX_NAME_LEN;
    let valid_chars = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == ':');
    if valid_size && valid_chars {
        Ok(())
    } else {
        Err(Error::runtime(invalid_worker_name_message(name)))
    }
}

/// Builds a `WorkerInfo`, checking the name as PyTorch's constructor does.
///
/// # Errors
/// `RuntimeError` for an invalid name.
pub fn worker_info(name: &str, id: u32) -> Result<WorkerInfo> {
    validate_worker_name(name)?;
    Ok(WorkerInfo {
        id,
        name: name.into(),
    })
}
