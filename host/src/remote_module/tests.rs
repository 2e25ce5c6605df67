//! Unit tests of the RemoteModule handle: `remote_device` parsing.

use super::*;

#[test]
fn remote_devices_parse_with_pytorchs_texts() {
    assert_eq!(
        parse_remote_device("worker1/cpu").unwrap(),
        (RemoteOn::Name("worker1".into()), "cpu".into())
    );
    assert_eq!(
        parse_remote_device("rank:1/cuda:0").unwrap(),
        (RemoteOn::Rank(1), "cuda:0".into())
    );
    assert_eq!(
        parse_remote_device("worker1").unwrap(),
        (RemoteOn::Name("worker1".into()), "cpu".into())
    );
    let msg = |s: &str| parse_remote_device(s).unwrap_err().message().to_owned();
    for s in ["worker1/cuda:0/cuda:1", "/", "/cuda:0"] {
        assert!(
            msg(s).starts_with(&format!(
                "Could not parse remote_device: {s}. The valid format is '<workername>/<device>'"
            )),
            "{s}: {}",
            msg(s)
        );
    }
    assert_eq!(msg("worker1/cpu2"), "Invalid device string: 'cpu2'");
    assert_eq!(msg("worker1/"), "Device string must not be empty");
    assert!(
        msg("worker1/foo").starts_with("Expected one of cpu, cuda")
            && msg("worker1/foo").ends_with("device type at start of device string: foo"),
        "{}",
        msg("worker1/foo")
    );
}
