//! A latency-over-time chart as a self-contained SVG: one point per request at its start time,
//! end-to-end latency and time to first token as two series, failed requests as red crosses on the
//! time axis. Written by hand (a few dozen elements), so no plotting library is needed.

use crate::report::BenchReport;
use std::fmt::Write as _;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 540.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 70.0;
/// Roughly how many ticks an axis gets.
const TICKS: f64 = 6.0;
const E2E_COLOUR: &str = "#1f77b4";
const TTFT_COLOUR: &str = "#ff7f0e";
const FAILED_COLOUR: &str = "#d62728";

/// A step of 1, 2 or 5 times a power of ten that cuts `range` into about [`TICKS`] parts.
fn nice_step(range: f64) -> f64 {
    if !range.is_finite() || range <= 0.0 {
        return 1.0;
    }
    let raw = range / TICKS;
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude)
}

/// Escape text for XML content and attributes.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn tick_label(value: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{value:.0}")
    } else {
        let decimals = (-step.log10().floor()) as usize;
        format!("{value:.decimals$}")
    }
}

/// The chart of a report.
pub fn render_svg(report: &BenchReport) -> String {
    let x_max_data = report.requests.iter().map(|r| r.start_s).fold(report.duration_s, f64::max);
    let y_max_data = report
        .requests
        .iter()
        .flat_map(|r| [r.e2e_ms, r.ttft_ms])
        .flatten()
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let x_step = nice_step(x_max_data.max(1e-3));
    let y_step = nice_step(y_max_data.max(1e-3));
    let x_max = (x_max_data / x_step).ceil().max(1.0) * x_step;
    let y_max = (y_max_data / y_step).ceil().max(1.0) * y_step;
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let px = |x: f64| LEFT + x / x_max * plot_w;
    let py = |y: f64| TOP + plot_h - y / y_max * plot_h;

    let mut svg = String::new();
    // Writing into a String cannot fail, so the results of `write!` are ignored.
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16">Latency over time: {} ({})</text>"#,
        WIDTH / 2.0,
        escape(&report.model),
        escape(&report.workload)
    );

    // Grid, ticks and tick labels.
    let mut x = 0.0;
    while x <= x_max + x_step / 2.0 {
        let _ = writeln!(
            svg,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#e0e0e0"/><text x="{0:.1}" y="{3:.1}" text-anchor="middle">{4}</text>"##,
            px(x),
            TOP,
            TOP + plot_h,
            TOP + plot_h + 18.0,
            tick_label(x, x_step)
        );
        x += x_step;
    }
    let mut y = 0.0;
    while y <= y_max + y_step / 2.0 {
        let _ = writeln!(
            svg,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{2:.1}" y2="{1:.1}" stroke="#e0e0e0"/><text x="{3:.1}" y="{4:.1}" text-anchor="end">{5}</text>"##,
            LEFT,
            py(y),
            LEFT + plot_w,
            LEFT - 8.0,
            py(y) + 4.0,
            tick_label(y, y_step)
        );
        y += y_step;
    }
    // Axes and their labels.
    let _ = writeln!(
        svg,
        r#"<line x1="{LEFT}" y1="{0}" x2="{1}" y2="{0}" stroke="black"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{0}" stroke="black"/>"#,
        TOP + plot_h,
        LEFT + plot_w
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">request start (s)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 20.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="20" y="{0:.1}" text-anchor="middle" transform="rotate(-90 20 {0:.1})">latency (ms)</text>"#,
        TOP + plot_h / 2.0
    );

    // Points: end-to-end first so time-to-first-token draws on top where they overlap.
    let _ = writeln!(svg, r#"<g class="e2e" fill="{E2E_COLOUR}" fill-opacity="0.7">"#);
    for r in &report.requests {
        if let Some(v) = r.e2e_ms {
            let _ = writeln!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3"/>"#, px(r.start_s), py(v));
        }
    }
    let _ = writeln!(svg, "</g>");
    let _ = writeln!(svg, r#"<g class="ttft" fill="{TTFT_COLOUR}" fill-opacity="0.7">"#);
    for r in &report.requests {
        if let Some(v) = r.ttft_ms {
            let _ = writeln!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="2.5"/>"#, px(r.start_s), py(v));
        }
    }
    let _ = writeln!(svg, "</g>");
    let _ = writeln!(svg, r#"<g class="failed" stroke="{FAILED_COLOUR}" stroke-width="1.5">"#);
    for r in report.requests.iter().filter(|r| r.status != "ok") {
        let (cx, cy) = (px(r.start_s), py(0.0));
        let _ = writeln!(
            svg,
            r#"<path d="M{:.1} {:.1} l8 8 m-8 0 l8 -8"><title>{}</title></path>"#,
            cx - 4.0,
            cy - 4.0,
            escape(&r.status)
        );
    }
    let _ = writeln!(svg, "</g>");

    // Legend.
    let lx = LEFT + plot_w - 170.0;
    let legend = [
        (E2E_COLOUR, format!("end-to-end ({} ok)", report.requests_completed)),
        (TTFT_COLOUR, "time to first token".to_string()),
        (FAILED_COLOUR, format!("failed ({})", report.requests_failed)),
    ];
    for (i, (colour, label)) in legend.iter().enumerate() {
        let ly = TOP + 12.0 + 18.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<circle cx="{lx:.1}" cy="{ly:.1}" r="4" fill="{colour}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 10.0,
            ly + 4.0,
            escape(label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_one_two_five() {
        assert_eq!(nice_step(10.0), 2.0);
        assert_eq!(nice_step(600.0), 100.0);
        assert!((nice_step(0.3) - 0.05).abs() < 1e-12);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(escape("a<b>&\"c\""), "a&lt;b&gt;&amp;&quot;c&quot;");
    }
}
