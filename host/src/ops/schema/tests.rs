//! Tests of `schema`.

//! POLICY_TEST_NAMES_DENIED_OPS: the schemas here are inputs the rules
//! must refuse, not ops the seeds call.

use super::*;

fn kinds(schema: &str) -> Option<HazardKind> {
    schema_hazard(schema).map(|h| h.kind)
}

#[test]
fn parameters_parse_with_defaults_aliases_and_keyword_only_marks() {
    let p =
        parse_params("aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor")
            .unwrap();
    assert_eq!(p.len(), 3);
    assert_eq!((p[0].ty.as_str(), p[0].name.as_str()), ("Tensor", "self"));
    assert_eq!(p[2].default.as_deref(), Some("1"));
    assert!(p[2].keyword_only && !p[1].keyword_only);
    let p = parse_params(
        "aten::pad(Tensor self, SymInt[] pad, str mode=\"con,stant\", float? value=None) -> Tensor",
    )
    .unwrap();
    assert_eq!(p[2].default.as_deref(), Some("\"con,stant\""));
    let p = parse_params("aten::values.str(Dict(str, t) self) -> t[](*)").unwrap();
    assert_eq!(
        (p[0].ty.as_str(), p[0].name.as_str()),
        ("Dict(str, t)", "self")
    );
    let p = parse_params("aten::max_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=[0, 0]) -> Tensor").unwrap();
    assert_eq!(p[3].default.as_deref(), Some("[0, 0]"));
    assert!(parse_params("aten::nothing() -> ()").unwrap().is_empty());
    assert!(parse_params("garbage").is_none());
}

#[test]
fn alias_annotations_are_not_types_but_container_contents_are() {
    assert_eq!(type_words("Tensor(a!)[]"), ["Tensor"]);
    assert_eq!(type_words("Tensor(a -> *)"), ["Tensor"]);
    assert_eq!(type_words("t[](a!)"), ["t"]);
    assert_eq!(type_words("Dict(str, t)"), ["Dict", "str", "t"]);
    assert_eq!(type_words("Future(t)"), ["Future", "t"]);
    assert_eq!(type_words("int[2]?"), ["int"]);
}

#[test]
fn every_kind_of_hazard_is_found() {
    assert_eq!(
        kinds("aten::set_.source_Storage(Tensor(a!) self, Storage source) -> Tensor(a!)"),
        Some(HazardKind::Storage)
    );
    assert_eq!(
        kinds("aten::record_stream(Tensor(a!) self, Stream s) -> ()"),
        Some(HazardKind::Stream)
    );
    assert_eq!(
        kinds("aten::initial_seed(Generator self) -> int"),
        Some(HazardKind::Generator)
    );
    assert_eq!(
        kinds(
            "aten::rand.generator(SymInt[] size, *, Generator? generator, ScalarType? dtype=None) -> Tensor"
        ),
        Some(HazardKind::Generator),
        "a generator without a None default is one a caller passes"
    );
    assert_eq!(
        kinds("aten::rand(SymInt[] size, *, Generator? generator=None) -> Tensor"),
        None
    );
    assert_eq!(
        kinds("x::from_blob(int data_ptr, int[] size) -> Tensor"),
        Some(HazardKind::RawPointer)
    );
    assert_eq!(
        kinds("x::wrap(int? address) -> Tensor"),
        Some(HazardKind::RawPointer)
    );
    assert_eq!(
        kinds("aten::from_file(str filename, bool? shared=None, int? size=0) -> Tensor"),
        Some(HazardKind::FileName)
    );
    assert_eq!(
        kinds("x::load(str f) -> Tensor"),
        Some(HazardKind::FileName)
    );
    assert_eq!(
        kinds("aten::save(t item, str filename) -> ()"),
        Some(HazardKind::Opaque)
    );
    assert_eq!(
        kinds("aten::dequantize.any(Any tensors) -> Any"),
        Some(HazardKind::Opaque)
    );
    assert_eq!(
        kinds("aten::add.t(t[] a, t[] b) -> t[]"),
        Some(HazardKind::Opaque)
    );
    assert_eq!(
        kinds("aten::eq.enum(AnyEnumType a, AnyEnumType b) -> bool"),
        Some(HazardKind::Opaque)
    );
    assert_eq!(
        kinds("aten::owner(RRef(t) self) -> __torch__.torch.classes.dist_rpc.WorkerInfo"),
        Some(HazardKind::Opaque)
    );
    assert_eq!(
        kinds(
            "x::q(Tensor a, __torch__.torch.classes.quantized.LinearPackedParamsBase p) -> Tensor"
        ),
        Some(HazardKind::Opaque)
    );
    assert_eq!(kinds("x::c(Capsule c) -> ()"), Some(HazardKind::Opaque));
    assert_eq!(
        kinds("prim::AutogradAllZero(...) -> bool"),
        Some(HazardKind::Opaque)
    );
    assert_eq!(
        kinds("garbage"),
        Some(HazardKind::Opaque),
        "unreadable schemas fail closed"
    );
    // Plain values are fine, file-ish names of other types too.
    assert_eq!(
        kinds("aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"),
        None
    );
    assert_eq!(
        kinds("aten::einsum(str equation, Tensor[] tensors, *, int[]? path=None) -> Tensor"),
        None
    );
    assert_eq!(kinds("x::y(Tensor f, int path) -> Tensor"), None);
}

