//! Tests of `value`.

use super::*;
use tch::{Device, Kind};

#[test]
fn containers_merge_tensor_tables() {
    let a = Tensor::ones([2], (Kind::Float, Device::Cpu));
    let b = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    let p = Payload::list(vec![
        Payload::from(&a),
        Payload::tuple(vec![1.into(), Payload::from(&b)]),
    ]);
    assert_eq!(p.tensors.len(), 2);
    let items = p.items().unwrap();
    assert!(items[0].as_tensor().unwrap().equal(&a));
    let inner = items[1].items().unwrap();
    assert_eq!(inner[0].as_int().unwrap(), 1);
    assert!(inner[1].as_tensor().unwrap().equal(&b));
    assert!(p.equal(&p.clone()));
}

#[test]
fn args_bind_positional_and_keyword() {
    let args = crate::args![1, 2.5].kwarg("c", "x");
    assert_eq!(args.param(0, "a").unwrap().as_int().unwrap(), 1);
    assert_eq!(args.param(2, "c").unwrap().as_str().unwrap(), "x");
    assert!(args.param(3, "d").is_err());
    let e = crate::args![1]
        .check_arity("my_function", 3, 3, &["a", "b", "c"])
        .unwrap_err();
    assert_eq!(
        e.message(),
        "my_function() missing 2 required positional arguments"
    );
}
