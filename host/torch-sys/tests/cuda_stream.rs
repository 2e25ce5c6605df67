//! CUDA streams, events and the sleep kernel (`wasmrpc_torch_sys::cuda_stream`).
//!
//! Without a GPU every call must fail with an error that says why, never
//! crash. With one (the GPU bundle runs this binary), the primitives must
//! behave as PyTorch's: a pool stream is not ordered with another, the
//! sleep kernel delays what follows it on its stream, `wait_stream` orders
//! two streams, events time work, and a guard's stream is current until it
//! drops.

use tch::{Device, Kind, Tensor};
use wasmrpc_torch_sys::cuda_stream::{self, Event, Stream};

/// Whether this process can use a CUDA device; prints the skip line the
/// coverage tool counts when it cannot.
fn gpu() -> bool {
    let loaded = wasmrpc_torch_sys::cuda::load().is_ok_and(|s| s.loaded);
    if loaded && tch::Cuda::device_count() > 0 {
        return true;
    }
    println!("wasmrpc-skip: needs 1 GPUs (found 0)");
    false
}

#[test]
fn without_a_gpu_every_call_fails_with_a_reason() {
    let loaded = wasmrpc_torch_sys::cuda::load().is_ok_and(|s| s.loaded);
    if loaded && tch::Cuda::device_count() > 0 {
        return;
    }
    let err = Stream::current(0).expect_err("no CUDA device to have a stream");
    assert!(
        err.to_string()
            .starts_with("the current stream of cuda:0: "),
        "{err}"
    );
    let err = Stream::from_pool(0).expect_err("no CUDA device to have a pool");
    assert!(
        err.to_string().starts_with("a pool stream of cuda:0: "),
        "{err}"
    );
    let err = cuda_stream::sleep(0, 1000).expect_err("no CUDA device to sleep on");
    assert!(
        err.to_string()
            .starts_with("torch.cuda._sleep(1000) on cuda:0: "),
        "{err}"
    );
    if !loaded {
        // Until libc10_cuda.so registers CUDA's stream implementation,
        // libtorch has none to make an event with.
        let err = Event::new().expect_err("no CUDA implementation loaded");
        assert!(err.to_string().contains("cuda"), "{err}");
    }
    let err = Stream::current(300).expect_err("no device index 300");
    assert!(err.to_string().contains("cuda:300"), "{err}");
}

#[test]
fn a_read_on_another_stream_waits_for_the_writer_only_when_told_to() {
    if !gpu() {
        return;
    }
    let writer = Stream::from_pool(0).unwrap();
    let reader = Stream::from_pool(0).unwrap();
    let mut t = Tensor::zeros([100], (Kind::Float, Device::Cuda(0)));
    // CUDA loads a kernel the first time it is launched (lazy loading), and
    // loading can wait for all of the device's work, which would order the
    // read after the fill: launch both kernels once first.
    let _ = t.fill_(0);
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 0.0);
    // The zeros are written on the default stream: both streams wait for it.
    writer.wait_stream(&Stream::current(0).unwrap()).unwrap();
    reader.wait_stream(&Stream::current(0).unwrap()).unwrap();
    {
        let _on_writer = writer.make_current().unwrap();
        cuda_stream::sleep(0, (500.0 * cuda_stream::cycles_per_ms(0).unwrap()) as i64).unwrap();
        let _ = t.fill_(1);
    }
    let _on_reader = reader.make_current().unwrap();
    // Half a second of sleep is queued before the fill on the writer: a
    // read that does not wait sees the zeros.
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 0.0);
    reader.wait_stream(&writer).unwrap();
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 100.0);
    assert!(writer.query().unwrap());
}

#[test]
fn timing_events_measure_the_sleep_kernel() {
    if !gpu() {
        return;
    }
    let per_ms = cuda_stream::cycles_per_ms(0).unwrap();
    assert!(per_ms > 1e4, "{per_ms} cycles per ms");
    let stream = Stream::current(0).unwrap();
    let (mut start, mut end) = (Event::with_timing().unwrap(), Event::with_timing().unwrap());
    assert_eq!(start.device(), None);
    start.record(&stream).unwrap();
    cuda_stream::sleep(0, (100.0 * per_ms) as i64).unwrap();
    end.record(&stream).unwrap();
    assert_eq!(end.device(), Some(0));
    assert!(!end.query().unwrap(), "a 100 ms sleep ended at once");
    end.synchronize().unwrap();
    assert!(end.query().unwrap());
    let ms = start.elapsed_ms(&end).unwrap();
    assert!((50.0..400.0).contains(&ms), "a 100 ms sleep took {ms} ms");
    // An event without timing cannot measure.
    let (mut a, mut b) = (Event::new().unwrap(), Event::new().unwrap());
    a.record(&stream).unwrap();
    b.record(&stream).unwrap();
    b.synchronize().unwrap();
    assert!(a.elapsed_ms(&b).is_err());
}

#[test]
fn a_guard_makes_its_stream_current_until_it_drops() {
    if !gpu() {
        return;
    }
    let default = Stream::default_stream(0).unwrap();
    assert_eq!(Stream::current(0).unwrap(), default);
    let side = Stream::from_pool(0).unwrap();
    assert_ne!(side, default);
    {
        let _guard = side.make_current().unwrap();
        assert_eq!(Stream::current(0).unwrap(), side);
        // Current streams belong to a thread.
        let elsewhere = std::thread::spawn(|| Stream::current(0).unwrap())
            .join()
            .unwrap();
        assert_eq!(elsewhere, default);
    }
    assert_eq!(Stream::current(0).unwrap(), default);
}

#[test]
fn record_stream_takes_cuda_tensors_only() {
    if !gpu() {
        return;
    }
    let stream = Stream::from_pool(0).unwrap();
    let on_gpu = Tensor::ones([4], (Kind::Float, Device::Cuda(0)));
    cuda_stream::record_stream(&on_gpu, &stream).unwrap();
    let sparse = on_gpu.to_sparse_sparse_dim(1);
    cuda_stream::record_stream(&sparse, &stream).unwrap();
    let on_cpu = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let err = cuda_stream::record_stream(&on_cpu, &stream).expect_err("a CPU tensor");
    assert!(err.to_string().contains("not on a CUDA device"), "{err}");
}
