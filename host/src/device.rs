//! Devices and device maps (`TensorPipeRpcBackendOptions.set_device_map`,
//! `devices`): parsing device specs, the set-time checks of
//! `set_device_map`, the init-time validation of every worker's maps
//! (PyTorch's `_validate_device_maps` over the all-gathered maps), the
//! reverse maps responses use, and choosing the device each tensor of a
//! message lands on (`getDevicesForRemote`).
//!
//! It owns no tensors and no sockets: the wire layer (`tensor::wire`) moves
//! tensors to the devices chosen here, rendezvous publishes and gathers the
//! maps, and the agent asks for a message's devices before it encodes it.
//!
//! CUDA here is only as real as libtorch's build and what this process
//! loaded: libtorch's CUDA library is loaded at run time where a device is
//! present ([`load_cuda`], `wasmrpc_torch_sys::cuda`); without it, or on a
//! machine without GPUs, the device count is 0, every `cuda:N` is an
//! invalid index, and init refuses any map that names one.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A device a tensor can live on: the CPU or one CUDA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// CUDA device `index`.
    Cuda(u32),
}

impl Device {
    /// The `tch` device.
    pub fn to_tch(self) -> tch::Device {
        match self {
            Device::Cpu => tch::Device::Cpu,
            Device::Cuda(i) => tch::Device::Cuda(i as usize),
        }
    }

