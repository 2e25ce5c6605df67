//! Tests of `device`.

use super::*;

fn info(count: u32, maps: &[(&str, &[(Device, Device)])], devices: &[Device]) -> DeviceInfo {
    DeviceInfo {
        device_count: count,
        devices: devices.to_vec(),
        device_maps: maps
            .iter()
            .map(|(n, m)| (n.to_string(), m.iter().copied().collect()))
            .collect(),
    }
}

fn check(all: Vec<(&str, DeviceInfo)>) -> Result<()> {
    let all = all.into_iter().map(|(n, i)| (n.to_string(), i)).collect();
    validate_device_maps(&all, true)
}

#[test]
fn parses_like_torch_device() {
    assert_eq!(parse_device(1).unwrap(), Device::Cuda(1));
    assert_eq!(parse_device("cuda:2").unwrap(), Device::Cuda(2));
    assert_eq!(parse_device("cuda").unwrap(), Device::Cuda(0));
    assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
    let e = parse_device(-1).unwrap_err();
    assert!(e.message().contains(NEGATIVE_INDEX));
    assert!(
        parse_device("cuda:-1")
            .unwrap_err()
            .message()
            .contains(NEGATIVE_INDEX)
    );
    assert!(parse_device("tpu").is_err());
    assert_eq!(parse_device("cpu:0").unwrap(), Device::Cpu);
    assert!(
        parse_device("meta")
            .unwrap_err()
            .message()
            .contains("RPC supports CPU and CUDA devices only")
    );
}

#[test]
fn device_strings_are_checked_with_c10s_texts() {
    assert_eq!(check_device_string("cuda:1").unwrap(), ("cuda", Some(1)));
    assert_eq!(check_device_string("meta").unwrap(), ("meta", None));
    let msg = |s: &str| check_device_string(s).unwrap_err().message().to_owned();
    assert_eq!(msg(""), "Device string must not be empty");
    assert_eq!(msg("cpu2"), "Invalid device string: 'cpu2'");
    assert_eq!(msg("cuda:01"), "Invalid device string: 'cuda:01'");
    assert_eq!(msg("cuda:"), "Invalid device string: 'cuda:'");
    assert!(msg("foo").starts_with("Expected one of cpu, cuda, ipu"));
    assert!(msg("foo").ends_with("device type at start of device string: foo"));
    let count = cuda_device_count();
    assert!(check_available(Device::Cpu).is_ok());
    assert!(
        check_available(Device::Cuda(count))
            .unwrap_err()
            .message()
            .starts_with("CUDA error: invalid device ordinal")
    );
}

#[test]
fn validation_texts() {
    let (c0, c1, c2) = (Device::Cuda(0), Device::Cuda(1), Device::Cuda(2));
    let ok = info(2, &[("worker1", &[(c0, c1), (c1, c0)])], &[]);
    assert!(check(vec![("worker0", ok), ("worker1", info(2, &[], &[]))]).is_ok());
    let cases: Vec<(DeviceInfo, DeviceInfo, &str)> = vec![
        (
            info(2, &[("none_exist", &[(c0, c1)])], &[]),
            info(2, &[], &[]),
            "Node worker0 has invalid target node names in its device maps",
        ),
        (
            info(2, &[("worker1", &[(c2, c0)])], &[]),
            info(2, &[], &[]),
            "Node worker0 has source devices with invalid indices in its device map for worker1",
        ),
        (
            info(2, &[("worker1", &[(c0, c2)])], &[]),
            info(2, &[], &[]),
            "Node worker0 has target devices with invalid indices in its device map for worker1",
        ),
        (
            info(2, &[("worker1", &[(c1, c0), (c0, c0)])], &[]),
            info(2, &[], &[]),
            "Node worker0 has duplicated target devices in its device map for worker1",
        ),
        (
            info(2, &[("worker1", &[(c0, c0)])], &[c1]),
            info(2, &[], &[c1]),
            "Node worker0 has unexpected source devices in its device map for worker1",
        ),
        (
            info(2, &[("worker1", &[(c0, c1)])], &[c0]),
            info(2, &[], &[c0]),
            "Node worker0 has unexpected target devices in its device map for worker1",
        ),
    ];
    for (w0, w1, text) in cases {
        let e = check(vec![("worker0", w0), ("worker1", w1)]).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::ValueError);
        assert!(e.message().starts_with(text), "{} vs {text}", e.message());
    }
}

#[test]
fn reverse_and_request_devices() {
    let (c0, c1) = (Device::Cuda(0), Device::Cuda(1));
    let all: BTreeMap<String, DeviceInfo> = [
        (
            "worker0".to_string(),
            info(2, &[("worker1", &[(c0, c1), (Device::Cpu, c0)])], &[]),
        ),
        ("worker1".to_string(), info(2, &[], &[])),
    ]
    .into();
    let rev = reverse_maps("worker1", &all);
    assert_eq!(rev["worker0"][&c1], c0);
    assert_eq!(rev["worker0"][&c0], Device::Cpu);
    let cpu = tch::Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu));
    let m = &all["worker0"].device_maps["worker1"];
    assert_eq!(
        devices_for_remote("worker1", true, Some(m), &[cpu.shallow_clone()]).unwrap(),
        vec![c0]
    );
    assert!(
        devices_for_remote("worker1", true, None, &[cpu.shallow_clone()])
            .unwrap()
            .is_empty()
    );
    let empty = DeviceMap::new();
    assert!(
        devices_for_remote("worker1", true, Some(&empty), &[cpu])
            .unwrap()
            .is_empty()
    );
}
