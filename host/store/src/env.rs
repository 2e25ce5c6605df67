//! Environment helpers of `torch.distributed`: the node-local rank
//! (`LOCAL_RANK`) and the debug level (`TORCH_DISTRIBUTED_DEBUG`).
//!
//! Every function that reads the environment has a `_with` variant taking an
//! [`EnvLookup`], so tests (and hosts that read configuration elsewhere) can
//! supply variables without touching the process environment.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::store::{Error, Result};

/// Looks up an environment variable by name; `None` when unset.
pub type EnvLookup<'a> = &'a (dyn Fn(&str) -> Option<String> + Sync);

/// Reads the process environment (non-UTF-8 values count as unset).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// PyTorch's error text when `LOCAL_RANK` is unset and no fallback is given.
pub const LOCAL_RANK_MISSING: &str = "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow `get_node_local_rank` to work, assuming you are not running in a multi-device context and want the code to run locally instead.";

/// The local rank of this process on its node: `LOCAL_RANK` if set, else
/// `fallback_rank` (PyTorch's `get_node_local_rank`).
///
/// # Errors
/// [`Error::Runtime`] with [`LOCAL_RANK_MISSING`] when neither is there;
/// [`Error::InvalidArgument`] when `LOCAL_RANK` is not an integer.
pub fn get_node_local_rank(fallback_rank: Option<i64>) -> Result<i64> {
    get_node_local_rank_with(fallback_rank, &process_env)
}

/// [`get_node_local_rank`] reading variables through `env`.
///
/// # Errors
/// As [`get_node_local_rank`].
pub fn get_node_local_rank_with(fallback_rank: Option<i64>, env: EnvLookup<'_>) -> Result<i64> {
    match (env("LOCAL_RANK"), fallback_rank) {
        (Some(value), _) => parse_int(&value),
        (None, Some(fallback)) => Ok(fallback),
        (None, None) => Err(Error::Runtime(LOCAL_RANK_MISSING.to_owned())),
    }
}

/// Parses an integer as Python's `int(text)` does (surrounding whitespace,
/// a sign, underscores between digits), with Python's `ValueError` text.
pub(crate) fn parse_int(text: &str) -> Result<i64> {
    let trimmed = text.trim();
    let digits = trimmed.trim_start_matches(['+', '-']);
    let well_formed = trimmed.len() - digits.len() <= 1
        && !digits.is_empty()
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && digits.chars().all(|c| c.is_ascii_digit() || c == '_');
    let parsed = if well_formed {
        trimmed.replace('_', "").parse::<i64>().ok()
    } else {
        None
    };
    parsed.ok_or_else(|| {
        Error::InvalidArgument(format!("invalid literal for int() with base 10: '{text}'"))
    })
}

/// PyTorch's error text for a bad `TORCH_DISTRIBUTED_DEBUG`.
pub const DEBUG_LEVEL_INVALID: &str =
    "The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, or DETAIL.";

/// How much `torch.distributed` checks and logs (`TORCH_DISTRIBUTED_DEBUG`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum DebugLevel {
    /// No extra checks (the default).
    #[default]
    Off,
    /// Extra logging.
    Info,
    /// Extra logging and consistency checks.
    Detail,
}

impl DebugLevel {
    /// Parses a value case-insensitively: `OFF`, `INFO` or `DETAIL`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (PyTorch's `ValueError`) with
    /// [`DEBUG_LEVEL_INVALID`] for anything else.
    pub fn parse(value: &str) -> Result<Self> {
        match value.to_ascii_uppercase().as_str() {
            "OFF" => Ok(DebugLevel::Off),
            "INFO" => Ok(DebugLevel::Info),
            "DETAIL" => Ok(DebugLevel::Detail),
            _ => Err(Error::InvalidArgument(DEBUG_LEVEL_INVALID.to_owned())),
        }
    }

    /// The level `TORCH_DISTRIBUTED_DEBUG` asks for; unset means
    /// [`DebugLevel::Off`].
    ///
    /// # Errors
    /// As [`DebugLevel::parse`].
    pub fn from_env_with(env: EnvLookup<'_>) -> Result<Self> {
        env("TORCH_DISTRIBUTED_DEBUG").map_or(Ok(DebugLevel::Off), |v| Self::parse(&v))
    }

    fn code(self) -> u8 {
        match self {
            DebugLevel::Off => 0,
            DebugLevel::Info => 1,
            DebugLevel::Detail => 2,
        }
    }

    fn from_code(code: u8) -> Self {
        match code {
            1 => DebugLevel::Info,
            2 => DebugLevel::Detail,
            _ => DebugLevel::Off,
        }
    }
}

static DEBUG_LEVEL: AtomicU8 = AtomicU8::new(0);

/// The process-wide debug level (PyTorch's `get_debug_level`).
pub fn get_debug_level() -> DebugLevel {
    DebugLevel::from_code(DEBUG_LEVEL.load(Ordering::Relaxed))
}

/// Sets the process-wide debug level.
pub fn set_debug_level(level: DebugLevel) {
    DEBUG_LEVEL.store(level.code(), Ordering::Relaxed);
}

/// Sets the process-wide debug level from `TORCH_DISTRIBUTED_DEBUG`
/// (PyTorch's `set_debug_level_from_env`) and returns it.
///
/// # Errors
/// As [`DebugLevel::parse`]; the level is then left unchanged.
pub fn set_debug_level_from_env() -> Result<DebugLevel> {
    set_debug_level_from_env_with(&process_env)
}

/// [`set_debug_level_from_env`] reading variables through `env`.
///
/// # Errors
/// As [`DebugLevel::parse`].
pub fn set_debug_level_from_env_with(env: EnvLookup<'_>) -> Result<DebugLevel> {
    let level = DebugLevel::from_env_with(env)?;
    set_debug_level(level);
    Ok(level)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_parse_like_python() {
        assert_eq!(parse_int("3").unwrap(), 3);
        assert_eq!(parse_int(" -2 ").unwrap(), -2);
        assert_eq!(parse_int("1_000").unwrap(), 1000);
        for bad in ["", "x", "1.5", "--1", "_1", "1__0"] {
            let err = parse_int(bad).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("invalid literal for int() with base 10: '{bad}'")
            );
        }
    }

    #[test]
    fn debug_levels_parse_case_insensitively() {
        assert_eq!(DebugLevel::parse("dEtAiL").unwrap(), DebugLevel::Detail);
        assert_eq!(
            DebugLevel::parse("1").unwrap_err().to_string(),
            DEBUG_LEVEL_INVALID
        );
    }
}
