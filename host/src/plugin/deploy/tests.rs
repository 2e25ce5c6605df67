//! Tests of `deploy`.

use super::*;

#[test]
fn replies_round_trip() {
    let names = vec!["hello::greet".to_string()];
    let p = reply(true, &names);
    assert_eq!(decode_reply(&p.value).unwrap(), (true, names));
    assert!(decode_reply(&Value::Int(1)).is_err());
}

#[test]
fn hex_is_lowercase_and_padded() {
    assert_eq!(hex(&[0, 15, 255]), "000fff");
}

fn value() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(Value::None),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        ".{0,8}".prop_map(Value::Str),
        any::<u32>().prop_map(Value::Tensor),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::List),
            proptest::collection::vec(inner, 0..4).prop_map(Value::Tuple),
        ]
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// A worker's reply to a deployment is decoded only when it has the
    /// shape `reply` writes; any other value is an error naming it.
    #[test]
    fn arbitrary_replies_decode_only_in_their_shape(v in value()) {
        let shaped = match &v {
            Value::Tuple(items) => matches!(
                items.as_slice(),
                [Value::Bool(_), Value::List(names)]
                    if names.iter().all(|n| matches!(n, Value::Str(_)))
            ),
            _ => false,
        };
        match decode_reply(&v) {
            Ok((already, names)) => {
                proptest::prop_assert!(shaped);
                proptest::prop_assert_eq!(reply(already, &names).value, v);
            }
            Err(e) => {
                proptest::prop_assert!(!shaped);
                proptest::prop_assert!(e.to_string().contains("unexpected reply"), "{}", e);
            }
        }
    }
}
