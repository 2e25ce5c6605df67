//! Conversions between Rust types and [`Value`]: [`FromValue`] for
//! arguments, [`IntoValue`] for results, [`ToValue`] for what a plugin sends
//! to the host.
//!
//! Ownership of handles follows the protocol's rule, *requests borrow,
//! outcomes move*: [`ToValue`] borrows a [`Tensor`]'s handle (the tensor is
//! still dropped by its owner), [`IntoValue`] moves it into the value (the
//! host takes it with the result), and [`FromValue`] takes ownership of a
//! handle the host sent.

use crate::{Error, RRef, Tensor};
use wasmrpc_abi::{Value, WorkerInfo};

/// A type a plugin function can take as an argument.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a parameter of a remote function",
    label = "not convertible from a `Value`",
    note = "use a type that implements `FromValue`: integers, floats, bool, String, Vec<T>, Option<T>, tuples, Tensor, RRef, AnyValue, Value"
)]
pub trait FromValue: Sized {
    /// Converts `value`, failing with a `TypeError` that names the expected
    /// type.
    ///
    /// # Errors
    /// A `TypeError` when `value` has another type.
    fn from_value(value: Value) -> Result<Self, Error>;

    /// The value of a parameter the caller left out, if the type has one
    /// (`None` for `Option`); `None` makes the argument required.
    fn missing() -> Option<Self> {
        None
    }
}

/// A type a plugin function can return: it moves into the result.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be returned from a remote function",
    note = "return a type that implements `IntoValue`, or a `Result` of one"
)]
pub trait IntoValue {
    /// Converts into a value; handles move with it.
    fn into_value(self) -> Value;
}

/// A type a plugin can send to the host as an argument: the value borrows
/// its handles.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be sent as a value",
    note = "send a type that implements `ToValue`: numbers, bool, strings, Vec<T>, Option<T>, tuples, Tensor, RRef, AnyValue, Value",
    note = "a `Future` is not a value (PyTorch: \"Can not pickle torch.futures.Future\"): wait for it and send its result"
)]
pub trait ToValue {
    /// Converts into a value whose handles are borrowed from `self`.
    fn to_value(&self) -> Value;
}

/// A value of any type that owns the handles inside it: dropping it
/// releases them. Take it as a parameter where a raw [`Value`] would leak
/// the tensors a caller sends.
#[derive(Debug)]
pub struct AnyValue(Option<Value>);

impl AnyValue {
    /// Takes ownership of the handles in `value`.
    pub(crate) fn new(value: Value) -> AnyValue {
        AnyValue(Some(value))
    }

    /// The value, still owned by `self`.
    pub fn get(&self) -> &Value {
        // `None` only after `into_inner`, which consumes `self`.
        self.0.as_ref().unwrap_or(&Value::None)
    }

    /// The raw value; its handles are now the caller's to release.
    pub fn into_inner(mut self) -> Value {
        self.0.take().unwrap_or(Value::None)
    }
}

fn release(value: Value) {
    match value {
        Value::Tensor(h) => drop(Tensor::from_raw(h)),
        Value::RRef(h) => drop(RRef::from_raw(h)),
        Value::List(items) | Value::Tuple(items) => items.into_iter().for_each(release),
        Value::Dict(pairs) => pairs.into_iter().for_each(|(k, v)| {
            release(k);
            release(v);
        }),
        Value::Record { fields, .. } => fields.into_iter().for_each(|(_, v)| release(v)),
        _ => {}
    }
}

impl Drop for AnyValue {
    fn drop(&mut self) {
        if let Some(v) = self.0.take() {
            release(v);
        }
    }
}

impl FromValue for AnyValue {
    fn from_value(value: Value) -> Result<Self, Error> {
        Ok(AnyValue(Some(value)))
    }
}
impl IntoValue for AnyValue {
    fn into_value(self) -> Value {
        self.into_inner()
    }
}
impl ToValue for AnyValue {
    fn to_value(&self) -> Value {
        self.get().clone()
    }
}

pub(crate) fn mismatch(expected: &str, got: &Value) -> Error {
    Error::type_error(format!("expected {expected}, got {}", got.type_name()))
}

impl FromValue for Value {
    fn from_value(value: Value) -> Result<Self, Error> {
        Ok(value)
    }
}
impl IntoValue for Value {
    fn into_value(self) -> Value {
        self
    }
}
impl ToValue for Value {
    fn to_value(&self) -> Value {
        self.clone()
    }
}

impl<T: ToValue + ?Sized> ToValue for &T {
    fn to_value(&self) -> Value {
        (**self).to_value()
    }
}

