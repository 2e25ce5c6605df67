//! Loading libtorch's CUDA side at run time (`wasmrpc_torch_sys::cuda`).
//!
//! The decision is made once per process, so each case runs in a child
//! process of this test binary (the `child` test, told which case by
//! [`CASE_ENV`]) with its own `WASMRPC_LOAD_CUDA`; the parent asserts that
//! it passed. What each case checks depends on the build and the machine:
//! a CUDA build forced to load maps `libtorch_cuda.so` and libtorch answers
//! through CUDA's hooks even without a GPU; left to decide, it loads CUDA
//! exactly where a device is present (and then sees it), and maps nothing
//! of CUDA's where none is. The decision is made when the process starts,
//! so what the program does first (a tensor, a seed, a device query) does
//! not matter.

use std::process::Command;

use wasmrpc_torch_sys::cuda::{self, BUILT_WITH_CUDA, LOAD_ENV};

/// Names the case a child runs.
const CASE_ENV: &str = "WASMRPC_CUDA_LOAD_TEST_CASE";

/// Runs `case` in a child process with `WASMRPC_LOAD_CUDA` set to `load`
/// (or unset), and fails with its output if it fails.
fn in_child(case: &str, load: Option<&str>) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE_ENV, case);
    match load {
        Some(v) => cmd.env(LOAD_ENV, v),
        None => cmd.env_remove(LOAD_ENV),
    };
    let out = cmd.output().expect("the test binary runs again");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "case {case} failed:\n{text}");
    assert!(
        text.contains(&format!("case {case}: passed")),
        "case {case} did not run:\n{text}"
    );
}

fn maps() -> String {
    std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps")
}

/// Whether any CUDA library of torch's is mapped into this process.
fn maps_cuda() -> bool {
    let maps = maps();
    [
        "/libtorch_cuda.so",
        "/libc10_cuda.so",
        "/libcudnn",
        "/libnccl",
    ]
    .iter()
    .any(|lib| maps.contains(lib))
}

/// The child's side: runs the case [`CASE_ENV`] names; without it (the
/// parent's own run of this test) does nothing.
#[test]
fn child() {
    let Ok(case) = std::env::var(CASE_ENV) else {
        return;
    };
    match case.as_str() {
        "forced" => forced(),
        "auto" => auto(),
        "never" => never(),
        "query_first" => query_first(),
        "bad_value" => bad_value(),
        "cpu_work_first" => cpu_work_first(),
        "seed_first" => seed_first(),
        other => panic!("no case {other}"),
    }
    println!("case {case}: passed");
}

fn forced() {
    // Loaded when the process started, before this test's first line.
    assert_eq!(
        maps().contains("/libtorch_cuda.so"),
        BUILT_WITH_CUDA,
        "{}",
        maps()
    );
    let result = cuda::load();
    if !BUILT_WITH_CUDA {
        let err = result.expect_err("a CPU build cannot load CUDA");
        assert!(err.to_string().contains("built without CUDA"), "{err}");
        assert!(!maps_cuda());
        return;
    }
    let status = result.unwrap_or_else(|e| panic!("forced load failed: {e}"));
    assert!(status.loaded, "{status:?}");
    assert_eq!(status.why, format!("{LOAD_ENV}=1"));
    // CUDA's hooks answer (the placeholder's versionCUDART throws "without
    // ATen_cuda library"), GPU or not.
    assert!(status.cudart_version.is_some_and(|v| v > 0), "{status:?}");
    assert!(cuda::hooks_registered());
    assert!(maps().contains("/libtorch_cuda.so"), "{}", maps());
    assert!(wasmrpc_torch_sys::libtorch_has_cuda());
    // libtorch's own device queries now go through CUDA (0 devices here
    // without a GPU; every device on a GPU machine) and CPU tensors work.
    let count = tch::Cuda::device_count();
    assert!(count >= 0, "{count}");
    let t = tch::Tensor::from_slice(&[1.0_f32, 2.0]).sum(tch::Kind::Float);
    assert_eq!(t.double_value(&[]), 3.0);
}

