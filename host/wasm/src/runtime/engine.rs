//! The wasmtime engine's configuration: what every plugin of a runtime is
//! compiled and instantiated with (epoch interruption, the component
//! model, the pooling allocator's sizes, and perf's map when asked for).

use super::Config;
use crate::{Error, Result};
use wasmtime::{InstanceAllocationStrategy, PoolingAllocationConfig};

/// The environment variable that, set to `1`, has the engine write
/// `/tmp/perf-PID.map`, naming every compiled plugin function (CPython's
/// own, in a Python plugin) to `perf report`. A profiling aid: the map of a
/// Python plugin is some 20 MB, written at each load.
pub const PERF_MAP_VAR: &str = "WASMRPC_PERF_MAP";

/// Whether [`PERF_MAP_VAR`] asks for perf's map: `1` yes; unset, empty or
/// `0` no; anything else is refused, naming the variable, rather than
/// read as either.
fn perf_map_wanted() -> Result<bool> {
    match std::env::var_os(PERF_MAP_VAR) {
        None => Ok(false),
        Some(v) if v == "1" => Ok(true),
        Some(v) if v.is_empty() || v == "0" => Ok(false),
        Some(v) => Err(Error::Engine(format!(
            "{PERF_MAP_VAR} must be 1 (write /tmp/perf-PID.map for perf) or 0, not {v:?}"
        ))),
    }
}

/// The engine's configuration for a runtime configured as `config`.
pub(super) fn config(config: &Config) -> Result<wasmtime::Config> {
    let mut wc = wasmtime::Config::new();
    wc.epoch_interruption(true).wasm_component_model(true);
    if perf_map_wanted()? {
        // Names the plugins' compiled functions to `perf` (a map file
        // per process in /tmp): without it a profile of a plugin's call
        // path is a wall of anonymous JIT addresses.
        wc.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    if config.pooling {
        let mut pool = PoolingAllocationConfig::default();
        pool.total_core_instances(config.max_instances)
            .total_memories(config.max_instances)
            .total_tables(config.max_instances)
            .total_stacks(config.max_instances)
            .max_memory_size(config.max_memory)
            // A Python component (CPython and its WASI adapter) is a
            // few dozen core instances with their tables.
            .total_component_instances(config.max_instances)
            .max_core_instances_per_component(64)
            .max_memories_per_component(8)
            .max_tables_per_component(64)
            .max_core_instance_size(16 << 20)
            .max_component_instance_size(16 << 20)
            .table_elements(1 << 16);
        wc.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    }
    Ok(wc)
}

/// A number that two engines share exactly when code one compiled loads
/// into the other (wasmtime's precompile compatibility hash).
pub(super) fn compatibility(engine: &wasmtime::Engine) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    hasher.finish()
}

/// An engine for one compile, like `runtime` (configured as `config`) but
/// without the pooling allocator, which a compile does not use. Wasmtime's
/// Cranelift keeps the contexts it compiled with, grown to the largest
/// function, for its engine's life: compiled in the runtime's own engine, a
/// Python component left 60-65 MiB of them in every worker that compiled it.
/// Compiled here, they go with this engine, and the code loads into
/// `runtime` from its serialized form. Should leaving the pool out ever
/// change the compatibility hash, the pool stays in.
pub(super) fn compiling_engine(
    config: &Config,
    runtime: &wasmtime::Engine,
) -> Result<wasmtime::Engine> {
    let without_pool = engine_without_pool(config)?;
    if compatibility(&without_pool) == compatibility(runtime) {
        return Ok(without_pool);
    }
    new_engine(config)
}

/// An engine configured as `config`, but without the pooling allocator:
/// what a compile needs, in this process or in a helper (`helper`).
pub(super) fn engine_without_pool(config: &Config) -> Result<wasmtime::Engine> {
    new_engine(&Config {
        pooling: false,
        ..config.clone()
    })
}

fn new_engine(config: &Config) -> Result<wasmtime::Engine> {
    wasmtime::Engine::new(&self::config(config)?).map_err(|e| Error::Engine(format!("{e:#}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With the default config (pooling on) the compiling engine leaves the
    /// pool out, and what it compiles loads into the runtime's engine. A
    /// wasmtime whose hash counted the allocator would fail the first
    /// assertion (compiles would then keep the pool's reservation).
    #[test]
    fn a_compiling_engine_compiles_for_the_runtime_without_its_pool() {
        let config = Config::default();
        assert!(config.pooling);
        let engine = |config: &Config| wasmtime::Engine::new(&self::config(config).unwrap());
        let runtime = engine(&config).unwrap();
        let without_pool = engine(&Config {
            pooling: false,
            ..config.clone()
        })
        .unwrap();
        assert_eq!(
            compatibility(&without_pool),
            compatibility(&runtime),
            "leaving the pool out changed the compatibility hash"
        );

        let compiling = compiling_engine(&config, &runtime).unwrap();
        let empty_module = b"\0asm\x01\0\0\0";
        let compiled = wasmtime::Module::new(&compiling, empty_module).unwrap();
        let serialized = compiled.serialize().unwrap();
        drop((compiled, compiling));
        // SAFETY: the bytes are wasmtime's own serialization, just made.
        unsafe { wasmtime::Module::deserialize(&runtime, &serialized) }.unwrap();
    }
}
