//! Python's own builtins that the seeds send as RPC targets (`min`, `max`),
//! with Python's semantics and error texts.
//!
//! They are named by their Python qualified names, `builtins.min` and
//! `builtins.max`, so that they never shadow the aten ops `aten::min` and
//! `aten::max` (which a bare `min` resolves to, as a tensor method). They
//! compare numbers (`int`, `float`, `bool`) and strings; comparing tensors
//! this way (`min(t1, t2)`, which Python does through `bool(t2 < t1)`) is not
//! supported and raises `TypeError`.

use crate::error::OpError;
use crate::value::OpValue;
use std::cmp::Ordering;
use wasmrpc_abi::ErrorKind;

/// The Python builtins served here, by qualified name.
pub const BUILTINS: &[&str] = &["builtins.min", "builtins.max"];

/// Runs the Python builtin `name`, or returns `None` if `name` is not one.
pub(crate) fn call(
    name: &str,
    args: &[OpValue],
    kwargs: &[(String, OpValue)],
) -> Option<Result<OpValue, OpError>> {
    let want = match name {
        "builtins.min" => Ordering::Less,
        "builtins.max" => Ordering::Greater,
        _ => return None,
    };
    let short = &name["builtins.".len()..];
    Some(min_max(short, want, args, kwargs))
}

fn type_error(message: String) -> OpError {
    OpError::Rejected {
        kind: ErrorKind::TypeError,
        message,
    }
}

/// Compares two values as Python's `<` or `>` (`symbol`) would, or says why
/// it cannot.
fn compare(a: &OpValue, b: &OpValue, symbol: char) -> Result<Ordering, OpError> {
    let unsupported = || {
        type_error(format!(
            "'{symbol}' not supported between instances of '{}' and '{}'",
            a.type_name(),
            b.type_name()
        ))
    };
    match (a, b) {
        (OpValue::Str(x), OpValue::Str(y)) => Ok(x.cmp(y)),
        _ => {
            let x = Number::of(a).ok_or_else(unsupported)?;
            let y = Number::of(b).ok_or_else(unsupported)?;
            // NaN compares false both ways in Python: it neither replaces nor
            // is replaced, which `Equal` reproduces here.
            Ok(x.cmp(y).unwrap_or(Ordering::Equal))
        }
    }
}

#[derive(Clone, Copy)]
enum Number {
    Int(i64),
    Float(f64),
}

impl Number {
    fn of(v: &OpValue) -> Option<Number> {
        match v {
            OpValue::Int(i) => Some(Number::Int(*i)),
            OpValue::Bool(b) => Some(Number::Int(i64::from(*b))),
            OpValue::Float(f) => Some(Number::Float(*f)),
            _ => None,
        }
    }

    /// Exact comparison, as Python compares `int` with `float`.
    fn cmp(self, other: Number) -> Option<Ordering> {
        match (self, other) {
            (Number::Int(a), Number::Int(b)) => Some(a.cmp(&b)),
            (Number::Float(a), Number::Float(b)) => a.partial_cmp(&b),
            (Number::Int(a), Number::Float(b)) => int_cmp_float(a, b),
            (Number::Float(a), Number::Int(b)) => int_cmp_float(b, a).map(Ordering::reverse),
        }
    }
}

fn int_cmp_float(i: i64, f: f64) -> Option<Ordering> {
    if f.is_nan() {
        return None;
    }
    // 2^63 is exact in f64; beyond the i64 range the float decides.
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    if f >= TWO_63 {
        return Some(Ordering::Less);
    }
    if f < -TWO_63 {
        return Some(Ordering::Greater);
    }
    let floor = f.floor();
    // In range, so the truncating cast is exact.
    let whole = floor as i64;
    match i.cmp(&whole) {
        Ordering::Equal if f > floor => Some(Ordering::Less),
        ordering => Some(ordering),
    }
}

