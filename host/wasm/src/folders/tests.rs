use super::*;

#[test]
fn grants_parse_and_print_back() {
    let g = FolderGrant::parse("param_server:/ckpt/=/srv/ckpt:rw,quota=10M,deployed").unwrap();
    assert_eq!(g.namespace, "param_server");
    assert_eq!(g.guest, "/ckpt");
    assert_eq!(g.host, PathBuf::from("/srv/ckpt"));
    assert_eq!(g.access, Access::ReadWrite);
    assert_eq!(g.quota, Some(10 << 20));
    assert!(g.deployed);
    assert_eq!(FolderGrant::parse(&g.to_spec()).unwrap(), g);
    let ro = FolderGrant::parse("ps:/data=/srv/digits").unwrap();
    assert_eq!(ro.access, Access::ReadOnly);
    assert!(!ro.deployed);
}

#[test]
fn bad_grants_say_what_is_wrong() {
    for (spec, why) in [
        ("/data=/srv", "no plugin namespace"),
        ("ps:data=/srv", "not an absolute path"),
        ("ps:/=/srv", "cannot be '/'"),
        ("ps:/a/../b=/srv", "holds '..'"),
        ("ps:/data", "no '='"),
        ("ps:/data=/srv:rw,quota=lots", "is not a size"),
        ("ps:/data=/srv,quota=1G", "needs a read-write grant"),
        ("ps:/data=/srv:rw,exec", "unknown option"),
        ("p-s:/data=/srv", "is not a plugin namespace"),
    ] {
        let e = FolderGrant::parse(spec).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ValueError);
        assert!(e.message.contains(why), "{spec}: {}", e.message);
        assert!(e.message.contains("the form is"), "{}", e.message);
    }
}
