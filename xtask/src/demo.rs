//! `cargo xtask demo`: the README's main job. The real `wasmrpc` binary
//! launches a local cluster of 4 worker processes serving the
//! parameter-server plugin (`plugins/param-server`): worker0 holds an MLP's
//! parameters and drives, 3 trainers train it on scikit-learn's digits.
//! `wasmrpc launch` draws the workers' progress (epochs, batches) and writes
//! the driver's per-epoch results to a JSON file (`--result`), which this
//! module prints and plots (PNG).
//!
//! The plugin reads nothing it was not granted: the launcher grants it
//! `examples/data` read-only at `/data` (the digits) and
//! `target/demo/checkpoints` read-write at `/ckpt`, where the driver saves
//! a checkpoint after every epoch; `--resume` runs `param_server::resume`,
//! which continues from the last one.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use plotters::prelude::*;

use crate::{coverage, process};

/// Workers of the demo cluster (the parameter server and 3 trainers) and
/// the epochs they train; the plugin chooses the rest.
const WORKERS: &str = "4";
const TRAINERS: &str = "3";
const EPOCHS: &str = "10";

/// Builds, launches the cluster, prints the held-out accuracy and writes
/// the plot.
pub(crate) fn run(root: &Path, resume: bool) -> Result<()> {
    process::step("demo: building the wasmrpc binary and the plugins (wasm32)");
    process::cargo(
        root,
        &["build", "--quiet", "-p", "wasmrpc", "--bin", "wasmrpc"],
    )?;
    let plugin = built_plugin(root, "param-server")?;
    let target = coverage::target_dir(root);
    let wasmrpc = target.join("debug/wasmrpc");
    let out = target.join("demo");
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let result = out.join("result.json");
    let _ = std::fs::remove_file(&result);
    let checkpoints = out.join("checkpoints");
    std::fs::create_dir_all(&checkpoints)
        .with_context(|| format!("cannot create {}", checkpoints.display()))?;
    let grants = [
        format!(
            "param_server:/data={}:ro",
            root.join("examples/data").display()
        ),
        format!("param_server:/ckpt={}:rw", checkpoints.display()),
    ];
    let entry = if resume {
        "param_server::resume"
    } else {
        "param_server::run"
    };
    process::step(&format!(
        "demo: wasmrpc launch --nproc {WORKERS} --plugins {} --grant-dir {} --grant-dir {} --entry {entry} --result {} -- {TRAINERS} {EPOCHS}",
        plugin.display(),
        grants[0],
        grants[1],
        result.display()
    ));
    println!(
        "A parameter server, as in PyTorch's tutorial: the launcher hosts the store and starts \
         {WORKERS} worker processes serving the param-server plugin. worker0 holds an MLP's \
         parameters and runs param_server::run; the {TRAINERS} trainers (worker1..3) each train \
         on a third of scikit-learn's digits (1,438 8x8 images; 359 more are held out): per batch, \
         in a distributed autograd context, the forward pass on worker0 by RPC, backward across \
         both workers, and a DistributedOptimizer step on worker0's parameters. After each epoch \
         worker0 measures the held-out accuracy and saves a checkpoint. The plugin reads the \
         digits from the folder granted at /data and writes checkpoints to the one granted at \
         /ckpt, and reaches no other file.{}\n",
        if resume {
            " This run continues from the last checkpoint (--resume)."
        } else {
            " `cargo xtask demo --resume` continues an interrupted run from its last checkpoint."
        }
    );
    process::run(
        std::process::Command::new(&wasmrpc)
            .args(["launch", "--nproc", WORKERS, "--plugins"])
            .arg(&plugin)
            .args(["--grant-dir", &grants[0], "--grant-dir", &grants[1]])
            .args(["--entry", entry, "--result"])
            .arg(&result)
            .args(["--", TRAINERS, EPOCHS]),
    )?;
    let history = History::read(&result)?;
    let png = out.join("training.png");
    let note = plot(&history, &png)?;
    let last = history.accuracy.last().copied().unwrap_or(f64::NAN);
    println!(
        "\ndemo: held-out accuracy after {} epochs: {last:.3}",
        history.accuracy.len()
    );
    println!(
        "demo: loss and accuracy per epoch plotted in {}{}",
        png.display(),
        note.map(|n| format!(" ({n})")).unwrap_or_default()
    );
    println!(
        "demo: results in {}. Try `{} launch --help`, or `plugin inspect` on the .wasm above.",
        result.display(),
        wasmrpc.display()
    );
    process::print_step_times();
    Ok(())
}

