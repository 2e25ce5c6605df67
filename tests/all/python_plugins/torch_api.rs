//! The Python kit's PyTorch surface on the real wasm path: the
//! `torch-api-py` plugin (`plugins/python/torch-api-py`) runs layers,
//! losses, optimizers and indexing as PyTorch code writes them (`nn`, `F`,
//! `optim`), on weights and inputs given here, and each result is compared
//! with the same computation done here with libtorch (tch) directly.
//! `guest-sdk/python/tests/test_torch_api.py` runs the same cases in pure
//! Python against torch itself.

use anyhow::{Context, ensure};
use tch::{Kind, Reduction, Tensor};
use wasmrpc::testing::{Cluster, worker_name};
use wasmrpc::{Args, Payload, PluginHost, args};
use wasmrpc_tests::timed;

async fn cluster() -> anyhow::Result<Cluster> {
    let host = PluginHost::shared()?;
    let plugin = host.load_file(wasmrpc_plugins::TORCH_API_PY)?;
    Ok(Cluster::builder(2)
        .functions(move |r| {
            host.register(&plugin, r);
        })
        .start()
        .await?)
}

async fn call(c: &Cluster, function: &str, args: Args) -> anyhow::Result<Payload> {
    c.agent(0)
        .rpc_sync(worker_name(1), function, args)
        .await
        .with_context(|| format!("{function} failed"))
}

fn close(what: &str, got: &Tensor, want: &Tensor) -> anyhow::Result<()> {
    ensure!(
        got.size() == want.size(),
        "{what}: shape {:?}, expected {:?}",
        got.size(),
        want.size()
    );
    ensure!(
        got.allclose(want, 1e-4, 1e-5, false),
        "{what}: {got} differs from {want}"
    );
    Ok(())
}

fn seeded(shape: &[i64], seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Float, tch::Device::Cpu))
}

