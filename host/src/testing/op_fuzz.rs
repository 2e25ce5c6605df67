//! An attacker's fuzzer of the op path (issue 43): argument lists for every
//! op a policy serves, generated from the op's schemas, for a harness to
//! send to a worker the way a peer or a plugin would.
//!
//! What this module owns: the cases ([`FuzzCall`], [`FuzzValue`],
//! [`TensorSpec`]), how they are generated ([`calls`]) and how one becomes a
//! call's [`Args`] ([`FuzzCall::to_args`]). Sending them, catching a worker
//! that dies and reporting it is the harness's (`host/tests/op_fuzz.rs`):
//! a crash must not take the fuzzer down with it, so ops never run here.
//!
//! For every overload whose schema the policy serves, the cases are:
//! - each parameter in turn given each boundary value of its type
//!   (negative, zero and huge ints, `i64::MIN`/`MAX`, enum codes libtorch
//!   does not define, NaN and infinities, empty, 0-dim, non-contiguous,
//!   expanded, sparse and extreme-valued tensors of many dtypes, bad
//!   devices, strings that name nothing, a value of the wrong type), once
//!   with the others plausible and once with them at their edges (int64
//!   extremes, -1), so that a boundary value meets another: the smallest
//!   int64 divided by -1 is two arguments;
//! - random combinations of those values (from the seed);
//! - missing, extra and unknown arguments, keyword arguments given
//!   positionally and positional ones by keyword.
//!
//! The same seed gives the same cases, so a failure replays.

use std::fmt;

use crate::abi::Value;
use crate::ops::policy::OpPolicy;
use crate::ops::schema::{Param, parse_params, schema_hazard};
use crate::value::Args;

mod values;

pub use values::{FuzzValue, TENSORS, TensorSpec};
use values::{Ty, boundary, extreme, parse_ty, plausible};

/// One generated call of an op.
#[derive(Debug, Clone, PartialEq)]
pub struct FuzzCall {
    /// The op as the registry names it (`aten::to`).
    pub op: String,
    /// Positional arguments.
    pub args: Vec<FuzzValue>,
    /// Keyword arguments.
    pub kwargs: Vec<(String, FuzzValue)>,
}

impl FuzzCall {
    /// The call's arguments, its tensors built afresh.
    pub fn to_args(&self) -> Args {
        let mut tensors = Vec::new();
        let positional = self.args.iter().map(|v| v.to_value(&mut tensors)).collect();
        let kwargs = self
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), v.to_value(&mut tensors)))
            .collect();
        Args {
            positional,
            kwargs,
            tensors,
            rrefs: Vec::new(),
        }
    }

    /// The arguments of the probe plugin's `run_op_kw(name, args, kwargs)`
    /// that make this call from inside a plugin: `name` is the op, or the
    /// tensor method of [`method_name`](Self::method_name).
    pub fn to_plugin_args(&self, name: &str) -> Args {
        let Args {
            positional,
            kwargs,
            tensors,
            rrefs,
        } = self.to_args();
        let kwargs = kwargs
            .into_iter()
            .map(|(k, v)| (Value::Str(k), v))
            .collect();
        Args {
            positional: vec![
                Value::Str(name.to_owned()),
                Value::List(positional),
                Value::Dict(kwargs),
            ],
            kwargs: Vec::new(),
            tensors,
            rrefs,
        }
    }

    /// The tensor method this call can also be made as (`view` for
    /// `aten::view`), when its first argument is a tensor: the name a
    /// plugin's `Tensor::op` or an RRef proxy calls methods by.
    pub fn method_name(&self) -> Option<&str> {
        let base = self.op.strip_prefix("aten::")?;
        matches!(self.args.first(), Some(FuzzValue::Tensor(_))).then_some(base)
    }
}

impl fmt::Display for FuzzCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.op)?;
        let mut first = true;
        for v in &self.args {
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{v}")?;
        }
        for (k, v) in &self.kwargs {
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{k}={v}")?;
        }
        f.write_str(")")
    }
}

/// A small deterministic generator (SplitMix64): the cases must replay
/// from the seed alone.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        // n is small; the bias is irrelevant for a fuzzer.
        (self.next() % n.max(1) as u64) as usize
    }
}