/// The `.wasm` file of the plugin `plugins/<name>`, built if it is missing
/// or out of date: `wasmrpc-plugins` (`plugins/artifacts`) prints it, and
/// building that binary runs the build script that builds every plugin, the
/// one mechanism the tests use too.
pub(crate) fn built_plugin(root: &Path, name: &str) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let path = process::stdout(
        std::process::Command::new(cargo)
            .args(["run", "--quiet", "-p", "wasmrpc-plugins", "--", name])
            .current_dir(root),
    )
    .with_context(|| format!("building the {name} plugin failed"))?;
    let path = PathBuf::from(path.trim());
    if !path.is_file() {
        bail!(
            "wasmrpc-plugins named {} for the {name} plugin, but there is no such file",
            path.display()
        );
    }
    Ok(path)
}

/// The driver's per-epoch results, as `--result` wrote them.
struct History {
    train_loss: Vec<f64>,
    test_loss: Vec<f64>,
    accuracy: Vec<f64>,
}

impl History {
    fn read(path: &PathBuf) -> Result<History> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("the launcher wrote no result to {}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let column = |name: &str| -> Result<Vec<f64>> {
            json[name]
                .as_array()
                .with_context(|| format!("the result has no list {name}: {json}"))?
                .iter()
                .map(|v| {
                    v.as_f64()
                        .with_context(|| format!("{name}: {v} is not a number"))
                })
                .collect()
        };
        Ok(History {
            train_loss: column("train_loss")?,
            test_loss: column("test_loss")?,
            accuracy: column("accuracy")?,
        })
    }
}

/// Fonts tried for the labels (plotters draws text with `ab_glyph`, which
/// needs a font file; none is bundled). The same list as the bench's plot.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

fn register_font() -> bool {
    FONTS.iter().any(|path| {
        std::fs::read(path).is_ok_and(|bytes| {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    })
}

/// One line of a panel.
struct Line<'a> {
    name: &'a str,
    points: Vec<(f64, f64)>,
    color: RGBColor,
}

/// One chart of the plot.
struct Panel<'a> {
    title: &'a str,
    top: f64,
    legend: SeriesLabelPosition,
    lines: &'a [Line<'a>],
}

/// Draws loss (left) and accuracy (right) per epoch into `path`; returns a
/// note when labels could not be drawn.
fn plot(h: &History, path: &Path) -> Result<Option<String>> {
    let e = |x: Box<dyn std::error::Error>| anyhow!("cannot draw {}: {x}", path.display());
    let epochs = h.accuracy.len().max(1) as f64;
    let fonts = register_font();
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(Box::new(x)))?;
    let (left, right) = root.split_horizontally(600);
    let max_loss = h
        .train_loss
        .iter()
        .chain(&h.test_loss)
        .copied()
        .fold(0.0, f64::max)
        * 1.1;
    let series = |ys: &[f64]| -> Vec<(f64, f64)> {
        ys.iter()
            .enumerate()
            .map(|(i, y)| (i as f64 + 1.0, *y))
            .collect()
    };
    let loss_lines = [
        Line {
            name: "training",
            points: series(&h.train_loss),
            color: BLUE,
        },
        Line {
            name: "held-out",
            points: series(&h.test_loss),
            color: RED,
        },
    ];
    let accuracy_lines = [Line {
        name: "held-out",
        points: series(&h.accuracy),
        color: GREEN,
    }];
    let panels = [
        Panel {
            title: "Loss (cross-entropy)",
            top: max_loss.max(1e-3),
            legend: SeriesLabelPosition::UpperRight,
            lines: &loss_lines,
        },
        Panel {
            title: "Held-out accuracy",
            top: 1.0,
            legend: SeriesLabelPosition::LowerRight,
            lines: &accuracy_lines,
        },
    ];
    for (area, panel) in [&left, &right].into_iter().zip(panels) {
        let mut builder = ChartBuilder::on(area);
        builder.margin(20);
        if fonts {
            builder
                .caption(panel.title, ("sans-serif", 22))
                .x_label_area_size(40)
                .y_label_area_size(50);
        }
        let mut chart = builder
            .build_cartesian_2d(1f64..epochs.max(2.0), 0f64..panel.top)
            .map_err(|x| e(Box::new(x)))?;
        let mut mesh = chart.configure_mesh();
        if fonts {
            mesh.x_desc("epoch");
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(|x| e(Box::new(x)))?;
        for line in panel.lines {
            let color = line.color;
            let s = chart
                .draw_series(LineSeries::new(line.points.clone(), color.stroke_width(2)))
                .map_err(|x| e(Box::new(x)))?;
            if fonts {
                s.label(line.name).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            }
            chart
                .draw_series(
                    line.points
                        .iter()
                        .map(|p| Circle::new(*p, 3, color.filled())),
                )
                .map_err(|x| e(Box::new(x)))?;
        }
        if fonts {
            chart
                .configure_series_labels()
                .position(panel.legend)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .draw()
                .map_err(|x| e(Box::new(x)))?;
        }
    }
    root.present().map_err(|x| e(Box::new(x)))?;
    Ok((!fonts).then(|| "no font found, so the plot has no labels".to_owned()))
}