fn auto() {
    let status = cuda::load().unwrap_or_else(|e| panic!("auto load failed: {e}"));
    if status.loaded {
        // Only a present device makes `auto` load: libtorch must see it.
        assert!(status.why.contains("CUDA device(s) present"), "{status:?}");
        assert!(tch::Cuda::device_count() > 0, "{status:?}");
        assert!(tch::Cuda::is_available());
        assert!(maps().contains("/libtorch_cuda.so"));
    } else {
        // No device (or a CPU build): nothing of CUDA's is mapped or
        // registered, and libtorch counts no device.
        assert!(
            status.why.contains("no CUDA device") || !BUILT_WITH_CUDA,
            "{status:?}"
        );
        assert!(!cuda::hooks_registered());
        assert!(!wasmrpc_torch_sys::libtorch_has_cuda());
        assert_eq!(tch::Cuda::device_count(), 0);
        assert!(!maps_cuda(), "{}", maps());
    }
}

fn never() {
    let status = cuda::load().unwrap_or_else(|e| panic!("{e}"));
    assert!(!status.loaded, "{status:?}");
    if BUILT_WITH_CUDA {
        assert_eq!(status.why, format!("{LOAD_ENV}=0"));
    }
    assert!(!cuda::hooks_registered());
    assert_eq!(tch::Cuda::device_count(), 0);
    assert!(!maps_cuda(), "{}", maps());
}

fn query_first() {
    // libtorch's device query settles its hooks for good; CUDA was loaded
    // at start, so it answers through CUDA's (0 devices without a GPU).
    assert!(tch::Cuda::device_count() >= 0);
    let status = cuda::load();
    if BUILT_WITH_CUDA {
        let status = status.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            status.loaded && status.cudart_version.is_some(),
            "{status:?}"
        );
    } else {
        let err = status.expect_err("a CPU build cannot load CUDA");
        assert!(err.to_string().contains("built without CUDA"), "{err}");
    }
}

fn cpu_work_first() {
    // A CPU tensor asks libtorch for its CUDA hooks and settles them: CUDA
    // loaded at start is in effect all the same.
    let x = tch::Tensor::from_slice(&[1.0_f32, 2.0]).set_requires_grad(true);
    let y = (&x * &x).sum(tch::Kind::Float);
    y.backward();
    assert_eq!(x.grad().double_value(&[1]), 4.0);
    let _ = tch::Tensor::zeros([4, 4], (tch::Kind::Float, tch::Device::Cpu)).matmul(
        &tch::Tensor::ones([4, 4], (tch::Kind::Float, tch::Device::Cpu)),
    );
    if BUILT_WITH_CUDA {
        let status = cuda::load().unwrap_or_else(|e| panic!("{e}"));
        assert!(
            status.loaded && status.cudart_version.is_some(),
            "{status:?}"
        );
    }
}

fn seed_first() {
    // `torch.manual_seed` seeds every CUDA generator too, through the hooks.
    tch::manual_seed(0);
    if BUILT_WITH_CUDA {
        let status = cuda::load().unwrap_or_else(|e| panic!("{e}"));
        assert!(
            status.loaded && status.cudart_version.is_some(),
            "{status:?}"
        );
    }
}

fn bad_value() {
    let err = cuda::load().expect_err("a bad WASMRPC_LOAD_CUDA");
    assert!(
        err.to_string()
            .contains("WASMRPC_LOAD_CUDA=\"maybe\": expected 1 (load CUDA), 0 (never) or auto"),
        "{err}"
    );
    assert!(!cuda::is_loaded());
}

#[test]
fn forced_loading_maps_libtorch_cuda_and_its_hooks_answer_without_a_gpu() {
    in_child("forced", Some("1"));
}

#[test]
fn left_to_decide_cuda_is_loaded_exactly_where_a_device_is_present() {
    in_child("auto", None);
    in_child("auto", Some("auto"));
}

#[test]
fn never_loading_cuda_maps_none_of_it() {
    in_child("never", Some("0"));
}

#[test]
fn cuda_is_in_effect_whatever_the_program_does_first() {
    in_child("query_first", Some("1"));
    in_child("cpu_work_first", Some("1"));
    in_child("seed_first", Some("1"));
}

#[test]
fn a_bad_load_setting_is_refused_with_the_values_it_takes() {
    in_child("bad_value", Some("maybe"));
}