/// How many cases of each kind [`calls`] makes per overload.
#[derive(Debug, Clone, Copy)]
pub struct FuzzPlan {
    /// The seed of the random combinations.
    pub seed: u64,
    /// Random combinations per overload.
    pub random_per_overload: usize,
    /// At most this many boundary values per parameter (all of them for
    /// `usize::MAX`): CI's bounded run takes the first few of each list,
    /// which start with the values likeliest to break a kernel (enum codes
    /// libtorch does not define, `-1`, `0`, the int64 extremes, NaN, empty
    /// and extreme-valued tensors).
    pub values_per_param: usize,
}

impl Default for FuzzPlan {
    fn default() -> Self {
        FuzzPlan {
            seed: 43,
            random_per_overload: 4,
            values_per_param: usize::MAX,
        }
    }
}

/// Every case for the ops `policy` serves by default families and rules
/// (their overloads with hazard-free schemas, which are the ones it lets
/// calls reach), in a fixed order.
pub fn calls(policy: &OpPolicy, plan: FuzzPlan) -> Vec<FuzzCall> {
    let mut rng = SplitMix(plan.seed);
    let mut out = Vec::new();
    for (name, verdict) in policy.every_op() {
        if !verdict.is_ok_and(|v| v.is_allowed()) {
            continue;
        }
        let schemas = wasmrpc_torch_sys::schemas(&name).unwrap_or_default();
        if schemas.is_empty() {
            // Python's builtins (`builtins.min`): no schema to read.
            out.extend(untyped_calls(&name));
            continue;
        }
        for schema in schemas {
            if schema_hazard(&schema).is_some() {
                continue;
            }
            let Some(params) = parse_params(&schema) else {
                continue;
            };
            overload_calls(&name, &params, plan, &mut rng, &mut out);
        }
    }
    out
}

/// Cases for an op without a schema.
fn untyped_calls(name: &str) -> Vec<FuzzCall> {
    let call = |args: Vec<FuzzValue>| FuzzCall {
        op: name.to_owned(),
        args,
        kwargs: Vec::new(),
    };
    let mut out = vec![call(Vec::new())];
    for v in boundary(&Ty::Scalar)
        .into_iter()
        .chain(boundary(&Ty::Tensor))
    {
        out.push(call(vec![v.clone()]));
        out.push(call(vec![v.clone(), FuzzValue::Int(1)]));
        out.push(call(vec![FuzzValue::List(vec![v.clone(), v])]));
    }
    out
}

