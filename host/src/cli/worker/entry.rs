//! The entry function's arguments and result: arguments from the command
//! line (`-- 3 2.5 true text`) or JSON (`--entry-json`), and the result
//! printed and written as JSON (`--result`).

use anyhow::{Context, Result, bail};
use wasmrpc::{Args, Payload, Value};

/// An entry argument: an integer, a float, a boolean, or else a string.
pub(super) fn parse_arg(s: &str) -> Payload {
    if let Ok(i) = s.parse::<i64>() {
        Payload::from(i)
    } else if let Ok(f) = s.parse::<f64>() {
        Payload::from(f)
    } else if let Ok(b) = s.parse::<bool>() {
        Payload::from(b)
    } else {
        Payload::from(s.to_string())
    }
}

/// The entry's arguments from `--entry-json`: an array (positional), an
/// object (keyword), or `{"args": [...], "kwargs": {...}}`.
///
/// # Errors
/// Text that is not JSON, or JSON of another shape, saying which.
pub(crate) fn json_entry_args(text: &str) -> Result<Args> {
    let json: serde_json::Value =
        serde_json::from_str(text).with_context(|| format!("--entry-json {text:?} is not JSON"))?;
    let positional = |items: &Vec<serde_json::Value>, args: Args| {
        items.iter().fold(args, |a, v| a.arg(payload_of_json(v)))
    };
    let keywords = |map: &serde_json::Map<String, serde_json::Value>, args: Args| {
        map.iter()
            .fold(args, |a, (k, v)| a.kwarg(k.clone(), payload_of_json(v)))
    };
    use serde_json::Value as J;
    Ok(match &json {
        J::Array(items) => positional(items, Args::new()),
        J::Object(map)
            if map.keys().all(|k| k == "args" || k == "kwargs")
                && map.get("args").is_none_or(J::is_array)
                && map.get("kwargs").is_none_or(J::is_object)
                && !map.is_empty() =>
        {
            let empty = (Vec::new(), serde_json::Map::new());
            let args = map.get("args").and_then(J::as_array).unwrap_or(&empty.0);
            let kwargs = map.get("kwargs").and_then(J::as_object).unwrap_or(&empty.1);
            keywords(kwargs, positional(args, Args::new()))
        }
        J::Object(map) => keywords(map, Args::new()),
        other => bail!(
            "--entry-json takes an array of arguments or an object of keyword arguments, not \
             {other}"
        ),
    })
}

/// A JSON value as a payload: integers as ints, other numbers as floats,
/// objects as dicts with string keys, null as None.
fn payload_of_json(v: &serde_json::Value) -> Payload {
    use serde_json::Value as J;
    match v {
        J::Null => Payload::none(),
        J::Bool(b) => Payload::from(*b),
        J::Number(n) => match n.as_i64() {
            Some(i) => Payload::from(i),
            None => Payload::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Payload::from(s.clone()),
        J::Array(items) => Payload::list(items.iter().map(payload_of_json)),
        J::Object(map) => Payload::dict(
            map.iter()
                .map(|(k, v)| (Payload::from(k.clone()), payload_of_json(v))),
        ),
    }
}

/// A one-line rendering of a result for the terminal.
pub(super) fn describe(p: &Payload) -> String {
    match &p.value {
        Value::Tensor(_) => match p.as_tensor() {
            Ok(t) => format!("{t}"),
            Err(e) => format!("<tensor: {e}>"),
        },
        other => format!("{other:?}"),
    }
}

/// A result as JSON: numbers, strings, lists, dicts with string keys as
/// objects (others as lists of pairs), records as objects, tensors as
/// `{"shape", "data"}` (float64 data), RRefs as their description.
pub(super) fn to_json(v: &Value, tensors: &[tch::Tensor]) -> serde_json::Value {
    use serde_json::{Map, Value as J, json};
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => json!(i),
        Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Value::Str(s) => J::String(s.clone()),
        Value::Bytes(b) => json!(b),
        Value::List(items) | Value::Tuple(items) => {
            J::Array(items.iter().map(|x| to_json(x, tensors)).collect())
        }
        Value::Dict(pairs) => {
            if pairs.iter().all(|(k, _)| matches!(k, Value::Str(_))) {
                let mut map = Map::new();
                for (k, v) in pairs {
                    if let Value::Str(k) = k {
                        map.insert(k.clone(), to_json(v, tensors));
                    }
                }
                J::Object(map)
            } else {
                J::Array(
                    pairs
                        .iter()
                        .map(|(k, v)| J::Array(vec![to_json(k, tensors), to_json(v, tensors)]))
                        .collect(),
                )
            }
        }
        Value::Record { name, fields } => {
            let mut map = Map::new();
            map.insert("__type__".into(), J::String(name.clone()));
            for (k, v) in fields {
                map.insert(k.clone(), to_json(v, tensors));
            }
            J::Object(map)
        }
        Value::WorkerInfo(w) => json!({"name": w.name, "id": w.id}),
        Value::Tensor(i) => match tensors.get(*i as usize) {
            Some(t) => {
                let data: Vec<f64> = t
                    .to_kind(tch::Kind::Double)
                    .flatten(0, -1)
                    .try_into()
                    .unwrap_or_default();
                json!({"shape": t.size(), "data": data})
            }
            None => J::Null,
        },
        Value::RRef(i) => J::String(format!("RRef #{i}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_arguments_take_the_narrowest_type() {
        assert_eq!(parse_arg("3").as_int().unwrap(), 3);
        assert_eq!(parse_arg("2.5").as_float().unwrap(), 2.5);
        assert!(parse_arg("true").as_bool().unwrap());
        assert_eq!(parse_arg("worker1").as_str().unwrap(), "worker1");
    }

    #[test]
    fn json_entry_arguments_are_positional_keyword_or_both() {
        let args = json_entry_args(r#"[3, 0.5, "ps", [1, 2], {"k": null}, true]"#).unwrap();
        assert_eq!(args.len(), 6);
        let args = json_entry_args(r#"{"epochs": 3, "lr": 0.1}"#).unwrap();
        assert_eq!(args.kwarg_value("epochs").unwrap().as_int().unwrap(), 3);
        assert_eq!(args.kwarg_value("lr").unwrap().as_float().unwrap(), 0.1);
        let args = json_entry_args(r#"{"args": [1], "kwargs": {"x": "y"}}"#).unwrap();
        assert_eq!(args.len(), 1);
        assert_eq!(args.kwarg_value("x").unwrap().as_str().unwrap(), "y");
        for bad in ["3", "not json", "\"s\""] {
            let e = json_entry_args(bad).unwrap_err().to_string();
            assert!(e.contains("--entry-json"), "{bad}: {e}");
        }
    }

    #[test]
    fn results_become_plain_json() {
        let t = tch::Tensor::from_slice(&[1.0f32, 2.0]);
        let v = Value::Tuple(vec![
            Value::List(vec![Value::Float(0.5), Value::Int(2)]),
            Value::Dict(vec![(Value::Str("acc".into()), Value::Float(0.9))]),
            Value::Tensor(0),
            Value::None,
        ]);
        assert_eq!(
            to_json(&v, &[t]),
            serde_json::json!([[0.5, 2], {"acc": 0.9}, {"shape": [2], "data": [1.0, 2.0]}, null])
        );
    }
}