#[test]
fn withheld_overloads_screen_calls_by_argument_kinds() {
    let t = || OpValue::Tensor(tch::Tensor::ones([2], (tch::Kind::Float, tch::Device::Cpu)));
    let list = || OpValue::List(vec![]);
    let add_t = Overload::withheld("aten::add.t(t[] a, t[] b) -> t[]").unwrap();
    assert!(!add_t.could_bind(&[t(), t()], &[], false));
    assert!(!add_t.could_bind(&[t(), OpValue::Int(1)], &[], false));
    assert!(add_t.could_bind(&[list(), list()], &[], false));
    assert!(!add_t.could_bind(&[list()], &[], false), "b is missing");
    assert!(
        !add_t.could_bind(&[list(), list(), list()], &[], false),
        "too many"
    );
    let mul_left = Overload::withheld("aten::mul.left_t(t[] l, int n) -> t[]").unwrap();
    assert!(!mul_left.could_bind(&[t(), OpValue::Int(2)], &[], false));
    assert!(mul_left.could_bind(&[list(), OpValue::Int(2)], &[], false));
    let rand_g = Overload::withheld(
        "aten::rand.generator(SymInt[] size, *, Generator? generator, ScalarType? dtype=None) -> Tensor",
    )
    .unwrap();
    let size = || OpValue::List(vec![OpValue::Int(2)]);
    assert!(
        !rand_g.could_bind(&[size()], &[], false),
        "the generator is required"
    );
    assert!(rand_g.could_bind(&[size()], &[("generator".into(), OpValue::None)], false));
    assert!(!rand_g.could_bind(&[size()], &[("generator".into(), OpValue::Int(1))], false));
    assert!(!rand_g.could_bind(&[size()], &[("nope".into(), OpValue::None)], false));
    let eq_enum =
        Overload::withheld("aten::eq.enum(AnyEnumType a, AnyEnumType b) -> bool").unwrap();
    assert!(!eq_enum.could_bind(&[OpValue::Int(1), OpValue::Int(1)], &[], false));
    assert!(!eq_enum.could_bind(&[OpValue::None, OpValue::None], &[], false));
    let varargs = Overload::withheld("prim::x(...) -> ()").unwrap();
    assert!(varargs.could_bind(&[t()], &[], false));
    // A method's trailing ints may fill an `int[]`.
    let packed = Overload::withheld("x::y(t[] self, int[] size) -> ()").unwrap();
    assert!(packed.could_bind(&[list(), OpValue::Int(1), OpValue::Int(2)], &[], true));
}
