//! The PNG chart of a run: on the left the latency CDFs (TTFT, inter-token, end-to-end) on
//! a log-scale time axis, on the right throughput over time (output tokens per second, and
//! completed requests per second scaled onto the same axis); below, where the mean
//! request's time went, phase by phase, as one stacked bar. Drawn on a plain RGB raster
//! with the 8×8 bitmap font of `font8x8` and encoded with `png`: no system fonts needed.

use super::report::Report;

type Rgb = [u8; 3];
pub(super) const BLACK: Rgb = [30, 30, 30];
pub(super) const GRID: Rgb = [225, 225, 225];
const BLUE: Rgb = [31, 119, 180];
const ORANGE: Rgb = [230, 120, 20];
const GREEN: Rgb = [44, 160, 44];
/// Colours for several series.
pub(super) const PALETTE: [Rgb; 12] = [
    BLUE,
    ORANGE,
    GREEN,
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
    [255, 187, 120],
    [152, 223, 138],
];

/// An RGB raster.
pub(super) struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    pub(super) fn new(w: usize, h: usize) -> Self {
        Self { w, h, px: vec![255; w * h * 3] }
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    pub(super) fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        for y in y0..=y1 {
            for x in x0..=x1 {
                self.set(x, y, c);
            }
        }
    }

    /// A line two pixels wide.
    pub(super) fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: Rgb) {
        let n = (x1 - x0).abs().max((y1 - y0).abs()).ceil().max(1.0) as usize;
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = ((x0 + (x1 - x0) * t).round() as i64, (y0 + (y1 - y0) * t).round() as i64);
            self.rect(x, y, x + 1, y + 1, c);
        }
    }

    pub(super) fn text(&mut self, x: i64, y: i64, s: &str, c: Rgb) {
        for (k, ch) in s.chars().enumerate() {
            let glyph = font8x8::legacy::BASIC_LEGACY[(ch as usize).min(127)];
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits >> col & 1 == 1 {
                        self.set(x + k as i64 * 8 + col, y + row as i64, c);
                    }
                }
            }
        }
    }

    pub(super) fn png(&self) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let mut e = png::Encoder::new(&mut out, self.w as u32, self.h as u32);
        e.set_color(png::ColorType::Rgb);
        e.set_depth(png::BitDepth::Eight);
        let mut w = e.write_header().map_err(|e| e.to_string())?;
        w.write_image_data(&self.px).map_err(|e| e.to_string())?;
        w.finish().map_err(|e| e.to_string())?;
        Ok(out)
    }
}

/// A plot area: pixels `[x0, x1] × [y0, y1]`.
#[derive(Clone, Copy)]
pub(super) struct Area {
    pub(super) x0: f64,
    pub(super) y0: f64,
    pub(super) x1: f64,
    pub(super) y1: f64,
}

impl Area {
    pub(super) fn at(&self, fx: f64, fy: f64) -> (f64, f64) {
        (self.x0 + (self.x1 - self.x0) * fx.clamp(0.0, 1.0), self.y1 - (self.y1 - self.y0) * fy.clamp(0.0, 1.0))
    }

    pub(super) fn frame(&self, c: &mut Canvas, title: &str) {
        let (x0, y0, x1, y1) = (self.x0 as i64, self.y0 as i64, self.x1 as i64, self.y1 as i64);
        c.rect(x0, y1, x1, y1 + 1, BLACK);
        c.rect(x0 - 1, y0, x0, y1, BLACK);
        c.text(x0, y0 - 20, title, BLACK);
    }
}

pub(super) fn nice_ceiling(x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|v| *v >= x).unwrap_or(10.0 * p)
}

const HEIGHT: usize = 680;

