//! Builtin ops by schema name: overload matching, kwargs and defaults,
//! outputs, PyTorch's error texts, sparse tensors, autograd, threads.

use tch::{Device, Kind, Tensor};
use wasmrpc_torch_sys::{
    ErrorKind, GradFn, GradOptions, NO_MATCHING_SCHEMA, OpError, OpValue, Operator, backward,
    call_method, call_op, grad, grad_fn_name, register_hook, schemas,
};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

fn t(v: &[f32], shape: &[i64]) -> OpValue {
    OpValue::Tensor(Tensor::from_slice(v).reshape(shape))
}

fn ones(shape: &[i64]) -> OpValue {
    OpValue::Tensor(Tensor::ones(shape, F32))
}

fn kw(name: &str, v: impl Into<OpValue>) -> (String, OpValue) {
    (name.to_owned(), v.into())
}

fn ints(v: &[i64]) -> OpValue {
    OpValue::List(v.iter().map(|i| OpValue::Int(*i)).collect())
}

/// The one tensor an op returned.
fn tensor(mut out: Vec<OpValue>) -> Tensor {
    assert_eq!(out.len(), 1, "expected one output, got {out:?}");
    out.pop().unwrap().into_tensor().expect("a tensor output")
}

fn values(t: &Tensor) -> Vec<f64> {
    let flat = t.to_kind(Kind::Double).reshape([-1]);
    Vec::<f64>::try_from(&flat).unwrap()
}

#[test]
fn add_of_two_tensors_picks_add_tensor() {
    let op = Operator::resolve("aten::add").unwrap();
    let args = [t(&[1., 2.], &[2]), t(&[10., 20.], &[2])];
    let schema = op.matching_schema(&args, &[]).unwrap();
    assert!(schema.starts_with("aten::add.Tensor("), "{schema}");
    assert_eq!(values(&tensor(op.call(&args, &[]).unwrap())), [11., 22.]);
}

#[test]
fn add_of_tensor_and_int_picks_add_scalar_and_takes_alpha() {
    let op = Operator::resolve("aten::add").unwrap();
    let args = [ones(&[2, 2]), OpValue::Int(1)];
    let schema = op.matching_schema(&args, &[]).unwrap();
    assert!(schema.starts_with("aten::add.Scalar("), "{schema}");
    assert_eq!(values(&tensor(op.call(&args, &[]).unwrap())), [2.; 4]);
    let out = tensor(op.call(&args, &[kw("alpha", 3_i64)]).unwrap());
    assert_eq!(values(&out), [4.; 4]);
    // alpha on add.Tensor: a + alpha * b.
    let out = tensor(call_op("aten::add", &[ones(&[2]), ones(&[2])], &[kw("alpha", 2.5)]).unwrap());
    assert_eq!(values(&out), [3.5, 3.5]);
}

#[test]
fn wire_and_bare_names_resolve_to_aten() {
    let a = tensor(call_op("torch.ops.aten.add", &[ones(&[2]), OpValue::Int(2)], &[]).unwrap());
    assert_eq!(values(&a), [3., 3.]);
    assert_eq!(Operator::resolve("add").unwrap().name(), "aten::add");
    assert!(schemas("aten::add").unwrap().len() >= 10);
}