fn min_max(
    name: &str,
    want: Ordering,
    args: &[OpValue],
    kwargs: &[(String, OpValue)],
) -> Result<OpValue, OpError> {
    let mut default = None;
    for (key, value) in kwargs {
        match key.as_str() {
            "default" => default = Some(value),
            "key" if matches!(value, OpValue::None) => {}
            "key" => {
                return Err(type_error(format!(
                    "{name}() key functions are not supported by the host"
                )));
            }
            other => {
                return Err(type_error(format!(
                    "'{other}' is an invalid keyword argument for {name}()"
                )));
            }
        }
    }
    let items: &[OpValue] = match args {
        [] => {
            return Err(type_error(format!(
                "{name} expected at least 1 argument, got 0"
            )));
        }
        [single] => match single.as_slice() {
            Some(items) => items,
            None => {
                return Err(type_error(format!(
                    "'{}' object is not iterable",
                    single.type_name()
                )));
            }
        },
        many => {
            if default.is_some() {
                return Err(type_error(format!(
                    "Cannot specify a default for {name}() with multiple positional arguments"
                )));
            }
            many
        }
    };
    let Some((first, rest)) = items.split_first() else {
        return match default {
            Some(value) => Ok(value.shallow_clone()),
            None => Err(OpError::Rejected {
                kind: ErrorKind::ValueError,
                message: format!("{name}() arg is an empty sequence"),
            }),
        };
    };
    let mut best = first;
    for item in rest {
        // Python keeps the first of equal items: replace only on a strict win.
        let symbol = if want == Ordering::Less { '<' } else { '>' };
        if compare(item, best, symbol)? == want {
            best = item;
        }
    }
    Ok(best.shallow_clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, args: Vec<OpValue>) -> Result<OpValue, OpError> {
        call(name, &args, &[]).expect("a builtin")
    }

    #[test]
    fn min_of_ints_like_the_seeds() {
        let n = 7;
        let r = run(
            "builtins.min",
            vec![OpValue::Int(n), OpValue::Int(n + 1), OpValue::Int(n + 2)],
        )
        .unwrap();
        assert_eq!(r.as_int(), Some(n));
        let r = run(
            "builtins.max",
            vec![OpValue::Int(n), OpValue::Int(n + 1), OpValue::Int(n + 2)],
        )
        .unwrap();
        assert_eq!(r.as_int(), Some(n + 2));
    }

    #[test]
    fn mixed_numbers_keep_the_winner_type_and_first_of_ties() {
        let r = run(
            "builtins.min",
            vec![OpValue::Float(2.5), OpValue::Int(2), OpValue::Float(2.0)],
        )
        .unwrap();
        assert_eq!(r.as_int(), Some(2));
        let r = run("builtins.max", vec![OpValue::Int(3), OpValue::Float(3.0)]).unwrap();
        assert_eq!(r.as_int(), Some(3));
        let r = run(
            "builtins.max",
            vec![OpValue::List(vec![
                OpValue::Float(-1.5),
                OpValue::Bool(true),
            ])],
        )
        .unwrap();
        assert_eq!(r.as_bool(), Some(true));
    }

    #[test]
    fn int_float_comparison_is_exact() {
        assert_eq!(
            int_cmp_float(i64::MAX, 9.223_372_036_854_776e18),
            Some(Ordering::Less)
        );
        assert_eq!(int_cmp_float(2, 2.5), Some(Ordering::Less));
        assert_eq!(int_cmp_float(-2, -2.5), Some(Ordering::Greater));
        assert_eq!(int_cmp_float(2, 2.0), Some(Ordering::Equal));
        assert_eq!(int_cmp_float(0, f64::NAN), None);
    }

    #[test]
    fn errors_match_python() {
        let e = run("builtins.min", vec![]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TypeError);
        assert_eq!(e.to_string(), "min expected at least 1 argument, got 0");
        let e = run("builtins.max", vec![OpValue::List(vec![])]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueError);
        assert_eq!(e.to_string(), "max() arg is an empty sequence");
        let e = run(
            "builtins.min",
            vec![OpValue::Int(1), OpValue::Str("a".into())],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "'<' not supported between instances of 'str' and 'int'"
        );
        let e = run("builtins.max", vec![OpValue::Int(1), OpValue::None]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "'>' not supported between instances of 'NoneType' and 'int'"
        );
        let e = run("builtins.min", vec![OpValue::Int(1)]).unwrap_err();
        assert_eq!(e.to_string(), "'int' object is not iterable");
    }

    #[test]
    fn default_applies_to_empty_iterables_only() {
        let kw = vec![("default".to_owned(), OpValue::Int(9))];
        let r = call("builtins.min", &[OpValue::List(vec![])], &kw)
            .unwrap()
            .unwrap();
        assert_eq!(r.as_int(), Some(9));
        let r = call("builtins.min", &[OpValue::List(vec![OpValue::Int(1)])], &kw)
            .unwrap()
            .unwrap();
        assert_eq!(r.as_int(), Some(1));
    }

    #[test]
    fn other_names_are_not_builtins() {
        assert!(call("aten::min", &[], &[]).is_none());
        assert!(call("min", &[], &[]).is_none());
    }
}