/// Below the plots: the mean request's time as one bar of its phases, with a legend.
fn phase_bar(c: &mut Canvas, r: &Report) {
    let (x0, x1, y0) = (70.0, 1170.0, 516i64);
    let p = &r.phases;
    if p.requests == 0 {
        c.text(x0 as i64, y0, "where the time went: no request reported its phases", BLACK);
        return;
    }
    let title = format!(
        "where the mean request's time went ({} requests; phases = {:.1} % of end-to-end)",
        p.requests,
        p.sum_over_e2e * 100.0
    );
    c.text(x0 as i64, y0, &title, BLACK);
    let mut x = x0;
    let mut legend = 0;
    for (k, ph) in p.phases.iter().enumerate() {
        let col = PALETTE[k % PALETTE.len()];
        let w = (x1 - x0) * ph.share;
        if w >= 0.5 {
            c.rect(x.round() as i64, y0 + 14, (x + w).round() as i64 - 1, y0 + 40, col);
        }
        x += w;
        if ph.ms.mean > 0.0 {
            let (lx, ly) = (x0 as i64 + 275 * (legend % 4), y0 + 50 + 14 * (legend / 4));
            c.rect(lx, ly + 1, lx + 10, ly + 7, col);
            c.text(lx + 14, ly, &format!("{} {:.1} ms", ph.phase, ph.ms.mean), BLACK);
            legend += 1;
        }
    }
}