impl FromValue for () {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::None => Ok(()),
            other => Err(mismatch("None", &other)),
        }
    }
}
impl IntoValue for () {
    fn into_value(self) -> Value {
        Value::None
    }
}
impl ToValue for () {
    fn to_value(&self) -> Value {
        Value::None
    }
}

impl FromValue for bool {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::Bool(b) => Ok(b),
            other => Err(mismatch("bool", &other)),
        }
    }
}
impl IntoValue for bool {
    fn into_value(self) -> Value {
        Value::Bool(self)
    }
}
impl ToValue for bool {
    fn to_value(&self) -> Value {
        Value::Bool(*self)
    }
}

macro_rules! int {
    ($($t:ty),*) => {$(
        impl FromValue for $t {
            fn from_value(value: Value) -> Result<Self, Error> {
                match value {
                    Value::Int(i) => <$t>::try_from(i).map_err(|_| {
                        Error::value_error(format!("{i} does not fit in {}", stringify!($t)))
                    }),
                    other => Err(mismatch("int", &other)),
                }
            }
        }
        impl IntoValue for $t {
            fn into_value(self) -> Value {
                self.to_value()
            }
        }
        impl ToValue for $t {
            fn to_value(&self) -> Value {
                // Saturating: only u64/usize beyond i64::MAX are clipped.
                Value::Int(i64::try_from(*self).unwrap_or(i64::MAX))
            }
        }
    )*};
}
int!(i64, i32, i16, i8, u64, u32, u16, u8, usize);

impl FromValue for f64 {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::Float(f) => Ok(f),
            // Python accepts an int where a float is expected.
            Value::Int(i) => Ok(i as f64),
            other => Err(mismatch("float", &other)),
        }
    }
}
impl IntoValue for f64 {
    fn into_value(self) -> Value {
        Value::Float(self)
    }
}
impl ToValue for f64 {
    fn to_value(&self) -> Value {
        Value::Float(*self)
    }
}
impl FromValue for f32 {
    fn from_value(value: Value) -> Result<Self, Error> {
        f64::from_value(value).map(|f| f as f32)
    }
}
impl IntoValue for f32 {
    fn into_value(self) -> Value {
        Value::Float(f64::from(self))
    }
}
impl ToValue for f32 {
    fn to_value(&self) -> Value {
        Value::Float(f64::from(*self))
    }
}

impl FromValue for String {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::Str(s) => Ok(s),
            other => Err(mismatch("str", &other)),
        }
    }
}
impl IntoValue for String {
    fn into_value(self) -> Value {
        Value::Str(self)
    }
}
impl ToValue for String {
    fn to_value(&self) -> Value {
        Value::Str(self.clone())
    }
}
impl IntoValue for &str {
    fn into_value(self) -> Value {
        Value::Str(self.into())
    }
}
impl ToValue for str {
    fn to_value(&self) -> Value {
        Value::Str(self.into())
    }
}

impl FromValue for WorkerInfo {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::WorkerInfo(w) => Ok(w),
            other => Err(mismatch("WorkerInfo", &other)),
        }
    }
}
impl IntoValue for WorkerInfo {
    fn into_value(self) -> Value {
        Value::WorkerInfo(self)
    }
}
impl ToValue for WorkerInfo {
    fn to_value(&self) -> Value {
        Value::WorkerInfo(self.clone())
    }
}

impl FromValue for Tensor {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::Tensor(h) => Ok(Tensor::from_raw(h)),
            other => Err(mismatch("Tensor", &other)),
        }
    }
}
impl IntoValue for Tensor {
    fn into_value(self) -> Value {
        Value::Tensor(self.into_raw())
    }
}
impl ToValue for Tensor {
    fn to_value(&self) -> Value {
        Value::Tensor(self.handle())
    }
}

impl FromValue for RRef {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::RRef(h) => Ok(RRef::from_raw(h)),
            other => Err(mismatch("RRef", &other)),
        }
    }
}
impl IntoValue for RRef {
    fn into_value(self) -> Value {
        Value::RRef(self.into_raw())
    }
}
impl ToValue for RRef {
    fn to_value(&self) -> Value {
        Value::RRef(self.handle())
    }
}

impl<T: FromValue> FromValue for Option<T> {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::None => Ok(None),
            other => T::from_value(other).map(Some),
        }
    }
    fn missing() -> Option<Self> {
        Some(None)
    }
}
impl<T: IntoValue> IntoValue for Option<T> {
    fn into_value(self) -> Value {
        self.map_or(Value::None, IntoValue::into_value)
    }
}
impl<T: ToValue> ToValue for Option<T> {
    fn to_value(&self) -> Value {
        self.as_ref().map_or(Value::None, ToValue::to_value)
    }
}

