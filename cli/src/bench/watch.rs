//! Resources over a bench run (the soak test's record): every few seconds, the resident memory
//! of the named daemon processes (`/proc/PID/status`) and every worker's free and evictable
//! KV pages (the router's `ListWorkers`), with the requests finished so far. Written as CSV
//! and drawn as a PNG (memory per process and free pages per worker over time), with a
//! summary of growth between the first sample after warm-up and the last.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;

use super::chart::{Area, BLACK, Canvas, GRID, PALETTE, nice_ceiling};

/// One sample.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Point {
    /// Seconds since the run started.
    pub t: f64,
    /// Resident memory per watched process, MiB, in `--watch-pid` order (None: gone).
    pub rss_mib: Vec<Option<f64>>,
    /// Per worker id: (free pages, evictable pages, total pages).
    pub pages: Vec<(String, u32, u32, u32)>,
    /// Requests finished so far (completed, failed).
    pub done: (usize, usize),
}

/// What to watch.
#[derive(Debug, Clone)]
pub struct Watch {
    /// `name=PID` pairs.
    pub pids: Vec<(String, u32)>,
    /// The router's gRPC `host:port` (for the workers' pages).
    pub router: Option<String>,
    /// Seconds between samples.
    pub every: f64,
}

/// Parses `name=PID` (or a bare PID, named by itself).
pub fn parse_pid(s: &str) -> Result<(String, u32), String> {
    let (name, pid) = s.split_once('=').unwrap_or((s, s));
    let pid = pid.trim().parse().map_err(|_| format!("--watch-pid {s}: expected NAME=PID"))?;
    Ok((name.trim().to_string(), pid))
}

/// Resident memory of `pid`, MiB.
fn rss_mib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = s.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok()?;
    Some(kib / 1024.0)
}

async fn pages(
    client: &mut Option<pb::router_client::RouterClient<tonic::transport::Channel>>,
) -> Vec<(String, u32, u32, u32)> {
    let Some(c) = client else { return Vec::new() };
    let Ok(r) = c.list_workers(pb::ListWorkersRequest {}).await else { return Vec::new() };
    let mut out: Vec<_> = r
        .into_inner()
        .workers
        .into_iter()
        .filter_map(|w| w.load.map(|l| (w.worker_id, l.free_pages, l.evictable_pages, l.total_pages)))
        .collect();
    out.sort();
    out
}

/// Samples until dropped (the returned task is aborted at the end of the run).
pub fn start(
    w: Watch,
    clock: Instant,
    done: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    out: Arc<std::sync::Mutex<Vec<Point>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut client = match &w.router {
            Some(a) => match tonic::transport::Endpoint::from_shared(format!("http://{a}")) {
                Ok(e) => e.connect().await.ok().map(pb::router_client::RouterClient::new),
                Err(_) => None,
            },
            None => None,
        };
        // A year at most: `--watch-every inf` would overflow the timer.
        let every = Duration::from_secs_f64(w.every.clamp(0.1, ferry_cluster::args::MAX_TIMEOUT_SECS));
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let p = Point {
                t: clock.elapsed().as_secs_f64(),
                rss_mib: w.pids.iter().map(|(_, pid)| rss_mib(*pid)).collect(),
                pages: pages(&mut client).await,
                done: (done.load(Ordering::Relaxed), failed.load(Ordering::Relaxed)),
            };
            if let Ok(mut o) = out.lock() {
                o.push(p);
            }
        }
    })
}

/// The samples as CSV: `t,done,failed,rss_<name>...,free_<worker>,evictable_<worker>...`.
pub fn csv(w: &Watch, points: &[Point]) -> String {
    let workers: Vec<String> = points.iter().flat_map(|p| p.pages.iter().map(|x| x.0.clone())).collect();
    let mut workers: Vec<String> = workers.into_iter().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    workers.sort();
    let mut s = String::from("t,done,failed");
    for (n, _) in &w.pids {
        let _ = write!(s, ",rss_mib_{n}");
    }
    for id in &workers {
        let _ = write!(s, ",free_pages_{id},evictable_pages_{id}");
    }
    s.push('\n');
    for p in points {
        let _ = write!(s, "{:.1},{},{}", p.t, p.done.0, p.done.1);
        for r in &p.rss_mib {
            let _ = write!(s, ",{}", r.map_or(String::new(), |v| format!("{v:.1}")));
        }
        for id in &workers {
            match p.pages.iter().find(|x| &x.0 == id) {
                Some(x) => {
                    let _ = write!(s, ",{},{}", x.1, x.2);
                }
                None => s.push_str(",,"),
            }
        }
        s.push('\n');
    }
    s
}

/// Growth per process between the first sample at or after `warm` seconds and the last,
/// and each worker's lowest and last free + evictable pages.
pub fn summary(w: &Watch, points: &[Point], warm: f64) -> String {
    let mut s = String::new();
    let first = points.iter().find(|p| p.t >= warm).or(points.first());
    let (Some(first), Some(last)) = (first, points.last()) else { return "no samples\n".into() };
    let _ = writeln!(s, "resident memory, MiB (at {:.0} s → at {:.0} s):", first.t, last.t);
    for (i, (n, pid)) in w.pids.iter().enumerate() {
        let (a, b) = (first.rss_mib.get(i).copied().flatten(), last.rss_mib.get(i).copied().flatten());
        let peak = points.iter().filter_map(|p| p.rss_mib.get(i).copied().flatten()).fold(0.0, f64::max);
        match (a, b) {
            (Some(a), Some(b)) => {
                let _ = writeln!(
                    s,
                    "  {n:<12} (pid {pid}) {a:8.1} → {b:8.1}  ({:+.1} %, peak {peak:.1})",
                    (b / a - 1.0) * 100.0
                );
            }
            _ => {
                let _ = writeln!(s, "  {n:<12} (pid {pid}) gone");
            }
        }
    }
    let _ = writeln!(s, "KV pages available (free + evictable) / total, lowest and last:");
    for (id, _, _, total) in &last.pages {
        let avail = |p: &Point| p.pages.iter().find(|x| &x.0 == id).map(|x| x.1 + x.2);
        let low = points.iter().filter_map(avail).min().unwrap_or(0);
        let _ = writeln!(s, "  {id:<24} lowest {low} / {total}, last {} / {total}", avail(last).unwrap_or(0));
    }
    s
}

