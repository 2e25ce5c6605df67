//! The plot: round-trip latency against payload size for wasmrpc, torch and
//! the raw TCP limit (PNG, plotters' bitmap backend).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::rows::{Results, SMALL_CALL_BYTES, Side};

/// (payload bytes, [our key, torch key, limit key]) of each point.
const POINTS: &[(u64, [&str; 3])] = &[
    (SMALL_CALL_BYTES, ["rtt_noop_native", "rtt_noop", "raw_rtt"]),
    (4 << 10, ["echo_4k", "echo_4k", "raw_echo_4k"]),
    (1 << 20, ["echo_1m", "echo_1m", "raw_echo_1m"]),
    (64 << 20, ["echo_64m", "echo_64m", "raw_echo_64m"]),
];

/// Fonts tried for the labels (plotters draws text with `ab_glyph`, which
/// needs a font file; none is bundled).
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

fn register_font() -> bool {
    for path in FONTS {
        if let Ok(bytes) = std::fs::read(path) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    false
}

/// Axis labels sit at powers of ten: label them in decimal units.
fn human_bytes(b: f64) -> String {
    if b >= 1e9 {
        format!("{:.0} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.0} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.0} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

/// Draws the plot into `path`; returns a note when labels could not be drawn.
///
/// # Errors
/// When nothing was measured to plot, or the PNG cannot be written.
pub(crate) fn draw(res: &Results, path: &Path) -> Result<Option<String>> {
    let series = |side: Side, i: usize| -> Vec<(f64, f64)> {
        POINTS
            .iter()
            .filter_map(|(bytes, keys)| res.stat(side, keys[i]).map(|s| (*bytes as f64, s.median)))
            .collect()
    };
    let lines = [
        ("wasmrpc", series(Side::Ours, 0), RGBColor(31, 119, 180)),
        (
            "torch.distributed.rpc",
            series(Side::Torch, 1),
            RGBColor(214, 39, 40),
        ),
        (
            "raw TCP (limit)",
            series(Side::Limit, 2),
            RGBColor(40, 40, 40),
        ),
    ];
    let all: Vec<f64> = lines.iter().flat_map(|l| l.1.iter().map(|p| p.1)).collect();
    if all.is_empty() {
        return Err(anyhow!("no latency was measured"));
    }
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min) / 2.0;
    let hi = all.iter().copied().fold(0.0, f64::max) * 2.0;
    let fonts = register_font();
    let e = |e: Box<dyn std::error::Error>| anyhow!("{e}");
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(Box::new(x)))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if fonts {
        builder
            .caption(
                "Round trip vs payload size (median, loopback)",
                ("sans-serif", 24),
            )
            .x_label_area_size(50)
            .y_label_area_size(80);
    }
    let mut chart = builder
        .build_cartesian_2d((4f64..2e8).log_scale(), (lo..hi).log_scale())
        .map_err(|x| e(Box::new(x)))?;
    if fonts {
        chart
            .configure_mesh()
            .x_desc("payload, one way (points: 8 B no-op call, 4 KiB, 1 MiB, 64 MiB echo)")
            .y_desc("round trip (µs)")
            .x_label_formatter(&|x| human_bytes(*x))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()
            .map_err(|x| e(Box::new(x)))?;
    } else {
        chart
            .configure_mesh()
            .x_labels(0)
            .y_labels(0)
            .draw()
            .map_err(|x| e(Box::new(x)))?;
    }
    for (name, points, color) in &lines {
        let color = *color;
        let s = chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|x| e(Box::new(x)))?;
        if fonts {
            s.label(*name).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))
            .map_err(|x| e(Box::new(x)))?;
    }
    if fonts {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(Box::new(x)))?;
    }
    root.present().map_err(|x| e(Box::new(x)))?;
    Ok((!fonts).then(|| {
        "no TrueType font found, so the plot has no labels: blue is wasmrpc, red torch, dark grey raw TCP".to_string()
    }))
}