    /// The device of a `tch` tensor, or an error for devices RPC does not
    /// know (MPS, Vulkan).
    ///
    /// # Errors
    /// `RuntimeError` for devices other than the CPU and CUDA.
    pub fn from_tch(d: tch::Device) -> Result<Self> {
        match d {
            tch::Device::Cpu => Ok(Device::Cpu),
            tch::Device::Cuda(i) => {
                Ok(Device::Cuda(u32::try_from(i).map_err(|_| {
                    Error::runtime(format!("CUDA device index {i} out of range"))
                })?))
            }
            other => Err(Error::runtime(format!(
                "RPC supports CPU and CUDA tensors only, got a tensor on {other:?}"
            ))),
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Something that names a device, as `torch.device(...)` accepts: an index
/// (a CUDA device), `"cpu"`, `"cuda"`, `"cuda:N"`, or a [`Device`].
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceSpec {
    /// An index: `cuda:index`. Negative indices are refused.
    Index(i64),
    /// A device string.
    Str(String),
    /// A parsed device.
    Device(Device),
}

impl From<i64> for DeviceSpec {
    fn from(v: i64) -> Self {
        DeviceSpec::Index(v)
    }
}
impl From<i32> for DeviceSpec {
    fn from(v: i32) -> Self {
        DeviceSpec::Index(v.into())
    }
}
impl From<u32> for DeviceSpec {
    fn from(v: u32) -> Self {
        DeviceSpec::Index(v.into())
    }
}
impl From<usize> for DeviceSpec {
    fn from(v: usize) -> Self {
        DeviceSpec::Index(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<&str> for DeviceSpec {
    fn from(v: &str) -> Self {
        DeviceSpec::Str(v.into())
    }
}
impl From<String> for DeviceSpec {
    fn from(v: String) -> Self {
        DeviceSpec::Str(v)
    }
}
impl From<Device> for DeviceSpec {
    fn from(v: Device) -> Self {
        DeviceSpec::Device(v)
    }
}
impl From<tch::Device> for DeviceSpec {
    fn from(v: tch::Device) -> Self {
        match v {
            tch::Device::Cuda(i) => DeviceSpec::Index(i64::try_from(i).unwrap_or(i64::MAX)),
            tch::Device::Cpu => DeviceSpec::Device(Device::Cpu),
            other => DeviceSpec::Str(format!("{other:?}").to_lowercase()),
        }
    }
}

const NEGATIVE_INDEX: &str = "Device index must not be negative";

fn index(i: i64) -> Result<u32> {
    if i < 0 {
        return Err(Error::runtime(NEGATIVE_INDEX));
    }
    u32::try_from(i).map_err(|_| Error::runtime(format!("Device index {i} is out of range")))
}

/// The device types c10 knows, in the order of its error text.
const DEVICE_TYPES: &str = "cpu, cuda, ipu, xpu, mkldnn, opengl, opencl, ideep, hip, ve, fpga, \
                            maia, xla, lazy, vulkan, mps, meta, hpu, mtia, privateuseone";

/// Checks a device string as c10 does before `torch.device(s)` accepts it
/// (`type` or `type:index`, a known type, a decimal index without leading
/// zeros), and returns its type and index. Any c10 device type passes,
/// not only the ones RPC moves tensors to (see [`parse_device`]).
///
/// # Errors
/// `RuntimeError` with c10's texts: "Device string must not be empty",
/// "Invalid device string: 'cpu2'", "Expected one of cpu, cuda, ... device
/// type at start of device string: foo".
pub fn check_device_string(s: &str) -> Result<(&str, Option<u32>)> {
    if s.is_empty() {
        return Err(Error::runtime("Device string must not be empty"));
    }
    let (ty, index) = match s.split_once(':') {
        Some((t, i)) => (t, Some(i)),
        None => (s, None),
    };
    let ty_ok = !ty.is_empty() && ty.chars().all(|c| c.is_ascii_alphabetic() || c == '_');
    let index = match index {
        None => None,
        Some(i)
            if !i.is_empty()
                && i.chars().all(|c| c.is_ascii_digit())
                && (i == "0" || !i.starts_with('0')) =>
        {
            Some(
                i.parse::<u32>()
                    .map_err(|_| Error::runtime(format!("Device index {i} is out of range")))?,
            )
        }
        Some(_) => return Err(Error::runtime(format!("Invalid device string: '{s}'"))),
    };
    if !ty_ok {
        return Err(Error::runtime(format!("Invalid device string: '{s}'")));
    }
    if !DEVICE_TYPES.split(", ").any(|t| t == ty) {
        return Err(Error::runtime(format!(
            "Expected one of {DEVICE_TYPES} device type at start of device string: {ty}"
        )));
    }
    Ok((ty, index))
}

/// Parses a device spec as `torch.device(spec)` does, for the devices RPC
/// knows (the CPU and CUDA).
///
/// # Errors
/// `RuntimeError` "Device index must not be negative" for negative indices
/// (`-1`, `"cuda:-1"`), the c10 texts of [`check_device_string`] for
/// malformed strings, and "RPC supports CPU and CUDA devices only" for
/// other device types (`meta`, `mps`).
pub fn parse_device(spec: impl Into<DeviceSpec>) -> Result<Device> {
    match spec.into() {
        DeviceSpec::Device(d) => Ok(d),
        DeviceSpec::Index(i) => Ok(Device::Cuda(index(i)?)),
        DeviceSpec::Str(s) => {
            let s = s.trim();
            // `cpu:-1` is torch's own spelling of the CPU; other negative
            // indices get the text of the integer form.
            match s.split_once(':') {
                Some(("cpu", "-1")) => return Ok(Device::Cpu),
                Some((_, i))
                    if i.starts_with('-') && i[1..].chars().all(|c| c.is_ascii_digit()) =>
                {
                    return Err(Error::runtime(NEGATIVE_INDEX));
                }
                _ => {}
            }
            match check_device_string(s)? {
                ("cpu", None | Some(0)) => Ok(Device::Cpu),
                ("cpu", Some(i)) => Err(Error::runtime(format!(
                    "CPU device index must be -1 or zero, got {i}"
                ))),
                ("cuda", i) => Ok(Device::Cuda(i.unwrap_or(0))),
                _ => Err(Error::runtime(format!(
                    "RPC supports CPU and CUDA devices only, got {s}"
                ))),
            }
        }
    }
}

/// Whether this process has `device`, checked before any CUDA call: a CUDA
/// index at or past `torch.cuda.device_count()` is CUDA's own error,
/// raised here without touching the driver (the same text with or without
/// GPUs).
///
/// # Errors
/// `RuntimeError` "CUDA error: invalid device ordinal (cuda:N, this process
/// has M CUDA devices)".
pub fn check_available(device: Device) -> Result<()> {
    match device {
        Device::Cuda(i) if i >= cuda_device_count() => Err(Error::runtime(format!(
            "CUDA error: invalid device ordinal ({device}, this process has {} CUDA devices)",
            cuda_device_count()
        ))),
        _ => Ok(()),
    }
}

/// One destination's device map: local device → the destination's device.
pub type DeviceMap = BTreeMap<Device, Device>;

/// `_to_device_map`: parses a map given by the user, refusing two sources
/// mapped to one target.
///
/// # Errors
/// Parse errors of [`parse_device`]; `ValueError` "`device_map` only
/// supports 1-to-1 mapping, trying to map A and B to C".
pub fn to_device_map<K, V>(map: impl IntoIterator<Item = (K, V)>) -> Result<DeviceMap>
where
    K: Into<DeviceSpec>,
    V: Into<DeviceSpec>,
{
    let mut full = DeviceMap::new();
    let mut reverse: BTreeMap<Device, Device> = BTreeMap::new();
    for (k, v) in map {
        let (k, v) = (parse_device(k)?, parse_device(v)?);
        if let Some(prev) = reverse.get(&v) {
            return Err(Error::value(format!(
                "`device_map` only supports 1-to-1 mapping, trying to map {k} and {prev} to {v}"
            )));
        }
        full.insert(k, v);
        reverse.insert(v, k);
    }
    Ok(full)
}

/// What one worker publishes at init for the all-gather of device maps:
/// its CUDA device count, its `devices` option and its maps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// `torch.cuda.device_count()` on that worker.
    pub device_count: u32,
    /// Its `devices` option (empty: inferred from the maps).
    pub devices: Vec<Device>,
    /// Its device maps, by destination name.
    pub device_maps: BTreeMap<String, DeviceMap>,
}

impl DeviceInfo {
    /// This process's info for `options`.
    pub fn local(options: &crate::RpcBackendOptions) -> Self {
        DeviceInfo {
            device_count: cuda_device_count(),
            devices: options.devices.clone(),
            device_maps: options.device_maps.clone(),
        }
    }
}

/// Whether libtorch's CUDA side was loaded where this process can use it (a
/// CUDA build on a machine with a CUDA device, or `WASMRPC_LOAD_CUDA=1`):
/// the decision `wasmrpc_torch_sys::cuda` made when the process started,
/// logged once here. `wasmrpc worker` calls it first thing and `init_rpc`
/// again (a no-op then), so that a worker that should see a GPU and cannot
/// fails at start.
///
/// # Errors
/// `RuntimeError` when CUDA should be loaded (forced, or a device is
/// present) but cannot be, with why and how to run without it.
pub fn load_cuda() -> Result<()> {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    let status =
        wasmrpc_torch_sys::cuda::load().map_err(|e| Error::runtime(format!("CUDA: {e}")))?;
    LOGGED.call_once(|| {
        if status.loaded {
            tracing::info!(
                "CUDA loaded ({}; CUDA runtime {})",
                status.why,
                status.cudart_version.unwrap_or_default()
            );
        } else {
            tracing::info!("CUDA not loaded: {}", status.why);
        }
    });
    Ok(())
}

/// `torch.cuda.device_count()`: 0 with a CPU libtorch, or where CUDA was
/// not loaded (see [`load_cuda`]).
pub fn cuda_device_count() -> u32 {
    if !wasmrpc_torch_sys::libtorch_has_cuda() {
        return 0;
    }
    u32::try_from(tch::Cuda::device_count()).unwrap_or(0)
}

fn valid_devices<'a>(devices: impl IntoIterator<Item = &'a Device>, count: u32) -> bool {
    devices.into_iter().all(|d| match d {
        Device::Cpu => true,
        Device::Cuda(i) => *i < count,
    })
}

fn list(devices: impl IntoIterator<Item = Device>) -> String {
    let v: Vec<String> = devices.into_iter().map(|d| d.to_string()).collect();
    format!("[{}]", v.join(", "))
}

fn show_map(map: &DeviceMap) -> String {
    let v: Vec<String> = map.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("{{{}}}", v.join(", "))
}

/// `_validate_device_maps`: checks every worker's `devices` and device
/// maps against every worker's device count, in name order, so that every
/// worker reports the same first offender. `static_group`: whether a map
/// may name only workers of the group (dynamic groups skip that check, and
/// the target checks for workers not yet joined).
///
/// # Errors
/// `ValueError` with PyTorch's texts ("Node worker0 has invalid target node
/// names in its device maps", "... has source devices with invalid indices
/// in its device map for worker1", "... duplicated target devices ...",
/// "... unexpected source devices ...", "... unexpected target devices ...",
/// "... target devices with invalid indices ...", "... has duplicated
/// devices", "... has devices with invalid indices").
pub fn validate_device_maps(all: &BTreeMap<String, DeviceInfo>, static_group: bool) -> Result<()> {
    for (node, info) in all {
        let mut seen = std::collections::BTreeSet::new();
        if !info.devices.iter().all(|d| seen.insert(*d)) {
            return Err(Error::value(format!(
                "Node {node} has duplicated devices\ndevices = {}",
                list(info.devices.iter().copied())
            )));
        }
        if !valid_devices(&info.devices, info.device_count) {
            return Err(Error::value(format!(
                "Node {node} has devices with invalid indices\ndevices = {}\ndevice count = {}",
                list(info.devices.iter().copied()),
                info.device_count
            )));
        }
    }
    for (source, info) in all {
        if static_group && !info.device_maps.keys().all(|t| all.contains_key(t)) {
            return Err(Error::value(format!(
                "Node {source} has invalid target node names in its device maps\ndevice maps = {:?}\nnode names = {:?}",
                info.device_maps.keys().collect::<Vec<_>>(),
                all.keys().collect::<Vec<_>>()
            )));
        }
        for (target, map) in &info.device_maps {
            let targets: std::collections::BTreeSet<_> = map.values().collect();
            if targets.len() != map.len() {
                return Err(Error::value(format!(
                    "Node {source} has duplicated target devices in its device map for {target}\ndevice map = {}",
                    show_map(map)
                )));
            }
            if !info.devices.is_empty() {
                if !map.keys().all(|d| info.devices.contains(d)) {
                    return Err(Error::value(format!(
                        "Node {source} has unexpected source devices in its device map for {target}\ndevice map = {}\ndevices = {}",
                        show_map(map),
                        list(info.devices.iter().copied())
                    )));
                }
            } else if !valid_devices(map.keys(), info.device_count) {
                return Err(Error::value(format!(
                    "Node {source} has source devices with invalid indices in its device map for {target}\ndevice map = {}\ndevice count = {}",
                    show_map(map),
                    info.device_count
                )));
            }
            let Some(peer) = all.get(target) else {
                continue;
            };
            if !peer.devices.is_empty() {
                if !map.values().all(|d| peer.devices.contains(d)) {
                    return Err(Error::value(format!(
                        "Node {source} has unexpected target devices in its device map for {target}\ndevice map = {}\ndevices = {}",
                        show_map(map),
                        list(peer.devices.iter().copied())
                    )));
                }
            } else if !valid_devices(map.values(), peer.device_count) {
                return Err(Error::value(format!(
                    "Node {source} has target devices with invalid indices in its device map for {target}\ndevice map = {}\ndevice count = {}",
                    show_map(map),
                    peer.device_count
                )));
            }
        }
    }
    Ok(())
}

/// `_create_reverse_mapping`: for every worker whose map names `me`, the
/// inverse of that map (my device → its device), which responses to it use.
pub fn reverse_maps(me: &str, all: &BTreeMap<String, DeviceInfo>) -> BTreeMap<String, DeviceMap> {
    all.iter()
        .filter_map(|(node, info)| {
            info.device_maps
                .get(me)
                .map(|m| (node.clone(), m.iter().map(|(k, v)| (*v, *k)).collect()))
        })
        .collect()
}

/// The device maps an agent uses after init: its own (requests) and the
/// inverses of its callers' maps (responses).
#[derive(Debug, Default)]
pub struct AgentDeviceMaps {
    /// Requests: destination → (my device → its device).
    pub requests: std::sync::RwLock<BTreeMap<String, DeviceMap>>,
    /// Responses: caller → (my device → its device).
    pub responses: std::sync::RwLock<BTreeMap<String, DeviceMap>>,
}

/// Validates the all-gathered device infos at init and records the maps
/// the agent sends with ([`AgentDeviceMaps`], in the agent's state).
/// Dynamic groups validate against the members present at join time;
/// members that joined earlier do not learn a joiner's map, so responses
/// toward a joiner carry CPU tensors only.
///
/// # Errors
/// The `ValueError`s of [`validate_device_maps`].
pub(crate) fn install(
    agent: &crate::RpcAgent,
    all: &BTreeMap<String, DeviceInfo>,
    static_group: bool,
) -> Result<()> {
    validate_device_maps(all, static_group)?;
    let maps = agent.state::<AgentDeviceMaps>();
    *maps.requests.write().unwrap_or_else(|p| p.into_inner()) = agent.options().device_maps.clone();
    *maps.responses.write().unwrap_or_else(|p| p.into_inner()) = reverse_maps(agent.name(), all);
    Ok(())
}

/// Whether `agent` has a non-empty device map toward `remote` (the
/// request map its calls to `remote` use; `_get_device_map(...)` is not
/// empty).
pub fn has_device_map_to(agent: &crate::RpcAgent, remote: &str) -> bool {
    let maps = agent.state::<AgentDeviceMaps>();
    let maps = maps.requests.read().unwrap_or_else(|p| p.into_inner());
    maps.get(remote).is_some_and(|m| !m.is_empty())
}

/// Which of an agent's maps toward a peer a message's tensors travel with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapDirection {
    /// This agent's own map toward the peer (requests; gradients a recv
    /// record of a *response* sends back, the inverse of the response's
    /// reverse map).
    Request,
    /// The inverse of the peer's map toward this agent (responses;
    /// gradients a recv record of a *request* sends back to its caller,
    /// as PyTorch's `RecvRpcBackward` keeps the reverse map of the message
    /// it received).
    Response,
}

/// The devices of a message's tensors at `remote` for this agent:
/// [`devices_for_remote`] with the request map toward `remote` or the
/// reverse map of `remote`'s map toward this agent.
///
/// # Errors
/// As [`devices_for_remote`].
pub(crate) fn devices_for(
    agent: &crate::RpcAgent,
    remote: &str,
    direction: MapDirection,
    tensors: &[tch::Tensor],
) -> Result<Vec<Device>> {
    let maps = agent.state::<AgentDeviceMaps>();
    let is_request = direction == MapDirection::Request;
    let maps = if is_request {
        &maps.requests
    } else {
        &maps.responses
    };
    let maps = maps.read().unwrap_or_else(|p| p.into_inner());
    devices_for_remote(remote, is_request, maps.get(remote), tensors)
}

/// `getDevicesForRemote`: the device each of a message's tensors lands on at
/// `remote`, given the map toward it (`None`: no map). Empty when no tensor
/// is mapped (everything stays on the CPU), as PyTorch does.
///
/// # Errors
/// `RuntimeError` "TensorPipe RPC backend only supports CPU tensors by
/// default, ... Request|Response device mapping is not available for
/// destination X ..." for a CUDA tensor without a mapping.
pub fn devices_for_remote(
    remote: &str,
    is_request: bool,
    map: Option<&DeviceMap>,
    tensors: &[tch::Tensor],
) -> Result<Vec<Device>> {
    // Only a refusal needs the text: every call and reply comes here.
    let err = || {
        format!(
            "TensorPipe RPC backend only supports CPU tensors by default, please move your \
             tensors to CPU before sending them over RPC, or call `set_device_map` on \
             `TensorPipeRpcBackendOptions` to explicitly configure device mapping. {} device \
             mapping is not available for destination {remote}",
            if is_request { "Request" } else { "Response" }
        )
    };
    let Some(map) = map else {
        for t in tensors {
            let d = Device::from_tch(t.device())?;
            if d != Device::Cpu {
                return Err(Error::runtime(format!(
                    "{}, but found tensor on device: {d}",
                    err()
                )));
            }
        }
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(tensors.len());
    let mut mapped = false;
    for t in tensors {
        let d = Device::from_tch(t.device())?;
        match map.get(&d) {
            Some(to) => {
                out.push(*to);
                mapped = true;
            }
            None if d == Device::Cpu => out.push(Device::Cpu),
            None => {
                return Err(Error::runtime(format!(
                    "{} for device {d} but received a tensor on that device.",
                    err()
                )));
            }
        }
    }
    if !mapped {
        out.clear();
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
