//! criterion micro-benchmarks of the hot paths reachable through the public
//! API: the postcard encoding of call and response headers (what every frame
//! starts with) and of nested values, and building a call's arguments.
//!
//! Run alone: `cargo bench -p wasmrpc-bench --bench hot_paths`.
//!
//! Not covered: whole frames with tensor storages (`OutFrame::encode`,
//! `read_frame`) and op dispatch are crate-private in `wasmrpc` and
//! `wasmrpc-torch-sys`; they need a public bench hook there.

#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use wasmrpc::abi::{self, Value};
use wasmrpc::{Args, Message, Payload, args};

fn small_call() -> Message {
    Message::Call {
        id: 42,
        function: "bench::noop".into(),
        args: vec![Value::Int(1)],
        kwargs: vec![],
        fields: vec![],
    }
}

fn nested(n: usize) -> Value {
    Value::List(
        (0..n)
            .map(|i| {
                Value::Dict(vec![
                    (Value::Str(format!("k{i}")), Value::Int(i as i64)),
                    (Value::Str("v".into()), Value::Float(i as f64)),
                    (Value::Str("t".into()), Value::Tensor(i as u32)),
                ])
            })
            .collect(),
    )
}

fn headers(c: &mut Criterion) {
    let mut g = c.benchmark_group("header");
    let call = small_call();
    let response = Message::Response {
        id: 42,
        result: Ok(Value::None),
        fields: vec![],
    };
    for (name, msg) in [("call_noop_int", &call), ("response_none", &response)] {
        let bytes = abi::encode(msg).expect("encodes");
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_function(BenchmarkId::new("encode", name), |b| {
            b.iter(|| abi::encode(black_box(msg)).expect("encodes"))
        });
        // As the agent encodes a message for a frame (`Message::encode`):
        // into a buffer sized for small messages at once.
        g.bench_function(BenchmarkId::new("encode_presized", name), |b| {
            b.iter(|| abi::encode_append(black_box(msg), Vec::with_capacity(128)).expect("encodes"))
        });
        g.bench_function(BenchmarkId::new("decode", name), |b| {
            b.iter(|| abi::decode::<Message>(black_box(&bytes)).expect("decodes"))
        });
    }
    g.finish();
}

fn values(c: &mut Criterion) {
    let mut g = c.benchmark_group("value");
    for n in [1usize, 64, 4096] {
        let v = nested(n);
        let bytes = abi::encode(&v).expect("encodes");
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_with_input(BenchmarkId::new("encode", n), &v, |b, v| {
            b.iter(|| abi::encode(black_box(v)).expect("encodes"))
        });
        g.bench_with_input(BenchmarkId::new("decode", n), &bytes, |b, bytes| {
            b.iter(|| abi::decode::<Value>(black_box(bytes)).expect("decodes"))
        });
    }
    g.finish();
}

fn arguments(c: &mut Criterion) {
    let mut g = c.benchmark_group("args");
    g.bench_function("int", |b| b.iter(|| -> Args { args![black_box(1i64)] }));
    g.bench_function("list_of_64_payloads", |b| {
        b.iter(|| {
            let items: Vec<Payload> = (0..64i64).map(Payload::from).collect();
            args![Payload::list(black_box(items))]
        })
    });
    g.finish();
}

criterion_group!(benches, headers, values, arguments);
criterion_main!(benches);