/// The chart: resident memory per process (left) and free pages per worker (right).
pub fn render(w: &Watch, points: &[Point], title: &str) -> Result<Vec<u8>, String> {
    let mut c = Canvas::new(1200, 560);
    c.text(20, 12, title, BLACK);
    let secs = points.last().map_or(1.0, |p| p.t).max(1.0);
    let rss: Vec<(String, Vec<(f64, f64)>)> = w
        .pids
        .iter()
        .enumerate()
        .map(|(i, (n, _))| {
            (n.clone(), points.iter().filter_map(|p| Some((p.t, p.rss_mib.get(i).copied()??))).collect())
        })
        .collect();
    panel(&mut c, Area { x0: 80.0, y0: 70.0, x1: 560.0, y1: 430.0 }, "resident memory (x: s; y: MiB)", &rss, secs);
    let mut ids: Vec<String> = points.iter().flat_map(|p| p.pages.iter().map(|x| x.0.clone())).collect();
    ids.sort();
    ids.dedup();
    let free: Vec<(String, Vec<(f64, f64)>)> = ids
        .iter()
        .map(|id| {
            let v =
                points.iter().filter_map(|p| Some((p.t, f64::from(p.pages.iter().find(|x| &x.0 == id)?.1)))).collect();
            (id.clone(), v)
        })
        .collect();
    panel(&mut c, Area { x0: 700.0, y0: 70.0, x1: 1170.0, y1: 430.0 }, "free KV pages (x: s)", &free, secs);
    c.png()
}

fn panel(c: &mut Canvas, a: Area, title: &str, series: &[(String, Vec<(f64, f64)>)], secs: f64) {
    let top = nice_ceiling(series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(0.0, f64::max).max(1.0));
    for q in 0..=4 {
        let fy = q as f64 / 4.0;
        let (_, y) = a.at(0.0, fy);
        c.rect(a.x0 as i64, y as i64, a.x1 as i64, y as i64, GRID);
        c.text(a.x0 as i64 - 56, y as i64 - 4, &format!("{:>6.0}", top * fy), BLACK);
    }
    let step = nice_ceiling(secs / 8.0).max(1.0);
    let mut t = 0.0;
    while t <= secs {
        let (x, _) = a.at(t / secs, 0.0);
        c.text(x as i64 - 4, a.y1 as i64 + 8, &format!("{t:.0}"), BLACK);
        t += step;
    }
    a.frame(c, title);
    for (k, (name, pts)) in series.iter().enumerate() {
        let col = PALETTE[k % PALETTE.len()];
        let px: Vec<(f64, f64)> = pts.iter().map(|&(t, v)| a.at(t / secs, v / top)).collect();
        for w in px.windows(2) {
            c.line(w[0], w[1], col);
        }
        let ly = a.y1 as i64 + 32 + 14 * k as i64;
        c.rect(a.x0 as i64 + 12, ly + 2, a.x0 as i64 + 28, ly + 4, col);
        let last = pts.last().map_or(String::new(), |p| format!(" (last {:.0})", p.1));
        c.text(a.x0 as i64 + 34, ly, &format!("{name}{last}"), col);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn points() -> (Watch, Vec<Point>) {
        let w = Watch { pids: vec![("router".into(), 1), ("decode-0".into(), 2)], router: None, every: 5.0 };
        let p = |t: f64, a: f64, b: f64, free: u32| Point {
            t,
            rss_mib: vec![Some(a), Some(b)],
            pages: vec![("d0".into(), free, 0, 256), ("p0".into(), 200, 40, 256)],
            done: (t as usize, 0),
        };
        (w, vec![p(0.0, 10.0, 100.0, 256), p(60.0, 20.0, 120.0, 200), p(120.0, 21.0, 121.0, 250)])
    }

    #[test]
    fn csv_summary_and_chart() {
        let (w, pts) = points();
        let text = csv(&w, &pts);
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some(
                "t,done,failed,rss_mib_router,rss_mib_decode-0,free_pages_d0,evictable_pages_d0,free_pages_p0,evictable_pages_p0"
            )
        );
        assert_eq!(lines.nth(1), Some("60.0,60,0,20.0,120.0,200,0,200,40"));
        let s = summary(&w, &pts, 60.0);
        assert!(s.contains("20.0 →     21.0  (+5.0 %"), "{s}");
        assert!(s.contains("d0                       lowest 200 / 256, last 250 / 256"), "{s}");
        let png = render(&w, &pts, "soak").expect("png");
        let d = png::Decoder::new(std::io::Cursor::new(png));
        assert_eq!(d.read_info().expect("a PNG").info().width, 1200);
        render(&w, &[], "empty").expect("empty");
    }

    #[test]
    fn pids_parse_with_or_without_a_name() {
        assert_eq!(parse_pid("router=42"), Ok(("router".into(), 42)));
        assert_eq!(parse_pid("7"), Ok(("7".into(), 7)));
        assert!(parse_pid("x=y").is_err());
    }

    #[test]
    fn this_process_has_a_resident_size() {
        assert!(rss_mib(std::process::id()).is_some_and(|m| m > 0.0));
    }
}