/// The chart of `r` with the raw latencies (seconds) behind its CDFs, as PNG bytes.
pub fn render(r: &Report, ttft: &[f64], itl: &[f64], e2e: &[f64]) -> Result<Vec<u8>, String> {
    let mut c = Canvas::new(1200, HEIGHT);
    c.text(20, 12, &format!("ferry bench: {} ({}), {} requests", r.workload, r.mode, r.completed), BLACK);

    // Left: latency CDFs over log10(ms).
    let a = Area { x0: 70.0, y0: 70.0, x1: 560.0, y1: 430.0 };
    let all_ms = || ttft.iter().chain(itl).chain(e2e).map(|s| s * 1000.0).filter(|v| *v > 0.0);
    let largest = all_ms().fold(0.0f64, f64::max);
    let smallest = all_ms().fold(f64::INFINITY, f64::min).max(largest / 1e4);
    let lo = if smallest.is_finite() { smallest.max(0.01).log10().floor() } else { 0.0 };
    let hi = all_ms().fold(0.0f64, f64::max).max(1.0).log10().ceil().clamp(lo + 1.0, lo + 8.0);
    for d in (lo as i64)..=(hi as i64) {
        let fx = (d as f64 - lo) / (hi - lo);
        let (x, _) = a.at(fx, 0.0);
        c.rect(x as i64, a.y0 as i64, x as i64, a.y1 as i64, GRID);
        let label = if d >= 0 { format!("{}", 10u64.pow(d as u32)) } else { format!("{}", 10f64.powi(d as i32)) };
        c.text(x as i64 - 4 * label.len() as i64, a.y1 as i64 + 8, &label, BLACK);
    }
    for q in 0..=4 {
        let fy = q as f64 / 4.0;
        let (_, y) = a.at(0.0, fy);
        c.rect(a.x0 as i64, y as i64, a.x1 as i64, y as i64, GRID);
        c.text(a.x0 as i64 - 40, y as i64 - 4, &format!("{:.2}", fy), BLACK);
    }
    a.frame(&mut c, "latency CDF (x: ms, log scale; y: fraction of requests)");
    for (k, (name, v, col)) in
        [("TTFT", ttft, BLUE), ("inter-token", itl, ORANGE), ("end-to-end", e2e, GREEN)].into_iter().enumerate()
    {
        let mut ms: Vec<f64> = v.iter().map(|s| (s * 1000.0).max(10f64.powf(lo))).collect();
        ms.sort_by(f64::total_cmp);
        let n = ms.len();
        let mut prev: Option<(f64, f64)> = None;
        for (i, m) in ms.iter().enumerate() {
            let fx = (m.log10() - lo) / (hi - lo);
            let p_lo = a.at(fx, i as f64 / n as f64);
            let p_hi = a.at(fx, (i + 1) as f64 / n as f64);
            if let Some(p) = prev {
                c.line(p, (p_lo.0, p.1), col);
            }
            c.line(p_lo, p_hi, col);
            prev = Some(p_hi);
        }
        let ly = a.y1 as i64 + 32 + 14 * k as i64;
        c.rect(a.x0 as i64 + 12, ly + 2, a.x0 as i64 + 28, ly + 4, col);
        c.text(
            a.x0 as i64 + 34,
            ly,
            &format!(
                "{name} (p50 {:.1} ms)",
                match k {
                    0 => r.ttft_ms.p50,
                    1 => r.itl_ms.p50,
                    _ => r.e2e_ms.p50,
                }
            ),
            col,
        );
    }

    // Right: throughput over time.
    let b = Area { x0: 690.0, y0: 70.0, x1: 1170.0, y1: 430.0 };
    let secs = r.timeline.len().max(1) as f64;
    let max_tok = r.timeline.iter().map(|x| x.output_tokens).max().unwrap_or(0) as f64;
    let max_req = r.timeline.iter().map(|x| x.completed).max().unwrap_or(0) as f64;
    let top = nice_ceiling(max_tok.max(1.0));
    let req_scale = if max_req > 0.0 { top / nice_ceiling(max_req) } else { 1.0 };
    for q in 0..=4 {
        let fy = q as f64 / 4.0;
        let (_, y) = b.at(0.0, fy);
        c.rect(b.x0 as i64, y as i64, b.x1 as i64, y as i64, GRID);
        let v = top * fy;
        let label = if v.fract() == 0.0 { format!("{v:>5.0}") } else { format!("{v:>5.1}") };
        c.text(b.x0 as i64 - 48, y as i64 - 4, &label, BLACK);
    }
    let step = nice_ceiling(secs / 8.0).max(1.0);
    let mut t = 0.0;
    while t <= secs {
        let (x, _) = b.at(t / secs, 0.0);
        c.text(x as i64 - 4, b.y1 as i64 + 8, &format!("{t:.0}"), BLACK);
        t += step;
    }
    b.frame(&mut c, "throughput (x: s; y: output tokens/s)");
    let series = |f: &dyn Fn(&super::report::Bucket) -> f64| -> Vec<(f64, f64)> {
        r.timeline.iter().map(|x| b.at((x.t + 0.5) / secs, f(x) / top)).collect()
    };
    for (pts, col) in
        [(series(&|x| x.output_tokens as f64), BLUE), (series(&|x| x.completed as f64 * req_scale), GREEN)]
    {
        for w in pts.windows(2) {
            c.line(w[0], w[1], col);
        }
        if let [p] = pts[..] {
            c.rect(p.0 as i64 - 2, p.1 as i64 - 2, p.0 as i64 + 2, p.1 as i64 + 2, col);
        }
    }
    c.rect(b.x0 as i64 + 12, b.y1 as i64 + 34, b.x0 as i64 + 28, b.y1 as i64 + 36, BLUE);
    c.text(b.x0 as i64 + 34, b.y1 as i64 + 32, &format!("output tokens/s (mean {:.1})", r.output_tokens_per_s), BLUE);
    c.rect(b.x0 as i64 + 12, b.y1 as i64 + 48, b.x0 as i64 + 28, b.y1 as i64 + 50, GREEN);
    c.text(
        b.x0 as i64 + 34,
        b.y1 as i64 + 46,
        &format!("requests/s x {req_scale:.0} (mean {:.2})", r.requests_per_s),
        GREEN,
    );
    phase_bar(&mut c, r);
    c.text(
        20,
        HEIGHT as i64 - 24,
        &format!(
            "TTFT p50/p90/p99 {:.0}/{:.0}/{:.0} ms   ITL p50 {:.1} ms   prefix cache hit {:.1} %",
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.prefix_cache.hit_rate * 100.0
        ),
        BLACK,
    );
    c.png()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_decodable_png() {
        use super::super::report::{Bucket, Dist, Phase, Phases};
        let phases = ferry_cluster::phases::BREAKDOWN
            .iter()
            .enumerate()
            .map(|(i, p)| Phase {
                phase: p.to_string(),
                ms: Dist { mean: (i % 4) as f64 * 100.0, ..Dist::default() },
                share: (i % 4) as f64 / 18.0,
            })
            .collect();
        let r = Report {
            timeline: vec![
                Bucket { t: 0.0, completed: 2, output_tokens: 40 },
                Bucket { t: 1.0, completed: 1, output_tokens: 25 },
            ],
            phases: Phases { requests: 3, phases, sum_over_e2e: 0.98 },
            ..Report::default()
        };
        let png = render(&r, &[0.05, 0.1], &[0.01, 0.02, 0.012], &[0.5, 0.9]).expect("png");
        let d = png::Decoder::new(std::io::Cursor::new(png));
        let reader = d.read_info().expect("a PNG");
        assert_eq!((reader.info().width, reader.info().height), (1200, HEIGHT as u32));
        // Empty runs render too.
        render(&Report::default(), &[], &[], &[]).expect("empty");
    }
}
