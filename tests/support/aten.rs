//! TEST-ONLY stand-ins for builtin ops, named like the aten schemas
//! (`aten::add`), calling tch directly. The real op shim (libtorch's
//! operator registry and its schema matching) replaces them; until then they
//! let the seed tests that merely *use* `torch.add` run.

use tch::{Scalar, Tensor};
use wasmrpc::{Args, Error, FunctionRegistry, Payload, Result, Value};

/// A tensor or a Python scalar operand.
enum Operand {
    Tensor(Tensor),
    Int(i64),
    Float(f64),
}

fn operand(p: &Payload) -> Result<Operand> {
    match p.value {
        Value::Tensor(_) => Ok(Operand::Tensor(p.as_tensor()?)),
        Value::Int(i) => Ok(Operand::Int(i)),
        Value::Bool(b) => Ok(Operand::Int(i64::from(b))),
        Value::Float(f) => Ok(Operand::Float(f)),
        _ => Err(Error::type_error(format!(
            "unsupported operand type: {}",
            p.value.type_name()
        ))),
    }
}

fn scalar(o: &Operand) -> Option<Scalar> {
    match o {
        Operand::Int(i) => Some(Scalar::int(*i)),
        Operand::Float(f) => Some(Scalar::float(*f)),
        Operand::Tensor(_) => None,
    }
}

/// `a + b` with Python/torch semantics for tensors and scalars.
///
/// # Errors
/// libtorch's error (e.g. "The size of tensor a ... must match ...").
pub fn add(a: &Payload, b: &Payload) -> Result<Payload> {
    binary(
        a,
        b,
        |x, y| x.f_add(y),
        |x, s| x.f_add_scalar(s),
        |x, y| x + y,
        |x, y| x + y,
    )
}

/// `a * b`.
///
/// # Errors
/// libtorch's error.
pub fn mul(a: &Payload, b: &Payload) -> Result<Payload> {
    binary(
        a,
        b,
        |x, y| x.f_mul(y),
        |x, s| x.f_mul_scalar(s),
        |x, y| x * y,
        |x, y| x * y,
    )
}

/// `a - b`.
///
/// # Errors
/// libtorch's error.
pub fn sub(a: &Payload, b: &Payload) -> Result<Payload> {
    let neg = |p: &Payload| -> Result<Payload> {
        match operand(p)? {
            Operand::Tensor(t) => Ok(t.f_neg()?.into()),
            Operand::Int(i) => Ok(Payload::from(-i)),
            Operand::Float(f) => Ok(Payload::from(-f)),
        }
    };
    add(a, &neg(b)?)
}

fn binary(
    a: &Payload,
    b: &Payload,
    tt: impl Fn(&Tensor, &Tensor) -> std::result::Result<Tensor, tch::TchError>,
    ts: impl Fn(&Tensor, Scalar) -> std::result::Result<Tensor, tch::TchError>,
    ii: impl Fn(i64, i64) -> i64,
    ff: impl Fn(f64, f64) -> f64,
) -> Result<Payload> {
    let (x, y) = (operand(a)?, operand(b)?);
    Ok(match (&x, &y) {
        (Operand::Tensor(p), Operand::Tensor(q)) => tt(p, q)?.into(),
        (Operand::Tensor(p), o) | (o, Operand::Tensor(p)) => {
            ts(p, scalar(o).unwrap_or(Scalar::int(0)))?.into()
        }
        (Operand::Int(p), Operand::Int(q)) => ii(*p, *q).into(),
        (Operand::Int(p), Operand::Float(q)) => ff(*p as f64, *q).into(),
        (Operand::Float(p), Operand::Int(q)) => ff(*p, *q as f64).into(),
        (Operand::Float(p), Operand::Float(q)) => ff(*p, *q).into(),
    })
}

fn two(args: &Args, name: &str) -> Result<(Payload, Payload)> {
    args.check_arity(name, 2, 2, &["input", "other"])?;
    Ok((args.param(0, "input")?, args.param(1, "other")?))
}

/// Registers `aten::add`, `aten::mul`, `aten::sub`, `aten::nonzero` and the
/// Python builtin `builtins::min`.
pub fn register(r: &FunctionRegistry) {
    r.register_native("aten::add", |_ctx, args| async move {
        let (a, b) = two(&args, "add")?;
        add(&a, &b)
    });
    r.register_native("aten::mul", |_ctx, args| async move {
        let (a, b) = two(&args, "mul")?;
        mul(&a, &b)
    });
    r.register_native("aten::sub", |_ctx, args| async move {
        let (a, b) = two(&args, "sub")?;
        sub(&a, &b)
    });
    r.register_native("aten::nonzero", |_ctx, args| async move {
        args.check_arity("nonzero", 1, 1, &["input"])?;
        Ok(args.param(0, "input")?.as_tensor()?.f_nonzero()?.into())
    });
    r.register_native("builtins::min", |_ctx, args| async move {
        let mut best: Option<Payload> = None;
        for i in 0..args.len() {
            let v = args.get(i)?;
            let smaller = match &best {
                None => true,
                Some(b) => v.as_float()? < b.as_float()?,
            };
            if smaller {
                best = Some(v);
            }
        }
        best.ok_or_else(|| Error::type_error("min expected at least 1 argument, got 0"))
    });
}