#[test]
fn matmul_and_multi_dot_over_a_list_of_tensors() {
    let a = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let b = t(&[1., 0., 0., 1., 1., 1.], &[3, 2]);
    let mm = tensor(call_op("aten::matmul", &[a.shallow_clone(), b.shallow_clone()], &[]).unwrap());
    assert_eq!(mm.size(), [2, 2]);
    assert_eq!(values(&mm), [4., 5., 10., 11.]);
    let c = t(&[2., 0., 0., 2.], &[2, 2]);
    let chain = tensor(
        call_op(
            "aten::linalg_multi_dot",
            &[OpValue::List(vec![a, b, c])],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(values(&chain), [8., 10., 20., 22.]);
}

#[test]
fn ones_with_a_size_list_and_dtype_kwargs() {
    let out =
        tensor(call_op("aten::ones", &[ints(&[2, 3])], &[kw("dtype", Kind::Double)]).unwrap());
    assert_eq!(out.size(), [2, 3]);
    assert_eq!(out.kind(), Kind::Double);
    // A ScalarType may also be its integer code, as TorchScript stores it.
    let out = tensor(call_op("aten::ones", &[ints(&[4])], &[kw("dtype", 4_i64)]).unwrap());
    assert_eq!(out.kind(), Kind::Int64);
    // A single int broadcasts to a fixed-size int[N] (`int[2] stride`).
    let x = OpValue::Tensor(Tensor::ones([1, 1, 4, 4], F32));
    let pooled = tensor(call_op("aten::max_pool2d", &[x, OpValue::Int(2)], &[]).unwrap());
    assert_eq!(pooled.size(), [1, 1, 2, 2]);
}

#[test]
fn max_dim_returns_values_and_indices() {
    let x = t(&[1., 5., 3., 7., 2., 0.], &[2, 3]);
    let out = call_op("aten::max", &[x, OpValue::Int(1)], &[]).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(values(out[0].as_tensor().unwrap()), [5., 7.]);
    assert_eq!(values(out[1].as_tensor().unwrap()), [1., 0.]);
    match OpValue::from_outputs(out) {
        OpValue::Tuple(items) => assert_eq!(items.len(), 2),
        other => panic!("expected a tuple, got {other:?}"),
    }
    let kept = call_op(
        "aten::max",
        &[t(&[1., 5.], &[1, 2]), OpValue::Int(1)],
        &[kw("keepdim", true)],
    )
    .unwrap();
    assert_eq!(kept[0].as_tensor().unwrap().size(), [1, 1]);
}

#[test]
fn scalar_returning_ops() {
    let x = ones(&[2, 3]);
    let size1 = call_op("aten::size", &[x.shallow_clone(), OpValue::Int(1)], &[]).unwrap();
    assert_eq!(size1[0].as_int(), Some(3));
    let sizes = call_op("aten::size", &[x.shallow_clone()], &[]).unwrap();
    let sizes: Vec<i64> = sizes[0]
        .as_slice()
        .unwrap()
        .iter()
        .map(|v| v.as_int().unwrap())
        .collect();
    assert_eq!(sizes, [2, 3]);
    let item = call_op("aten::item", &[t(&[2.5], &[1])], &[]).unwrap();
    assert_eq!(item[0].as_float(), Some(2.5));
    let dim = call_op("aten::dim", &[x], &[]).unwrap();
    assert_eq!(dim[0].as_int(), Some(2));
}

#[test]
fn strings_devices_and_bools_cross_both_ways() {
    let lower = call_op("aten::lower", &[OpValue::Str("ABC".into())], &[]).unwrap();
    assert!(
        matches!(&lower[0], OpValue::Str(s) if s == "abc"),
        "{lower:?}"
    );
    let device = call_op("prim::device", &[ones(&[1])], &[]).unwrap();
    assert!(
        matches!(device[0], OpValue::Device(Device::Cpu)),
        "{device:?}"
    );
    let moved = tensor(call_method("to", &[ones(&[1]), OpValue::Str("cpu".into())], &[]).unwrap());
    assert_eq!(moved.device(), Device::Cpu);
    let equal = call_op("aten::equal", &[ones(&[2]), ones(&[2])], &[]).unwrap();
    assert_eq!(equal[0].as_bool(), Some(true));
}

#[test]
fn split_returns_a_list_and_in_place_ops_mutate() {
    let x = t(&[1., 2., 3., 4., 5.], &[5]);
    let parts = call_op("aten::split", &[x.shallow_clone(), OpValue::Int(2)], &[]).unwrap();
    let parts = parts[0].as_slice().unwrap();
    let sizes: Vec<Vec<i64>> = parts
        .iter()
        .map(|p| p.as_tensor().unwrap().size())
        .collect();
    assert_eq!(sizes, [vec![2], vec![2], vec![1]]);

    let out = tensor(call_op("aten::mul_", &[x.shallow_clone(), OpValue::Int(2)], &[]).unwrap());
    assert_eq!(values(x.as_tensor().unwrap()), [2., 4., 6., 8., 10.]);
    assert_eq!(values(&out), [2., 4., 6., 8., 10.]);
}

#[test]
fn optional_and_default_arguments() {
    let x = t(&[1., 2., 3., 4.], &[2, 2]);
    // `dim` is `int[1]?`: None, a list, or one int.
    let all = tensor(call_op("aten::sum", &[x.shallow_clone()], &[]).unwrap());
    assert_eq!(values(&all), [10.]);
    let rows = tensor(call_op("aten::sum", &[x.shallow_clone(), ints(&[1])], &[]).unwrap());
    assert_eq!(values(&rows), [3., 7.]);
    let cols = tensor(
        call_op(
            "aten::sum",
            &[x.shallow_clone(), OpValue::Int(0)],
            &[kw("keepdim", true)],
        )
        .unwrap(),
    );
    assert_eq!(cols.size(), [1, 2]);
    let dtype = tensor(call_op("aten::sum", &[x], &[kw("dtype", Kind::Double)]).unwrap());
    assert_eq!(dtype.kind(), Kind::Double);
}

#[test]
fn every_argument_may_be_a_keyword_and_keyword_only_ones_must_be() {
    let out = tensor(
        call_op(
            "aten::add",
            &[],
            &[kw("self", ones(&[2])), kw("other", ones(&[2]))],
        )
        .unwrap(),
    );
    assert_eq!(values(&out), [2., 2.]);
    // `alpha` is keyword-only in every add overload.
    let err = call_op("aten::add", &[ones(&[2]), ones(&[2]), OpValue::Int(2)], &[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("positional argument(s) but 3 was/were given"),
        "{err}"
    );
    // Too many arguments for any schema.
    let err = call_op("aten::neg", &[ones(&[2]), ones(&[2])], &[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("expected at most 1 argument(s) but received 2"),
        "{err}"
    );
}

#[test]
fn rref_proxy_tensor_calls_like_the_seed() {
    // `_test_rref_proxy_tensor`: size(), add(1), view(1, 4) on ones(2, 2) + 1 + 3.
    let x = OpValue::Tensor(Tensor::ones([2, 2], F32) + 4.0);
    let size = call_method("size", &[x.shallow_clone()], &[]).unwrap();
    let size: Vec<i64> = size[0]
        .as_slice()
        .unwrap()
        .iter()
        .map(|v| v.as_int().unwrap())
        .collect();
    assert_eq!(size, [2, 2]);
    let added = tensor(call_method("add", &[x.shallow_clone(), OpValue::Int(1)], &[]).unwrap());
    assert_eq!(values(&added), [6.; 4]);
    let viewed = tensor(call_method("view", &[x, OpValue::Int(1), OpValue::Int(4)], &[]).unwrap());
    assert_eq!(viewed.size(), [1, 4]);
}

#[test]
fn tensor_methods_resolve_through_the_registry() {
    let x = t(&[1., 2., 3., 4., 5., 6.], &[6]);
    let viewed = tensor(
        call_method(
            "view",
            &[x.shallow_clone(), OpValue::Int(2), OpValue::Int(3)],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(viewed.size(), [2, 3]);
    let viewed = tensor(call_method("view", &[x.shallow_clone(), ints(&[3, 2])], &[]).unwrap());
    assert_eq!(viewed.size(), [3, 2]);
    let size = call_method("size", &[x.shallow_clone()], &[]).unwrap();
    assert_eq!(size[0].as_slice().unwrap().len(), 1);
    let sum = tensor(call_method("sum", &[x.shallow_clone()], &[]).unwrap());
    assert_eq!(values(&sum), [21.]);
    let double = tensor(
        call_method(
            "to",
            &[x.shallow_clone(), OpValue::Dtype(Kind::Double)],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(double.kind(), Kind::Double);
    let added = tensor(call_method("add", &[x.shallow_clone(), x], &[]).unwrap());
    assert_eq!(values(&added), [2., 4., 6., 8., 10., 12.]);
    // Varargs only apply to methods: as a function, view(t, 2, 3) matches nothing.
    let err = call_op(
        "aten::view",
        &[ones(&[6]), OpValue::Int(2), OpValue::Int(3)],
        &[],
    )
    .unwrap_err();
    assert!(matches!(err, OpError::NoMatchingSchema { .. }), "{err}");
}

#[test]
fn common_tensor_methods_resolve() {
    for name in [
        "size",
        "view",
        "sum",
        "to",
        "add",
        "mul",
        "sub",
        "div",
        "matmul",
        "reshape",
        "permute",
        "transpose",
        "t",
        "contiguous",
        "clone",
        "detach",
        "item",
        "dim",
        "numel",
        "cpu",
        "flatten",
        "unsqueeze",
        "squeeze",
        "expand",
        "repeat",
        "max",
        "min",
        "mean",
        "abs",
        "neg",
        "exp",
        "relu",
        "sigmoid",
        "tanh",
        "softmax",
        "index_select",
        "narrow",
        "select",
        "chunk",
        "split",
        "norm",
        "pow",
        "sqrt",
        "zero_",
        "fill_",
        "copy_",
        "add_",
        "mul_",
        "requires_grad_",
        "coalesce",
        "to_dense",
        "_indices",
        "_values",
        "is_coalesced",
        "_nnz",
        "nonzero",
        "argmax",
        "topk",
        "sort",
        "eq",
        "all",
        "any",
        "gather",
        "masked_fill",
        "type_as",
        "view_as",
        "expand_as",
        "new_zeros",
        "new_ones",
        "stride",
        "is_contiguous",
    ] {
        assert!(Operator::resolve(name).is_ok(), "{name} does not resolve");
    }
}

#[test]
fn tensor_properties_fall_back_to_prim_ops() {
    let x = sparse();
    let is_sparse = call_method("is_sparse", &[x.shallow_clone()], &[]).unwrap();
    assert_eq!(is_sparse[0].as_bool(), Some(true));
    let dtype = call_method("dtype", &[x.shallow_clone()], &[]).unwrap();
    assert_eq!(dtype[0].as_int(), Some(6), "ScalarType Float is 6");
    // `aten::device` exists (the `torch.device("cpu")` constructor) but takes
    // no tensor: the property comes from `prim::device`.
    let device = call_method("device", &[x.shallow_clone()], &[]).unwrap();
    assert!(matches!(device[0], OpValue::Device(Device::Cpu)));
    let rg = call_method("requires_grad", &[x], &[]).unwrap();
    assert_eq!(rg[0].as_bool(), Some(false));
    // A method that exists nowhere is Python's AttributeError, as the
    // seeds' RRef-proxy tests assert.
    let err = call_method("non_exist", &[ones(&[1])], &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::AttributeError);
    assert_eq!(
        err.to_string(),
        "'Tensor' object has no attribute 'non_exist'"
    );
    let err = call_method("tolist", &[ones(&[1])], &[]).unwrap_err();
    assert!(
        err.to_string().contains("has no attribute 'tolist'"),
        "{err}"
    );
    let err = call_method("view", &[ones(&[6]), OpValue::Str("x".into())], &[]).unwrap_err();
    assert!(err.to_string().contains("aten::view"), "{err}");
}

#[test]
fn nonzero_like_the_seed() {
    let x = t(&[0., 1., 0., 2.], &[4]);
    let nz = tensor(call_op("aten::nonzero", &[x], &[]).unwrap());
    assert_eq!(nz.size(), [2, 1]);
    assert_eq!(values(&nz), [1., 3.]);
}

#[test]
fn no_matching_overload_lists_every_schema_tried() {
    // The seed's `rpc_sync(dst, torch.add, args=())`.
    let err = call_op("aten::add", &[], &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RuntimeError);
    let text = err.to_string();
    assert!(text.starts_with(NO_MATCHING_SCHEMA), "{text}");
    assert!(text.contains("failed to match any schema"), "{text}");
    assert!(
        text.contains("aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"),
        "{text}"
    );
    assert!(text.contains("aten::add.Scalar("), "{text}");
    assert!(
        text.contains("is missing value for argument 'self'"),
        "{text}"
    );

    let err = call_op("aten::add", &[ones(&[2]), OpValue::Str("x".into())], &[]).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(
            "Expected a value of type 'Tensor' for argument 'other' but instead found type 'str'"
        ),
        "{text}"
    );

    let err = call_op("aten::add", &[ones(&[2]), ones(&[2])], &[kw("beta", 1_i64)]).unwrap_err();
    assert!(err.to_string().contains("beta"), "{err}");
}

#[test]
fn libtorch_messages_pass_through() {
    let err = call_op("aten::add", &[ones(&[2]), ones(&[3])], &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RuntimeError);
    assert!(matches!(err, OpError::Raised { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("The size of tensor a (2) must match the size of tensor b (3)"),
        "{text}"
    );
    assert!(
        !text.contains("Exception raised from"),
        "backtrace leaked: {text}"
    );

    let err = call_op(
        "aten::select",
        &[ones(&[2]), OpValue::Int(0), OpValue::Int(10)],
        &[],
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::IndexError, "{err}");
    assert!(
        err.to_string().contains("out of range") || err.to_string().contains("out of bounds"),
        "{err}"
    );
}

#[test]
fn unknown_ops_are_runtime_errors() {
    let err = call_op("aten::no_such_op_here", &[], &[]).unwrap_err();
    assert_eq!(err.to_string(), "Unknown builtin op: aten::no_such_op_here");
    assert_eq!(err.kind(), ErrorKind::RuntimeError);
    let err = Operator::resolve("no_such_method_either").unwrap_err();
    assert_eq!(
        err.to_string(),
        "Unknown builtin op: aten::no_such_method_either"
    );
}

#[test]
fn python_builtins_go_through_call_op() {
    let n = 4;
    let out = call_op(
        "builtins.min",
        &[OpValue::Int(n), OpValue::Int(n + 1), OpValue::Int(n + 2)],
        &[],
    )
    .unwrap();
    assert_eq!(out[0].as_int(), Some(n));
    let out = call_op("builtins.max", &[OpValue::Float(1.5), OpValue::Int(1)], &[]).unwrap();
    assert_eq!(out[0].as_float(), Some(1.5));
}

/// The seeds' `build_sparse_tensor`, itself built through the registry.
fn sparse() -> OpValue {
    let indices = OpValue::Tensor(Tensor::from_slice(&[0_i64, 1, 1, 2, 0, 2]).reshape([2, 3]));
    let vals = t(&[3., 4., 5.], &[3]);
    let out = call_op(
        "aten::sparse_coo_tensor",
        &[indices, vals, ints(&[2, 3])],
        &[],
    )
    .unwrap();
    let s = tensor(out);
    assert!(s.is_sparse());
    OpValue::Tensor(s)
}

#[test]
fn sparse_tensors_go_through_add_mul_stack_and_sum() {
    let sum = tensor(call_op("aten::add", &[sparse(), sparse()], &[]).unwrap());
    assert!(sum.is_sparse());
    assert_eq!(
        values(&sum.to_dense(None, false)),
        [0., 0., 6., 8., 0., 10.]
    );

    let prod = tensor(call_op("aten::mul", &[sparse(), sparse()], &[]).unwrap());
    assert!(prod.is_sparse());
    assert_eq!(
        values(&prod.to_dense(None, false)),
        [0., 0., 9., 16., 0., 25.]
    );

    let stacked = tensor(
        call_op(
            "aten::stack",
            &[OpValue::List(vec![sparse(), sparse()])],
            &[],
        )
        .unwrap(),
    );
    assert!(stacked.is_sparse());
    assert_eq!(stacked.size(), [2, 2, 3]);

    let total = tensor(call_op("aten::_sparse_sum", &[sparse()], &[]).unwrap());
    assert_eq!(values(&total), [12.]);
    let total = tensor(call_op("aten::sum", &[sparse()], &[]).unwrap());
    assert_eq!(values(&total), [12.]);
    let by_dim = tensor(call_op("aten::_sparse_sum", &[sparse(), ints(&[1])], &[]).unwrap());
    assert_eq!(values(&by_dim.to_dense(None, false)), [3., 9.]);
}

#[test]
fn autograd_records_ops_called_by_name() {
    let x = Tensor::from_slice(&[1.0_f32, 2.0, 3.0]).set_requires_grad(true);
    assert_eq!(grad_fn_name(&x), None, "a leaf has no grad_fn");
    let three = OpValue::Tensor(Tensor::full([3], 3.0, F32));
    let y = tensor(
        call_op(
            "aten::mul",
            &[OpValue::Tensor(x.shallow_clone()), three],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(grad_fn_name(&y).as_deref(), Some("MulBackward0"));
    // With an int, PyTorch RPC's matching picks `mul.Scalar` (it does not
    // wrap numbers into tensors as Python's `torch.mul` does).
    let y1 = tensor(
        call_op(
            "aten::mul",
            &[OpValue::Tensor(x.shallow_clone()), OpValue::Int(3)],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(grad_fn_name(&y1).as_deref(), Some("MulBackward1"));
    let z = tensor(call_op("aten::sum", &[OpValue::Tensor(y)], &[]).unwrap());
    assert_eq!(grad_fn_name(&z).as_deref(), Some("SumBackward0"));
    z.backward();
    assert_eq!(values(&x.grad()), [3., 3., 3.]);

    let _guard = tch::no_grad_guard();
    let w = tensor(call_op("aten::mul", &[OpValue::Tensor(x), OpValue::Int(3)], &[]).unwrap());
    assert_eq!(grad_fn_name(&w), None, "no_grad on this thread applies");
}

#[test]
fn sparse_autograd_records_too() {
    let s = sparse().into_tensor().unwrap().set_requires_grad(true);
    let out = tensor(
        call_op(
            "aten::mul",
            &[OpValue::Tensor(s.shallow_clone()), OpValue::Tensor(s)],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(grad_fn_name(&out).as_deref(), Some("MulBackward0"));
}

#[test]
fn ops_run_from_many_threads_at_once() {
    let handles: Vec<_> = (0..4)
        .map(|k| {
            std::thread::spawn(move || {
                let op = Operator::resolve("aten::add").unwrap();
                for i in 0..200_i64 {
                    let a = OpValue::Tensor(Tensor::full([3], k as f64, F32));
                    let out = tensor(op.call(&[a, OpValue::Int(i)], &[]).unwrap());
                    assert_eq!(values(&out), [(k + i) as f64; 3]);
                    let mm = call_op("aten::matmul", &[ones(&[2, 2]), ones(&[2, 2])], &[]).unwrap();
                    assert_eq!(values(mm[0].as_tensor().unwrap()), [2.; 4]);
                    let err = call_op("aten::add", &[ones(&[2]), ones(&[3])], &[]).unwrap_err();
                    assert!(err.to_string().contains("must match the size"), "{err}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn ops_that_need_a_graph_node_are_not_callable_by_name() {
    // These build their operation from a TorchScript graph node (or read a
    // vararg count the interpreter pushes); resolving them by name must not
    // touch that machinery, and a peer naming them gets an error.
    for name in [
        "prim::isinstance",
        "prim::Constant",
        "prim::ListConstruct",
        "prim::tolist",
        "aten::format",
    ] {
        let err = call_op(name, &[ones(&[1])], &[]).unwrap_err();
        assert_eq!(err.to_string(), format!("Unknown builtin op: {name}"));
    }
    // Plain JIT-only ops stay callable: `prim::min.int` with two ints.
    let out = call_op("prim::min", &[OpValue::Int(3), OpValue::Int(2)], &[]).unwrap();
    assert_eq!(out[0].as_int(), Some(2));
}

#[test]
fn sparse_backward_through_ops_called_by_name() {
    // dist_autograd_test's sparse graphs: loss = torch.sparse.sum(t1 + t2).
    let t1 = sparse().into_tensor().unwrap().set_requires_grad(true);
    let t2 = sparse().into_tensor().unwrap().set_requires_grad(true);
    let sum = tensor(
        call_op(
            "aten::add",
            &[OpValue::Tensor(t1.shallow_clone()), OpValue::Tensor(t2)],
            &[],
        )
        .unwrap(),
    );
    let loss = tensor(call_op("aten::_sparse_sum", &[OpValue::Tensor(sum)], &[]).unwrap());
    // Without a dim, libtorch's `_sparse_sum` is `coalesce().values().sum()`,
    // as in Python's `torch.sparse.sum`.
    assert_eq!(grad_fn_name(&loss).as_deref(), Some("SumBackward0"));
    loss.backward();
    let grad = t1.grad();
    assert!(grad.is_sparse());
    assert_eq!(
        values(&grad.to_dense(None, false)),
        [0., 0., 1., 1., 0., 1.]
    );
}

#[test]
fn ops_returning_nothing_and_factories_with_optional_kwargs() {
    let a = ones(&[2]);
    let b = ones(&[3]);
    let out = call_op(
        "aten::_foreach_add_",
        &[
            OpValue::List(vec![a.shallow_clone(), b.shallow_clone()]),
            OpValue::Int(1),
        ],
        &[],
    )
    .unwrap();
    assert!(out.is_empty(), "{out:?}");
    assert!(matches!(OpValue::from_outputs(out), OpValue::None));
    assert_eq!(values(a.as_tensor().unwrap()), [2., 2.]);
    assert_eq!(values(b.as_tensor().unwrap()), [2., 2., 2.]);

    let r = tensor(call_op("aten::rand", &[ints(&[2, 2])], &[]).unwrap());
    assert_eq!(r.size(), [2, 2]);
    assert!(values(&r).iter().all(|v| (0.0..1.0).contains(v)));
    let z = tensor(
        call_op(
            "aten::zeros",
            &[ints(&[3])],
            &[kw("dtype", Kind::Int64), kw("device", "cpu")],
        )
        .unwrap(),
    );
    assert_eq!(z.kind(), Kind::Int64);
}

#[test]
fn a_device_without_a_backend_is_an_error_not_a_crash() {
    if wasmrpc_torch_sys::cuda::is_loaded() && tch::Cuda::is_available() {
        // The marker `cargo xtask coverage` counts as a skip, not a pass.
        println!("wasmrpc-skip: needs a machine without a CUDA device (found one)");
        return;
    }
    let err = call_method("to", &[ones(&[2]), OpValue::Str("cuda:0".into())], &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RuntimeError);
    let err = call_method("to", &[ones(&[2]), OpValue::Device(Device::Cuda(0))], &[]).unwrap_err();
    assert!(matches!(err, OpError::Raised { .. }), "{err:?}");
    // A string that is no device at all fails to match, with the reason.
    let err = call_method("to", &[ones(&[2]), OpValue::Str("nowhere".into())], &[]).unwrap_err();
    assert!(err.to_string().contains(NO_MATCHING_SCHEMA), "{err}");
}

#[test]
fn lists_of_optional_tensors() {
    // `aten::index.Tensor(Tensor self, Tensor?[] indices)`: x[:, [2, 0]].
    let x = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let idx = OpValue::Tensor(Tensor::from_slice(&[2_i64, 0]));
    let picked = tensor(
        call_op(
            "aten::index",
            &[x, OpValue::List(vec![OpValue::None, idx])],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(picked.size(), [2, 2]);
    assert_eq!(values(&picked), [3., 1., 6., 4.]);
}

#[test]
fn autograd_graph_inspection_like_the_dist_autograd_seeds() {
    let t1 = Tensor::from_slice(&[1.0_f32, 2.0]).set_requires_grad(true);
    let t2 = Tensor::from_slice(&[3.0_f32, 4.0]).set_requires_grad(true);
    let ret = tensor(
        call_op(
            "aten::add",
            &[
                OpValue::Tensor(t1.shallow_clone()),
                OpValue::Tensor(t2.shallow_clone()),
            ],
            &[],
        )
        .unwrap(),
    );
    let add = GradFn::of(&ret).expect("ret has a grad_fn");
    assert_eq!(add.name(), "AddBackward0");
    assert_eq!(GradFn::of(&ret), Some(add), "handles to one node are equal");
    let add = GradFn::of(&ret).unwrap();
    let next = add.next_functions();
    assert_eq!(next.len(), 2);
    for (i, leaf) in [&t1, &t2].into_iter().enumerate() {
        let (node, input_nr) = &next[i];
        let node = node
            .as_ref()
            .expect("a leaf that requires grad has an AccumulateGrad");
        assert_eq!(node.name(), "torch::autograd::AccumulateGrad");
        assert_eq!(*input_nr, 0);
        let variable = node.variable().expect("AccumulateGrad holds its variable");
        assert_eq!(variable.data_ptr(), leaf.data_ptr());
        assert!(node.next_functions().is_empty());
    }
    assert!(add.variable().is_none());

    // An input that needs no gradient has an edge to nothing.
    let c = Tensor::from_slice(&[5.0_f32, 6.0]);
    let prod = tensor(
        call_op(
            "aten::mul",
            &[OpValue::Tensor(ret), OpValue::Tensor(c)],
            &[],
        )
        .unwrap(),
    );
    let mul = GradFn::of(&prod).unwrap();
    let next = mul.next_functions();
    assert_eq!(
        next[0].0.as_ref().map(GradFn::name).as_deref(),
        Some("AddBackward0")
    );
    assert!(next[1].0.is_none());
    assert!(GradFn::of(&t1).is_none(), "a leaf has no grad_fn");
}

#[test]
fn first_resolutions_race_safely() {
    // Names no other test resolves, so every thread races on a cold cache.
    const NAMES: [&str; 8] = [
        "aten::cosh",
        "aten::sinh",
        "aten::expm1",
        "aten::log1p",
        "aten::erf",
        "aten::trunc",
        "aten::frac",
        "aten::rsqrt",
    ];
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                for name in NAMES {
                    let out = tensor(call_op(name, &[ones(&[2])], &[]).unwrap());
                    assert_eq!(out.size(), [2], "{name}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    for name in NAMES {
        assert_eq!(Operator::resolve(name).unwrap().name(), name);
    }
}

#[test]
fn undefined_tensors_are_none() {
    // tch can hold an undefined tensor; it must never reach a kernel that
    // expects a real one.
    let undefined = || OpValue::Tensor(Tensor::new());
    let err = call_op("aten::add", &[undefined(), ones(&[2])], &[]).unwrap_err();
    assert!(matches!(err, OpError::NoMatchingSchema { .. }), "{err:?}");
    let err = call_op(
        "aten::stack",
        &[OpValue::List(vec![ones(&[2]), undefined()])],
        &[],
    )
    .unwrap_err();
    assert!(matches!(err, OpError::NoMatchingSchema { .. }), "{err:?}");
    // Where the schema takes `Tensor?`, it is None: `clamp(t, min=None, max=t)`.
    let out = tensor(
        call_op(
            "aten::clamp",
            &[
                t(&[1., 5.], &[2]),
                undefined(),
                OpValue::Tensor(Tensor::full([2], 3.0, F32)),
            ],
            &[],
        )
        .unwrap(),
    );
    assert_eq!(values(&out), [1., 3.]);
}

#[test]
fn grad_with_explicit_seeds_accumulates_nothing() {
    let x = Tensor::from_slice(&[1.0_f32, 2.0, 3.0]).set_requires_grad(true);
    let unused = Tensor::from_slice(&[1.0_f32]).set_requires_grad(true);
    let y = tensor(
        call_op(
            "aten::mul",
            &[
                OpValue::Tensor(x.shallow_clone()),
                OpValue::Tensor(x.shallow_clone()),
            ],
            &[],
        )
        .unwrap(),
    );
    let seed = Tensor::from_slice(&[1.0_f32, 10.0, 100.0]);
    let keep = GradOptions {
        retain_graph: Some(true),
        ..GradOptions::default()
    };
    let g = grad(&[y.shallow_clone()], &[seed], &[x.shallow_clone()], keep).unwrap();
    assert_eq!(values(g[0].as_ref().unwrap()), [2., 40., 600.]);
    assert!(!x.grad().defined(), "grad() must not accumulate into .grad");

    let err = grad(
        &[y.shallow_clone()],
        &[Tensor::ones([3], F32)],
        &[unused.shallow_clone()],
        keep,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("appears to not have been used in the graph"),
        "{err}"
    );
    let allow = GradOptions {
        allow_unused: true,
        ..keep
    };
    let g = grad(
        &[y.shallow_clone()],
        &[Tensor::ones([3], F32)],
        &[x.shallow_clone(), unused],
        allow,
    )
    .unwrap();
    assert_eq!(values(g[0].as_ref().unwrap()), [2., 4., 6.]);
    assert!(g[1].is_none());

    // An implicit seed needs a scalar output, as in PyTorch.
    let err = grad(&[y], &[], &[x.shallow_clone()], GradOptions::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("grad can be implicitly created only for scalar outputs"),
        "{err}"
    );
    let s = tensor(call_op("aten::sum", &[OpValue::Tensor(x.shallow_clone())], &[]).unwrap());
    let g = grad(&[s], &[], &[x], GradOptions::default()).unwrap();
    assert_eq!(values(g[0].as_ref().unwrap()), [1., 1., 1.]);
}

#[test]
fn every_registered_op_survives_arbitrary_arguments() {
    // What a peer or a guest may send: any registered name with values of
    // any shape. Each call must come back as a result or an error, never a
    // crash (a null graph node, an unchecked stack, an undefined tensor).
    let names = wasmrpc_torch_sys::registered_ops();
    assert!(names.len() > 1500, "only {} ops registered", names.len());
    assert!(names.iter().any(|n| n == "aten::add") && names.iter().any(|n| n == "prim::min"));
    let patterns: Vec<Vec<OpValue>> = vec![
        vec![],
        vec![ones(&[2])],
        vec![ones(&[2]), ones(&[2])],
        vec![ones(&[2]), OpValue::Int(0)],
        vec![OpValue::Int(1)],
        vec![OpValue::Int(1), OpValue::Int(2)],
        vec![OpValue::Float(0.5), OpValue::Float(2.0)],
        vec![OpValue::Str("a".into())],
        vec![OpValue::List(vec![ones(&[2]), ones(&[2])])],
        vec![OpValue::None, OpValue::Tuple(vec![OpValue::Bool(true)])],
    ];
    let mut succeeded = 0;
    for name in &names {
        for args in &patterns {
            succeeded += usize::from(call_op(name, args, &[]).is_ok());
        }
        let kwargs = [
            kw("self", ones(&[2])),
            kw("dim", 0_i64),
            kw("dtype", Kind::Double),
        ];
        succeeded += usize::from(call_op(name, &[], &kwargs).is_ok());
    }
    assert!(succeeded > 500, "only {succeeded} calls succeeded");
}

#[test]
fn record_ops_lists_the_ops_run_with_nested_ones() {
    use wasmrpc_torch_sys::{OpValue, RecordOptions, call_op, record_ops};
    let x = tch::Tensor::from_slice(&[-1.0f32, 2.0]);
    let (out, events) = record_ops(RecordOptions::default(), || {
        call_op("aten::relu", &[OpValue::Tensor(x)], &[])
    });
    out.expect("relu");
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names.first(), Some(&"aten::relu"), "{names:?}");
    assert!(names.contains(&"aten::clamp_min"), "{names:?}");
    for e in &events {
        assert!(e.start_ns <= e.end_ns, "{e:?}");
    }
    // Outside a window nothing is recorded, and a window starts empty.
    let y = tch::Tensor::from_slice(&[1.0f32]);
    call_op("aten::neg", &[OpValue::Tensor(y)], &[]).expect("neg");
    let ((), events) = record_ops(RecordOptions::default(), || ());
    assert!(events.is_empty(), "{events:?}");
    // Without the options, no shapes and no memory.
    let (out, events) = record_ops(RecordOptions::default(), || {
        call_op("aten::add", &[ones(&[100]), ones(&[100])], &[])
    });
    out.expect("add");
    assert!(
        events
            .iter()
            .all(|e| e.input_shapes.is_empty() && e.cpu_memory_usage == 0),
        "{events:?}"
    );
}

/// The shapes come from `at::RecordFunction::inputs()`, read by the shim:
/// they are right only if the shim sees RecordFunction with libtorch's own
/// layout and inline code (built with libtorch's NDEBUG, `build.rs`).
#[test]
fn record_ops_reads_input_shapes_through_record_function() {
    use wasmrpc_torch_sys::{RecordOptions, call_op, record_ops};
    let shapes = RecordOptions {
        shapes: true,
        memory: false,
    };
    // A boxed call (the JIT operator, as RPC builtins run): `aten::add`'s
    // inputs are self, other and the scalar alpha.
    let (out, events) = record_ops(shapes, || {
        call_op("aten::add", &[ones(&[100]), ones(&[100])], &[])
    });
    out.expect("add");
    let add = events
        .iter()
        .find(|e| e.name == "aten::add")
        .unwrap_or_else(|| panic!("no aten::add in {events:?}"));
    assert_eq!(add.input_shapes, vec![vec![100], vec![100], vec![]]);
    // An unboxed call (tch's own binding), other ranks and sizes.
    let a = Tensor::ones([2, 3, 4], F32);
    let b = Tensor::ones([4, 5], F32);
    let (c, events) = record_ops(shapes, || a.matmul(&b));
    assert_eq!(c.size(), [2, 3, 5]);
    let matmul = events
        .iter()
        .find(|e| e.name == "aten::matmul")
        .unwrap_or_else(|| panic!("no aten::matmul in {events:?}"));
    assert_eq!(matmul.input_shapes, vec![vec![2, 3, 4], vec![4, 5]]);
    // A 0-dim tensor is a tensor with no sizes; an int is no tensor.
    let (out, events) = record_ops(shapes, || {
        call_op(
            "aten::mul",
            &[OpValue::Tensor(Tensor::from(2.0f32)), ones(&[7, 1])],
            &[],
        )
    });
    out.expect("mul");
    let mul = events.iter().find(|e| e.name == "aten::mul").expect("mul");
    assert_eq!(mul.input_shapes, vec![vec![], vec![7, 1]]);
    let (out, events) = record_ops(shapes, || {
        call_op("aten::sum", &[ones(&[3, 2]), ints(&[1])], &[])
    });
    out.expect("sum");
    let sum = events.iter().find(|e| e.name == "aten::sum").expect("sum");
    assert_eq!(sum.input_shapes[0], vec![3, 2], "{sum:?}");
    assert!(sum.input_shapes[1..].iter().all(Vec::is_empty), "{sum:?}");
}

#[test]
fn record_ops_reports_the_cpu_memory_each_op_allocates() {
    use wasmrpc_torch_sys::{RecordOptions, call_op, record_ops};
    let memory = RecordOptions {
        shapes: false,
        memory: true,
    };
    // 100 floats: 400 bytes, kept (the output), so the op and the
    // `aten::empty` it allocates with both count them.
    let (out, events) = record_ops(memory, || call_op("aten::ones", &[ints(&[100])], &[]));
    let out = out.expect("ones");
    let ones_event = events
        .iter()
        .find(|e| e.name == "aten::ones")
        .unwrap_or_else(|| panic!("no aten::ones in {events:?}"));
    assert_eq!(ones_event.cpu_memory_usage, 400, "{events:?}");
    // Ops called through tch's own bindings report too; a tensor freed
    // between ops counts for no op.
    let (r, events) = record_ops(memory, || {
        let t = Tensor::ones([1000], F32);
        let s = t.sum(Kind::Float);
        drop(t);
        s
    });
    assert_eq!(r.size(), Vec::<i64>::new());
    assert!(
        events.iter().any(|e| e.cpu_memory_usage == 4000),
        "no op with the 4000 bytes of ones(1000): {events:?}"
    );
    assert!(
        events.iter().all(|e| e.cpu_memory_usage >= 0),
        "the free of ones(1000) was counted for an op: {events:?}"
    );
    // Without the option nothing is reported, though the ops allocate.
    let (out2, events) = record_ops(RecordOptions::default(), || {
        call_op("aten::ones", &[ints(&[100])], &[])
    });
    out2.expect("ones");
    assert!(events.iter().all(|e| e.cpu_memory_usage == 0), "{events:?}");
    drop(out);
}

#[test]
fn tensor_hooks_map_gradients_in_local_backward_and_in_grad() {
    let x = Tensor::from_slice(&[1.0_f32, 2.0]).set_requires_grad(true);
    let doubled = register_hook(&x, |g| Ok(g * 2)).unwrap();
    let square = || (&x * &x).sum(Kind::Float);
    let grad_of_square = || {
        let g = grad(
            &[square()],
            &[],
            &[x.shallow_clone()],
            GradOptions::default(),
        )
        .unwrap();
        values(g[0].as_ref().unwrap())
    };

    // Local backward: d(x·x)/dx = 2x, doubled by the hook.
    square().backward();
    assert_eq!(values(&x.grad()), [4., 8.]);

    // grad() applies the leaf's hooks before it returns the gradient.
    assert_eq!(grad_of_square(), [4., 8.]);

    // A second hook runs after the first; removing one leaves the other.
    let plus_one = register_hook(&x, |g| Ok(g + 1)).unwrap();
    assert_eq!(grad_of_square(), [5., 9.]);
    doubled.remove();
    assert_eq!(grad_of_square(), [3., 5.]);
    drop(plus_one);
    assert_eq!(grad_of_square(), [2., 4.]);

    // A failing hook fails the pass with its message; so does a panic.
    let failing = register_hook(&x, |_| Err("Expected hook error".to_owned())).unwrap();
    let err = backward(&[square()], false).unwrap_err();
    assert!(err.to_string().contains("Expected hook error"), "{err}");
    drop(failing);
    let panicking = register_hook(&x, |_| panic!("boom")).unwrap();
    let err = backward(&[square()], false).unwrap_err();
    assert!(err.to_string().contains("a tensor hook panicked"), "{err}");
    drop(panicking);

    // No hook on a tensor that does not require grad.
    let plain = Tensor::from_slice(&[1.0_f32]);
    let err = register_hook(&plain, |g| Ok(g.shallow_clone())).unwrap_err();
    assert!(
        err.to_string().contains("doesn't require gradient"),
        "{err}"
    );
}

/// Issue 43: `(t, -1)` to these ops was a SIGSEGV of the whole process
/// (libtorch casts enum codes unchecked; Python's `torch.ops.aten.to(t, -1)`
/// crashes too). Each is now an error naming the argument and its code.
#[test]
fn an_enum_code_libtorch_does_not_define_is_an_error_not_a_crash() {
    for op in ["aten::to", "aten::to_dense", "aten::view"] {
        let err = call_op(op, &[ones(&[4, 4]), OpValue::Int(-1)], &[]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::RuntimeError, "{op}: {err}");
        let text = err.to_string();
        assert!(
            text.contains("-1 is not the code of a dtype (torch.dtype)")
                && text.contains("argument 'dtype'"),
            "{op}: {text}"
        );
    }
    // `aten::to.prim_dtype(Tensor(a) self, int? dtype=None, ...)` takes the
    // code as a plain int: checked by the parameter's name.
    let err = call_op("aten::to", &[ones(&[2]), OpValue::Int(1000)], &[]).unwrap_err();
    let text = err.to_string();
    let prim_dtype = text
        .split("\n\n")
        .find(|why| why.contains("aten::to.prim_dtype("))
        .unwrap_or_else(|| panic!("no word on to.prim_dtype: {text}"));
    assert!(
        prim_dtype.contains("1000 is not the code of a dtype (torch.dtype)"),
        "{text}"
    );
    // Layouts and memory formats, positional or by keyword.
    let err = call_op(
        "aten::zeros",
        &[ints(&[2])],
        &[kw("layout", OpValue::Int(i64::MAX))],
    )
    .unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "{} is not the code of a layout (torch.layout)",
            i64::MAX
        )),
        "{err}"
    );
    let err = call_op(
        "aten::clone",
        &[ones(&[2])],
        &[kw("memory_format", OpValue::Int(4))],
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("4 is not the code of a memory format (torch.memory_format): libtorch defines codes 0 to 3"),
        "{err}"
    );
    // Codes libtorch defines still work: 6 is torch.float32, 3 int32.
    let out = tensor(call_op("aten::to", &[ones(&[2]), OpValue::Int(3)], &[]).unwrap());
    assert_eq!(out.kind(), Kind::Int);
    let out = tensor(call_op("aten::zeros", &[ints(&[2])], &[kw("dtype", 6_i64)]).unwrap());
    assert_eq!(out.kind(), Kind::Float);
}

/// Issue 43, found by the op fuzzer (`host/tests/op_fuzz.rs`): calls that
/// killed the process (SIGFPE, SIGSEGV) or never returned, on libtorch
/// 2.13, from Python's `torch.ops.aten` too. Each is now a `RuntimeError`.
#[test]
fn arguments_libtorch_does_not_check_are_errors_not_crashes() {
    let expect = |op: &str, args: &[OpValue], kwargs: &[(String, OpValue)], text: &str| {
        let err = call_op(op, args, kwargs).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::RuntimeError, "{op}: {err}");
        assert!(err.to_string().contains(text), "{op}: {err}");
    };
    let int = OpValue::Int;
    // Python ints: `a % b` in TorchScript's int overloads.
    expect(
        "aten::remainder",
        &[int(1), int(0)],
        &[],
        "integer modulo by zero",
    );
    expect(
        "aten::remainder",
        &[int(i64::MIN), int(-1)],
        &[],
        "overflows int64",
    );
    expect(
        "aten::gcd",
        &[int(i64::MIN), int(-1)],
        &[],
        "overflows int64",
    );
    expect(
        "aten::gcd",
        &[int(-1), int(i64::MIN)],
        &[],
        "overflows int64",
    );
    // Tensors: truncating integer division of the smallest value by -1.
    let smallest = || OpValue::Tensor(Tensor::from_slice(&[i64::MIN, 4]));
    let trunc = [kw("rounding_mode", "trunc")];
    expect("aten::div", &[smallest(), int(-1)], &trunc, "divided by -1");
    expect(
        "aten::div",
        &[
            smallest(),
            OpValue::Tensor(Tensor::from_slice(&[-1_i64, 2])),
        ],
        &trunc,
        "divided by -1",
    );
    let smallest32 = OpValue::Tensor(Tensor::from_slice(&[i32::MIN]));
    expect(
        "aten::divide",
        &[smallest32, int(-1)],
        &trunc,
        "divided by -1",
    );
    // The least common multiple of the smallest int64 or int32.
    let bad = OpValue::Tensor(Tensor::from_slice(&[-5_i64, 7, i64::MAX]));
    expect(
        "aten::lcm",
        &[smallest(), bad],
        &[],
        "has no absolute value",
    );
    let five = || OpValue::Tensor(Tensor::from_slice(&[-5_i32]));
    let smallest32 = || OpValue::Tensor(Tensor::from_slice(&[i32::MIN]));
    expect(
        "aten::lcm",
        &[smallest32(), five()],
        &[],
        "has no absolute value",
    );
    // A step that is 0 in the integer dtype of the result (ValueError, as
    // aten::arange raises for it).
    for kwargs in [
        vec![kw("dtype", 4_i64)],
        vec![kw("out", OpValue::Tensor(Tensor::from_slice(&[1_i64, 2])))],
    ] {
        let err = call_op(
            "aten::range",
            &[int(-1), int(-1), OpValue::Float(0.5)],
            &kwargs,
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ValueError, "{err}");
        assert!(err.to_string().contains("step must be nonzero"), "{err}");
    }
    // Outputs the tensor memory budget does not see: 2^31 copies of a
    // handle (combinations), 2^31 empty sections (tensor_split).
    let three = || OpValue::Tensor(Tensor::from_slice(&[1_i64, 2, 3]));
    expect(
        "aten::combinations",
        &[three(), int(1 << 31)],
        &[],
        "is larger than the input (3 elements)",
    );
    expect(
        "aten::tensor_split",
        &[three(), int(1 << 31)],
        &[],
        "at most 65536 sections",
    );
    // A pooling window longer than the input.
    let row = || t(&[0., 1., 2., 3., 4., 5.], &[2, 3]);
    for kernel in [1_i64 << 40, i64::MAX] {
        expect(
            "aten::max_pool1d",
            &[row(), ints(&[kernel])],
            &[],
            "is longer than the padded input (3)",
        );
    }

    // What is still fine runs as before.
    let ok = |op: &str, args: &[OpValue], kwargs: &[(String, OpValue)]| {
        call_op(op, args, kwargs).unwrap_or_else(|e| panic!("{op}: {e}"))
    };
    assert!(matches!(
        ok("aten::remainder", &[int(-7), int(3)], &[])[..],
        [OpValue::Int(2)]
    ));
    assert!(matches!(
        ok("aten::gcd", &[int(12), int(-18)], &[])[..],
        [OpValue::Int(6)]
    ));
    let q = tensor(ok(
        "aten::div",
        &[OpValue::Tensor(Tensor::from_slice(&[-7_i64])), int(2)],
        &trunc,
    ));
    assert_eq!(Vec::<i64>::try_from(&q).unwrap(), [-3]);
    let q = tensor(ok("aten::div", &[smallest(), int(2)], &trunc));
    assert_eq!(Vec::<i64>::try_from(&q).unwrap(), [i64::MIN / 2, 2]);
    let m = tensor(ok(
        "aten::lcm",
        &[five(), OpValue::Tensor(Tensor::from_slice(&[3_i32]))],
        &[],
    ));
    assert_eq!(Vec::<i32>::try_from(&m).unwrap(), [15]);
    let r = tensor(ok(
        "aten::range",
        &[int(0), int(3), OpValue::Float(1.5)],
        &[kw("dtype", 4_i64)],
    ));
    assert_eq!(Vec::<i64>::try_from(&r).unwrap(), [0, 1, 2, 3]);
    let pairs = tensor(ok("aten::combinations", &[three(), int(2)], &[]));
    assert_eq!(pairs.size(), [3, 2]);
    let none = tensor(ok("aten::combinations", &[three(), int(5)], &[]));
    assert_eq!(none.numel(), 0);
    let parts = ok("aten::tensor_split", &[three(), int(5)], &[]);
    assert!(
        matches!(&parts[..], [OpValue::List(p)] if p.len() == 5),
        "{parts:?}"
    );
    let pooled = tensor(ok("aten::max_pool1d", &[row(), ints(&[3])], &[]));
    assert_eq!(values(&pooled), [2., 5.]);
}