fn overload_calls(
    name: &str,
    params: &[Param],
    plan: FuzzPlan,
    rng: &mut SplitMix,
    out: &mut Vec<FuzzCall>,
) {
    let types: Vec<Ty> = params.iter().map(|p| parse_ty(&p.ty)).collect();
    // Plausible values for every parameter; a case passes positionally all
    // parameters that are not keyword-only up to the last one it sets.
    let base: Vec<FuzzValue> = params
        .iter()
        .zip(&types)
        .map(|(p, t)| plausible(t, &p.name))
        .collect();
    let required = params.iter().filter(|p| p.default.is_none()).count();
    let build = |values: &[Option<FuzzValue>]| {
        let mut call = FuzzCall {
            op: name.to_owned(),
            args: Vec::new(),
            kwargs: Vec::new(),
        };
        for (p, v) in params.iter().zip(values) {
            let Some(v) = v else { continue };
            if p.keyword_only {
                call.kwargs.push((p.name.clone(), v.clone()));
            } else {
                call.args.push(v.clone());
            }
        }
        call
    };
    // Required parameters set, defaulted ones left out.
    let minimal: Vec<Option<FuzzValue>> = params
        .iter()
        .zip(&base)
        .map(|(p, v)| p.default.is_none().then(|| v.clone()))
        .collect();
    out.push(build(&minimal));

    // Each parameter in turn, through its boundary values (the first
    // `values_per_param`: the lists start with the likeliest to break a
    // kernel), the others plausible, then at their edges.
    let edges: Vec<FuzzValue> = params
        .iter()
        .zip(&types)
        .map(|(p, t)| extreme(t, &p.name))
        .collect();
    for baseline in [&base, &edges] {
        let start: Vec<Option<FuzzValue>> = params
            .iter()
            .zip(baseline.iter())
            .map(|(p, v)| p.default.is_none().then(|| v.clone()))
            .collect();
        for (i, ty) in types.iter().enumerate() {
            for v in boundary(ty).into_iter().take(plan.values_per_param) {
                let mut case = start.clone();
                // Positional parameters before `i` must be present.
                for (k, slot) in case.iter_mut().enumerate().take(i) {
                    if slot.is_none() && !params[k].keyword_only {
                        *slot = Some(baseline[k].clone());
                    }
                }
                case[i] = Some(v);
                out.push(build(&case));
            }
        }
    }

    // Random combinations.
    let pools: Vec<Vec<FuzzValue>> = types.iter().map(boundary).collect();
    for _ in 0..plan.random_per_overload {
        let case: Vec<Option<FuzzValue>> = pools
            .iter()
            .enumerate()
            .map(|(k, pool)| {
                if rng.below(2) == 0 || pool.is_empty() {
                    Some(base[k].clone())
                } else {
                    Some(pool[rng.below(pool.len())].clone())
                }
            })
            .collect();
        out.push(build(&case));
    }

    // Structural: nothing, one too many, an unknown keyword, a
    // positional parameter by keyword, a keyword-only one positionally.
    out.push(FuzzCall {
        op: name.to_owned(),
        args: Vec::new(),
        kwargs: Vec::new(),
    });
    if required > 0 {
        let mut call = build(&minimal);
        call.args.truncate(required.saturating_sub(1));
        out.push(call);
    }
    let all: Vec<Option<FuzzValue>> = base.iter().cloned().map(Some).collect();
    let mut extra = build(&all);
    extra.args.push(FuzzValue::Int(1));
    out.push(extra);
    let mut unknown = build(&minimal);
    unknown
        .kwargs
        .push(("no_such_argument".into(), FuzzValue::Int(-1)));
    out.push(unknown);
    if let Some(first) = params.first() {
        let mut by_name = build(&minimal);
        if !by_name.args.is_empty() && !first.keyword_only {
            let v = by_name.args.remove(0);
            by_name.kwargs.push((first.name.clone(), v));
            out.push(by_name);
        }
    }
    if params.iter().any(|p| p.keyword_only) {
        let mut positional = build(&all);
        let kwargs = std::mem::take(&mut positional.kwargs);
        positional.args.extend(kwargs.into_iter().map(|(_, v)| v));
        out.push(positional);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn schema_types_are_read_with_their_lists_and_options() {
        assert_eq!(parse_ty("Tensor(a!)"), Ty::Tensor);
        assert_eq!(parse_ty("int[2]"), Ty::List(Box::new(Ty::Int), Some(2)));
        assert_eq!(
            parse_ty("Tensor?[]"),
            Ty::List(Box::new(Ty::Optional(Box::new(Ty::Tensor))), None)
        );
        assert_eq!(
            parse_ty("SymInt[]?"),
            Ty::Optional(Box::new(Ty::List(Box::new(Ty::Int), None)))
        );
        assert_eq!(
            parse_ty("ScalarType?"),
            Ty::Optional(Box::new(Ty::ScalarType))
        );
        assert_eq!(parse_ty("Dict(str, Tensor)"), Ty::Other);
    }

    #[test]
    fn every_enum_code_past_the_defined_ones_is_tried() {
        let codes: Vec<FuzzValue> = boundary(&Ty::ScalarType);
        for bad in [-1, 46, 47, 127, 128, 255, 256, i64::MAX, i64::MIN] {
            assert!(codes.contains(&FuzzValue::Int(bad)), "{bad}");
        }
        // The defined ones too: 0 (uint8) to 45.
        assert!((0..=45).all(|c| codes.contains(&FuzzValue::Int(c))));
    }

    #[test]
    fn the_issue_43_crashes_are_among_the_cases() {
        let cases = calls(&OpPolicy::default(), FuzzPlan::default());
        for op in ["aten::to", "aten::to_dense", "aten::view"] {
            let crash = FuzzCall {
                op: op.into(),
                args: vec![
                    FuzzValue::Tensor(TensorSpec::Matrix(Kind::Float)),
                    FuzzValue::Int(-1),
                ],
                kwargs: Vec::new(),
            };
            assert!(cases.contains(&crash), "{crash} is not generated");
        }
        // The same seed gives the same cases (compared as text: NaN is
        // not equal to itself).
        let again = calls(&OpPolicy::default(), FuzzPlan::default());
        assert_eq!(cases.len(), again.len());
        assert!(
            cases
                .iter()
                .zip(&again)
                .all(|(a, b)| format!("{a:?}") == format!("{b:?}")),
            "the cases differ from one generation to the next"
        );
        eprintln!("{} cases", cases.len());
    }
}