impl<T: FromValue> FromValue for Vec<T> {
    fn from_value(value: Value) -> Result<Self, Error> {
        match value {
            Value::List(items) | Value::Tuple(items) => {
                items.into_iter().map(T::from_value).collect()
            }
            other => Err(mismatch("list", &other)),
        }
    }
}
impl<T: IntoValue> IntoValue for Vec<T> {
    fn into_value(self) -> Value {
        Value::List(self.into_iter().map(IntoValue::into_value).collect())
    }
}
impl<T: ToValue> ToValue for Vec<T> {
    fn to_value(&self) -> Value {
        self.as_slice().to_value()
    }
}
impl<T: ToValue> ToValue for [T] {
    fn to_value(&self) -> Value {
        Value::List(self.iter().map(ToValue::to_value).collect())
    }
}

macro_rules! tuple {
    ($n:literal: $($t:ident $i:tt),+) => {
        impl<$($t: FromValue),+> FromValue for ($($t,)+) {
            fn from_value(value: Value) -> Result<Self, Error> {
                match value {
                    Value::Tuple(items) | Value::List(items) if items.len() == $n => {
                        let mut items = items.into_iter();
                        Ok(($({
                            let _ = $i;
                            // The length was checked just above.
                            $t::from_value(items.next().unwrap_or(Value::None))?
                        },)+))
                    }
                    other => Err(mismatch(concat!("a tuple of ", $n), &other)),
                }
            }
        }
        impl<$($t: IntoValue),+> IntoValue for ($($t,)+) {
            fn into_value(self) -> Value {
                Value::Tuple(vec![$(self.$i.into_value()),+])
            }
        }
        impl<$($t: ToValue),+> ToValue for ($($t,)+) {
            fn to_value(&self) -> Value {
                Value::Tuple(vec![$(self.$i.to_value()),+])
            }
        }
    };
}
tuple!(1: A 0);
tuple!(2: A 0, B 1);
tuple!(3: A 0, B 1, C 2);
tuple!(4: A 0, B 1, C 2, D 3);

/// Arguments of a call made from a plugin: a tuple of [`ToValue`]s (up to
/// six), `()`, or a `Vec<Value>`.
pub trait ToArgs {
    /// The positional arguments, borrowing handles.
    fn to_args(&self) -> Vec<Value>;
}
impl<T: ToArgs + ?Sized> ToArgs for &T {
    fn to_args(&self) -> Vec<Value> {
        (**self).to_args()
    }
}
impl ToArgs for () {
    fn to_args(&self) -> Vec<Value> {
        Vec::new()
    }
}
impl ToArgs for Vec<Value> {
    fn to_args(&self) -> Vec<Value> {
        self.clone()
    }
}
impl ToArgs for [Value] {
    fn to_args(&self) -> Vec<Value> {
        self.to_vec()
    }
}
macro_rules! args {
    ($($t:ident $i:tt),+) => {
        impl<$($t: ToValue),+> ToArgs for ($($t,)+) {
            fn to_args(&self) -> Vec<Value> {
                vec![$(self.$i.to_value()),+]
            }
        }
    };
}
args!(A 0);
args!(A 0, B 1);
args!(A 0, B 1, C 2);
args!(A 0, B 1, C 2, D 3);
args!(A 0, B 1, C 2, D 3, E 4);
args!(A 0, B 1, C 2, D 3, E 4, F 5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_convert_both_ways() {
        assert_eq!(i64::from_value(Value::Int(3)), Ok(3));
        assert_eq!(f64::from_value(Value::Int(3)), Ok(3.0));
        assert_eq!(
            u8::from_value(Value::Int(300)).unwrap_err().kind(),
            crate::ErrorKind::ValueError
        );
        let e = String::from_value(Value::Int(1)).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::TypeError);
        assert_eq!(e.message(), "expected str, got int");
        assert_eq!(
            (1i64, "x").to_value(),
            Value::Tuple(vec![Value::Int(1), Value::Str("x".into())])
        );
        assert_eq!(
            <(i64, bool)>::from_value(Value::List(vec![Value::Int(1), Value::Bool(true)])),
            Ok((1, true))
        );
        assert!(<(i64, bool)>::from_value(Value::List(vec![Value::Int(1)])).is_err());
        assert_eq!(Option::<i64>::from_value(Value::None), Ok(None));
        assert_eq!(Option::<i64>::missing(), Some(None));
        assert_eq!(i64::missing(), None);
        assert_eq!(
            vec![1i64, 2].into_value(),
            Value::List(vec![Value::Int(1), Value::Int(2)])
        );
    }
}