#[test]
fn linear_conv2d_and_losses_match_libtorch_forward_and_backward() {
    timed(async {
        let c = cluster().await?;
        // nn.Linear.
        let (w, b, x) = (seeded(&[3, 4], 1), seeded(&[3], 2), seeded(&[5, 4], 3));
        let out = call(
            &c,
            "torch_api_py::linear_forward_backward",
            args![w.shallow_clone(), b.shallow_clone(), x.shallow_clone()],
        )
        .await?;
        let parts = out.items()?;
        let (wg, bg) = (
            w.detach().requires_grad_(true),
            b.detach().requires_grad_(true),
        );
        let y = x.matmul(&wg.tr()) + &bg;
        (&y * &y).sum(Kind::Float).backward();
        close("linear y", &parts[0].as_tensor()?, &y.detach())?;
        let grads = &parts[1];
        close(
            "linear dW",
            &grads
                .get("weight")?
                .context("no weight grad")?
                .as_tensor()?,
            &wg.grad(),
        )?;
        close(
            "linear db",
            &grads.get("bias")?.context("no bias grad")?.as_tensor()?,
            &bg.grad(),
        )?;

        // nn.Conv2d, stride 1, padding 1.
        let (w, b, x) = (
            seeded(&[2, 3, 3, 3], 4),
            seeded(&[2], 5),
            seeded(&[1, 3, 6, 6], 6),
        );
        let out = call(
            &c,
            "torch_api_py::conv2d_forward_backward",
            Args::new()
                .arg(w.shallow_clone())
                .arg(b.shallow_clone())
                .arg(x.shallow_clone())
                .kwarg("padding", 1i64),
        )
        .await?;
        let parts = out.items()?;
        let (wg, bg) = (
            w.detach().requires_grad_(true),
            b.detach().requires_grad_(true),
        );
        let y = x.conv2d(&wg, Some(&bg), [1, 1], [1, 1], [1, 1], 1);
        (&y * &y).sum(Kind::Float).backward();
        close("conv2d y", &parts[0].as_tensor()?, &y.detach())?;
        close(
            "conv2d dW",
            &parts[1]
                .get("weight")?
                .context("no weight grad")?
                .as_tensor()?,
            &wg.grad(),
        )?;

        // F.cross_entropy (and its gradient), mse_loss, l1_loss.
        let logits = seeded(&[4, 5], 7);
        let target = Tensor::from_slice(&[0i64, 3, 4, 1]);
        let (a, bb) = (seeded(&[6], 8), seeded(&[6], 9));
        let out = call(
            &c,
            "torch_api_py::losses",
            args![
                logits.shallow_clone(),
                target.shallow_clone(),
                a.shallow_clone(),
                bb.shallow_clone()
            ],
        )
        .await?;
        let parts = out.items()?;
        let lg = logits.detach().requires_grad_(true);
        let ce = lg.cross_entropy_loss::<Tensor>(&target, None, Reduction::Mean, -100, 0.0);
        ce.backward();
        close("cross_entropy", &parts[0].as_tensor()?, &ce.detach())?;
        close("cross_entropy grad", &parts[1].as_tensor()?, &lg.grad())?;
        close(
            "mse_loss",
            &parts[2].as_tensor()?,
            &a.mse_loss(&bb, Reduction::Mean),
        )?;
        close(
            "l1_loss",
            &parts[3].as_tensor()?,
            &a.l1_loss(&bb, Reduction::Mean),
        )?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn an_lstm_matches_libtorchs_lstm() {
    timed(async {
        let c = cluster().await?;
        let (input, hidden) = (3i64, 4i64);
        let names = ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"];
        let shapes = [
            vec![4 * hidden, input],
            vec![4 * hidden, hidden],
            vec![4 * hidden],
            vec![4 * hidden],
        ];
        let params: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| seeded(s, 20 + i as i64) * 0.3)
            .collect();
        let state = Payload::dict(names.iter().zip(&params).map(|(n, p)| {
            (
                Payload::from(n.to_string()),
                Payload::from(p.shallow_clone()),
            )
        }));
        let x = seeded(&[5, 2, input], 30); // (seq, batch, input)
        let out = call(
            &c,
            "torch_api_py::lstm_forward",
            Args::new().arg(state).arg(x.shallow_clone()).arg(hidden),
        )
        .await?;
        let parts = out.items()?;
        let zeros = Tensor::zeros([1, 2, hidden], (Kind::Float, tch::Device::Cpu));
        let (output, h, cell) = x.lstm(
            &[zeros.shallow_clone(), zeros],
            &params,
            true,
            1,
            0.0,
            false,
            false,
            false,
        );
        close("lstm output", &parts[0].as_tensor()?, &output)?;
        close("lstm h_n", &parts[1].as_tensor()?, &h)?;
        close("lstm c_n", &parts[2].as_tensor()?, &cell)?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn sgd_with_momentum_and_adam_step_as_torch_optim_does() {
    timed(async {
        let c = cluster().await?;
        let p = seeded(&[4], 40);
        let g = seeded(&[4], 41);
        let steps = 5;
        let (lr, momentum) = (0.1, 0.9);
        let out = call(
            &c,
            "torch_api_py::optimizer_steps",
            Args::new()
                .arg("sgd".to_string())
                .arg(Payload::list([Payload::from(p.shallow_clone())]))
                .arg(Payload::list([Payload::from(g.shallow_clone())]))
                .arg(lr)
                .kwarg("steps", steps)
                .kwarg("momentum", momentum),
        )
        .await?;
        // torch.optim.SGD: buf = g first, then momentum * buf + g.
        let (mut want, mut buf) = (p.copy(), g.copy());
        for step in 0..steps {
            if step > 0 {
                buf = &buf * momentum + &g;
            }
            want = &want - &buf * lr;
        }
        close("sgd", &out.items()?[0].as_tensor()?, &want)?;

        let lr = 0.01;
        let out = call(
            &c,
            "torch_api_py::optimizer_steps",
            Args::new()
                .arg("adam".to_string())
                .arg(Payload::list([Payload::from(p.shallow_clone())]))
                .arg(Payload::list([Payload::from(g.shallow_clone())]))
                .arg(lr)
                .kwarg("steps", steps),
        )
        .await?;
        // torch.optim.Adam with its defaults and bias correction.
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        let (mut want, mut m, mut v) = (p.copy(), g.zeros_like(), g.zeros_like());
        for t in 1..=steps {
            m = &m * b1 + &g * (1.0 - b1);
            v = &v * b2 + (&g * &g) * (1.0 - b2);
            let m_hat = &m / (1.0 - b1.powi(t));
            let v_hat = &v / (1.0 - b2.powi(t));
            want = &want - m_hat * lr / (v_hat.sqrt() + eps);
        }
        close("adam", &out.items()?[0].as_tensor()?, &want)?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn pytorch_style_training_code_learns_and_indexing_matches_libtorch() {
    timed(async {
        let c = cluster().await?;
        // Two well-separated classes in 4 features.
        let x = Tensor::cat(&[seeded(&[32, 4], 50) + 2.0, seeded(&[32, 4], 51) - 2.0], 0);
        let y = Tensor::cat(
            &[
                Tensor::zeros([32], (Kind::Int64, tch::Device::Cpu)),
                Tensor::ones([32], (Kind::Int64, tch::Device::Cpu)),
            ],
            0,
        );
        let out = call(
            &c,
            "torch_api_py::train_mlp",
            Args::new().arg(x).arg(y).kwarg("epochs", 10i64),
        )
        .await?;
        let parts = out.items()?;
        let losses = wasmrpc_examples_floats(&parts[0])?;
        let accuracy = parts[1].as_float()?;
        ensure!(losses.len() == 10, "{losses:?}");
        ensure!(
            losses[9] < losses[0] / 3.0,
            "the loss did not fall: {losses:?}"
        );
        ensure!(accuracy > 0.95, "accuracy {accuracy}");

        let t = Tensor::arange(12, (Kind::Float, tch::Device::Cpu)).reshape([3, 4]);
        let idx = Tensor::from_slice(&[2i64, 0]);
        let mask = t.gt(5.0);
        let out = call(
            &c,
            "torch_api_py::indexing",
            args![t.shallow_clone(), idx.shallow_clone(), mask.shallow_clone()],
        )
        .await?;
        let parts = out.items()?;
        close("t[0]", &parts[0].as_tensor()?, &t.get(0))?;
        close("t[:, 1]", &parts[1].as_tensor()?, &t.select(1, 1))?;
        close("t[..., -1]", &parts[2].as_tensor()?, &t.select(-1, -1))?;
        ensure!(format!("{:?}", parts[3].value) == "List([Int(1), Int(3), Int(4)])");
        close("t[idx]", &parts[4].as_tensor()?, &t.index_select(0, &idx))?;
        close("t[mask]", &parts[5].as_tensor()?, &t.masked_select(&mask))?;
        let mut u = t.copy();
        let _ = u.index_fill_(0, &idx, 0.0);
        let _ = u.select(1, 0).fill_(-1.0);
        close("assigned", &parts[6].as_tensor()?, &u)?;
        c.shutdown().await?;
        Ok(())
    });
}

fn wasmrpc_examples_floats(p: &Payload) -> anyhow::Result<Vec<f64>> {
    p.items()?
        .iter()
        .map(|v| v.as_float().map_err(anyhow::Error::from))
        .collect()
}

/// The kit's own unit tests (`guest-sdk/python/tests`): the same surface
/// against torch itself, through a fake host over real torch tensors, in
/// the torch venv `cargo xtask setup` made.
#[test]
fn the_kits_unit_tests_pass_against_torch() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = wasmrpc_tests::venv_python();
    let out = std::process::Command::new(&python)
        .args(["-m", "unittest", "discover", "-s", "tests"])
        .current_dir(root.join("guest-sdk/python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the kit's unit tests failed:\n{stderr}"
    );
    assert!(stderr.contains("\nOK"), "{stderr}");
}
