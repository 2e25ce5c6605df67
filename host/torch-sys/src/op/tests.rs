use super::*;

#[test]
fn implausible_names_never_reach_the_registry() {
    assert!(plausible_name("aten::add"));
    assert!(plausible_name("aten::__and__"));
    assert!(!plausible_name("aten::add\0x"));
    assert!(!plausible_name("aten::a b"));
    assert!(!plausible_name(""));
    assert!(!plausible_name(&"a".repeat(MAX_NAME_LEN + 1)));
}

#[test]
fn names_qualify_like_pytorch_rpc() {
    assert_eq!(qualified_name("aten::add"), "aten::add");
    assert_eq!(qualified_name("prim::min"), "prim::min");
    assert_eq!(qualified_name("torch.ops.aten.matmul"), "aten::matmul");
    assert_eq!(qualified_name("view"), "aten::view");
}
