//! What a worker's plugins are doing, as numbers for `get_debug_info` and
//! so for metrics: the plugins it serves, the calls running on them, their
//! objects alive, the warm instances waiting in their pools, and how many
//! of them this process compiled rather than read from the disk cache.
//! The keys are the agent's (`agent.plugin_*`, exported as
//! `wasmrpc_agent_plugin_*` gauges), as a PyTorch agent reports its
//! backend's numbers beside the RRef and autograd ones.
//!
//! It reads what the registry and the version table already hold and
//! changes nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use wasmrpc_wasm::{LoadSource, Plugin};

use super::class::PluginClass;
use super::function::PluginFunction;
use super::versions::{Usage, Versions};
use crate::agent::RpcAgent;

/// Every plugin `agent` serves, once each, with the use counts of each
/// version scope it is served in: those registered in its registry (at
/// start-up) and those in its version table (deployed).
fn served(agent: &RpcAgent) -> (Vec<Arc<Plugin>>, Vec<Arc<Usage>>) {
    let mut pairs = agent.state::<Versions>().usages();
    let registry = agent.registry();
    for name in registry.names() {
        let Some(f) = registry.get(&name) else {
            continue;
        };
        let any: &dyn std::any::Any = f.as_ref();
        let served = any
            .downcast_ref::<PluginFunction>()
            .map(PluginFunction::served)
            .or_else(|| any.downcast_ref::<PluginClass>().map(PluginClass::served));
        if let Some((plugin, scope)) = served {
            pairs.push((plugin.clone(), scope.usage.clone()));
        }
    }
    let mut plugins: Vec<Arc<Plugin>> = Vec::new();
    let mut usages: Vec<Arc<Usage>> = Vec::new();
    for (plugin, usage) in pairs {
        if !plugins.iter().any(|p| Arc::ptr_eq(p, &plugin)) {
            plugins.push(plugin);
        }
        if !usages.iter().any(|u| Arc::ptr_eq(u, &usage)) {
            usages.push(usage);
        }
    }
    (plugins, usages)
}

/// The plugins' entries of `get_debug_info`.
pub(crate) fn debug_info(agent: &RpcAgent) -> BTreeMap<String, String> {
    let (plugins, usages) = served(agent);
    let (calls, objects) = usages
        .iter()
        .map(|u| u.counts())
        .fold((0, 0), |(c, o), (dc, doo)| (c + dc, o + doo));
    let idle: usize = plugins.iter().map(|p| p.idle_instances()).sum();
    let compiled = plugins
        .iter()
        .filter(|p| p.source() == LoadSource::Compiled)
        .count();
    [
        ("agent.plugin_served", plugins.len()),
        ("agent.plugin_calls_in_flight", calls),
        ("agent.plugin_objects", objects),
        ("agent.plugin_idle_instances", idle),
        ("agent.plugin_compiled_here", compiled),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_owned(), n.to_string()))
    .collect()
}
