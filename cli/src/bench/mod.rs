//! `ferry bench`: a load generator against a router's OpenAI HTTP API or gRPC endpoint.
//!
//! - [`workload`]: what to send (`shared-prefix`, `multi-turn`, `few-shot`, `random`, a
//!   Mooncake `trace`); [`conversation`]: the `multi-turn` loop;
//! - [`client`]: sending one request and timing its tokens;
//! - [`report`]: the figures (table, JSON), [`turns`] by turn of a conversation; [`chart`]:
//!   the PNG;
//! - [`watch`]: daemons' memory and workers' free pages over the run (the soak record).
//!
//! Pacing: closed loop (`--concurrency N` requests in flight), open loop (`--rate R`
//! requests per second, Poisson arrivals), or a trace's own timestamps. Requests are sent for
//! `--duration` seconds (or until `--requests`); those still running get `--drain` seconds
//! more, then count as failed.

pub mod chart;
pub mod client;
pub mod conversation;
pub mod report;
pub mod turns;
pub mod watch;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::{Rng, SeedableRng};

use client::{Sample, Sampling, Target};
use report::{Report, Slo};
use workload::{Item, Synth, TraceShape};

/// What `ferry bench` sends (`--workload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Chat turns that share system prompts and conversation history.
    SharedPrefix,
    /// Conversations driven turn by turn (closed loop): each turn carries the model's actual
    /// earlier answers, with --think-time between turns.
    MultiTurn,
    /// Few-shot prompts: a long shared block of examples, then a short question.
    FewShot,
    /// Prompts of random words, no shared prefixes.
    Random,
    /// A Mooncake trace's arrivals and lengths (`--trace FILE`).
    Trace,
}

/// Flags of `ferry bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Where to send: `http://host:port` (the OpenAI API, streamed) or `grpc://host:port`
    /// (the `ferry.v1.Router` service).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Workload: `shared-prefix`, `multi-turn`, `few-shot`, `random` or `trace`.
    #[arg(long, value_enum, default_value_t = Workload::SharedPrefix)]
    pub workload: Workload,
    /// A Mooncake trace (JSON lines of timestamp, input_length, output_length, hash_ids) for
    /// `--workload trace`.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Open loop: requests per second, with Poisson arrivals.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop: requests kept in flight. Default 4 (a trace replays its own timestamps
    /// unless this or --rate is given).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Seconds during which requests are sent.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Send at most this many requests (0: as many as the duration allows).
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    /// Seconds requests still running after --duration may take; then they count as failed.
    #[arg(long, default_value_t = 60.0)]
    pub drain: f64,
    /// Failed requests tolerated: more make `ferry bench` exit with an error after the report.
    #[arg(long, default_value_t = 0)]
    pub max_failed: usize,
    /// Words (about one token each) per system prompt or few-shot block; per random prompt.
    #[arg(long, default_value_t = 200)]
    pub prefix_words: usize,
    /// Words per question.
    #[arg(long, default_value_t = 12)]
    pub question_words: usize,
    /// `shared-prefix`: distinct system prompts.
    #[arg(long, default_value_t = 4)]
    pub system_prompts: usize,
    /// `shared-prefix`: conversations.
    #[arg(long, default_value_t = 16)]
    pub conversations: usize,
    /// `shared-prefix`, `multi-turn`: turns per conversation.
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// `multi-turn`: seconds between an answer and the conversation's next turn.
    #[arg(long, default_value_t = 0.5)]
    pub think_time: f64,
    /// Tokens to generate per request (synthetic workloads).
    #[arg(long, default_value_t = 32)]
    pub output_len: u32,
    /// Seed of the synthetic workloads and the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `trace`: tokens per hash block (Mooncake traces use 512).
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// `trace`: prompts are cut to this many tokens (the model's context must hold them).
    #[arg(long, default_value_t = 4096)]
    pub max_input_len: usize,
    /// `trace`: outputs are cut to this many tokens.
    #[arg(long, default_value_t = 256)]
    pub max_output_len: usize,
    /// `trace`: token ids are drawn below this (at least the model's vocabulary size must be).
    #[arg(long, default_value_t = 8192)]
    pub trace_vocab: u32,
    /// `trace`: replay speed (2: twice as fast as recorded).
    #[arg(long, default_value_t = 1.0)]
    pub trace_speed: f64,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Stop at end-of-sequence tokens (by default every request generates its full length).
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Goodput SLO: time to first token, ms.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// Goodput SLO: a request's mean inter-token latency, ms.
    #[arg(long)]
    pub slo_itl_ms: Option<f64>,
    /// Goodput SLO: end-to-end latency, ms.
    #[arg(long)]
    pub slo_e2e_ms: Option<f64>,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the chart (latency CDFs, throughput over time) as PNG here.
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// The model name to send over HTTP (default: the first one `/v1/models` lists).
    #[arg(long)]
    pub model: Option<String>,
    /// API key (`Authorization: Bearer`).
    #[arg(long, env = ferry_cluster::env::API_KEY)]
    pub api_key: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Watch a daemon's resident memory over the run, `NAME=PID`; repeat for more.
    #[arg(long = "watch-pid", value_parser = watch::parse_pid)]
    pub watch_pids: Vec<(String, u32)>,
    /// The router's gRPC `host:port` to read every worker's free KV pages from over the run
    /// (default: the --url when it is grpc://).
    #[arg(long)]
    pub watch_router: Option<String>,
    /// Seconds between watch samples (0: no watching unless --watch-pid or --watch-csv is set,
    /// then 5).
    #[arg(long, default_value_t = 0.0)]
    pub watch_every: f64,
    /// Write the watch samples (memory per process, pages per worker) as CSV here.
    #[arg(long)]
    pub watch_csv: Option<PathBuf>,
    /// Draw the watch samples as PNG here.
    #[arg(long)]
    pub watch_png: Option<PathBuf>,
    /// Seconds of warm-up before the watch summary's first sample.
    #[arg(long, default_value_t = 60.0)]
    pub watch_warmup: f64,
}

enum Pace {
    Closed(usize),
    Open(f64),
    Trace,
}

/// The requests to send, by index (None: no more).
struct Source {
    synth: Synth,
    kind: Workload,
    trace: Vec<Item>,
}

impl Source {
    fn item(&self, i: usize) -> Option<Item> {
        match self.kind {
            Workload::SharedPrefix => Some(workload::shared_prefix(&self.synth, i)),
            // Driven by `conversation::slot`, which needs each answer first.
            Workload::MultiTurn => None,
            Workload::FewShot => Some(workload::few_shot(&self.synth, i)),
            Workload::Random => Some(workload::random(&self.synth, i)),
            Workload::Trace => self.trace.get(i).cloned(),
        }
    }
}

async fn target(args: &BenchArgs) -> anyhow::Result<Target> {
    if let Some(rest) = args.url.strip_prefix("http://") {
        let authority = rest.trim_end_matches('/').trim_end_matches("/v1").to_string();
        let model = match &args.model {
            Some(m) => m.clone(),
            None => client::first_model(&authority, args.api_key.as_deref()).await.map_err(anyhow::Error::msg)?,
        };
        return Ok(Target::Http { authority, model, api_key: args.api_key.clone() });
    }
    if let Some(rest) = args.url.strip_prefix("grpc://") {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{rest}"))?
            .connect()
            .await
            .with_context(|| format!("connect to {}", args.url))?;
        return Ok(Target::Grpc {
            client: ferry_proto::v1::router_client::RouterClient::new(ch),
            api_key: args.api_key.clone(),
        });
    }
    bail!("--url {}: use http://host:port or grpc://host:port (https is not supported by the bench)", args.url)
}

/// Runs `ferry bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(bench(&args))?;
    print!("{}", report.table());
    if report.failed > args.max_failed {
        bail!("{} requests failed (--max-failed {})", report.failed, args.max_failed);
    }
    Ok(())
}

async fn bench(args: &BenchArgs) -> anyhow::Result<Report> {
    let duration = ferry_cluster::args::seconds("duration", args.duration)?;
    let drain = match args.drain {
        0.0 => Duration::ZERO,
        d => ferry_cluster::args::seconds("drain", d)?,
    };
    let mut cut = 0;
    let mut trace = Vec::new();
    match args.workload {
        Workload::SharedPrefix | Workload::MultiTurn | Workload::FewShot | Workload::Random => {}
        Workload::Trace => {
            let path = args.trace.as_ref().context("--workload trace needs --trace FILE")?;
            let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
            let lines = workload::read_trace(&text).map_err(anyhow::Error::msg)?;
            let shape = TraceShape {
                block_size: args.trace_block_size.max(1),
                max_input: args.max_input_len.max(1),
                max_output: args.max_output_len.max(1),
                vocab: args.trace_vocab,
                speed: args.trace_speed,
            };
            (trace, cut) = workload::from_trace(&lines, &shape);
        }
    }
    let pace = match (args.rate, args.concurrency, crate::flag_name(&args.workload).as_str()) {
        (Some(r), _, _) if r > 0.0 && r.is_finite() => Pace::Open(r),
        (Some(r), _, _) => bail!("--rate {r} must be positive"),
        (None, Some(c), _) => Pace::Closed(c.max(1)),
        (None, None, "trace") => Pace::Trace,
        (None, None, _) => Pace::Closed(4),
    };
    if args.workload == Workload::MultiTurn && !matches!(pace, Pace::Closed(_)) {
        bail!("--workload multi-turn runs conversations in a closed loop: use --concurrency, not --rate");
    }
    let think = match args.think_time {
        0.0 => Duration::ZERO,
        t => ferry_cluster::args::seconds("think-time", t)?,
    };
    let mode = match pace {
        Pace::Closed(c) => format!("closed loop, concurrency {c}"),
        Pace::Open(r) => format!("open loop, {r} req/s"),
        Pace::Trace => format!("trace replay at {}x", args.trace_speed),
    };
    let source = Arc::new(Source {
        synth: Synth {
            prefix_words: args.prefix_words,
            question_words: args.question_words,
            system_prompts: args.system_prompts.max(1),
            conversations: args.conversations.max(1),
            turns: args.turns.max(1),
            output_len: args.output_len.max(1),
            seed: args.seed,
        },
        kind: args.workload,
        trace,
    });
    let target = Arc::new(target(args).await?);
    let sampling = Sampling { temperature: args.temperature, ignore_eos: !args.stop_at_eos };
    let limit = if args.requests == 0 { usize::MAX } else { args.requests };
    let clock = Instant::now();
    let stop_sending = clock + duration;
    let hard_end = stop_sending + drain;

    let progress = progress_bar(args);
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let ticker = {
        let (p, done, failed) = (progress.clone(), Arc::clone(&done), Arc::clone(&failed));
        let total = args.duration;
        tokio::spawn(async move {
            loop {
                let t = clock.elapsed().as_secs_f64();
                p.set_position((t.min(total) * 10.0) as u64);
                p.set_message(format!(
                    "{} done, {} failed",
                    done.load(Ordering::Relaxed),
                    failed.load(Ordering::Relaxed)
                ));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let one = {
        let (target, done, failed) = (Arc::clone(&target), Arc::clone(&done), Arc::clone(&failed));
        move |item: Item| {
            let (target, done, failed) = (Arc::clone(&target), Arc::clone(&done), Arc::clone(&failed));
            async move {
                let start = clock.elapsed().as_secs_f64();
                let s = match tokio::time::timeout_at(hard_end.into(), target.send(&item, sampling, clock)).await {
                    Ok(s) => s,
                    Err(_) => {
                        let end = clock.elapsed().as_secs_f64();
                        Sample {
                            start,
                            end,
                            error: Some("still running when the drain ended".into()),
                            ..Sample::default()
                        }
                    }
                };
                if s.error.is_some() { &failed } else { &done }.fetch_add(1, Ordering::Relaxed);
                s
            }
        }
    };

    let watching =
        args.watch_every > 0.0 || !args.watch_pids.is_empty() || args.watch_csv.is_some() || args.watch_png.is_some();
    let watch_cfg = watch::Watch {
        pids: args.watch_pids.clone(),
        router: args
            .watch_router
            .clone()
            .or_else(|| args.url.strip_prefix("grpc://").map(|s| s.trim_end_matches('/').to_string())),
        every: if args.watch_every > 0.0 { args.watch_every } else { 5.0 },
    };
    let points = Arc::new(std::sync::Mutex::new(Vec::new()));
    let watcher = watching
        .then(|| watch::start(watch_cfg.clone(), clock, Arc::clone(&done), Arc::clone(&failed), Arc::clone(&points)));

    let mut samples: Vec<Sample> = Vec::new();
    match pace {
        Pace::Closed(c) if args.workload == Workload::MultiTurn => {
            let shared = Arc::new(conversation::Shared {
                next: AtomicUsize::new(0),
                sent: AtomicUsize::new(0),
                limit,
                stop_sending,
                turns: args.turns.max(1),
                think,
            });
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..c {
                let (shared, source, one) = (Arc::clone(&shared), Arc::clone(&source), one.clone());
                tasks.spawn(async move { conversation::slot(&source.synth, &shared, one).await });
            }
            while let Some(r) = tasks.join_next().await {
                samples.extend(r.context("a bench task panicked")?);
            }
        }
        Pace::Closed(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..c {
                let (next, source, one) = (Arc::clone(&next), Arc::clone(&source), one.clone());
                tasks.spawn(async move {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= limit || Instant::now() >= stop_sending {
                            break;
                        }
                        let Some(item) = source.item(i) else { break };
                        mine.push(one(item).await);
                    }
                    mine
                });
            }
            while let Some(r) = tasks.join_next().await {
                samples.extend(r.context("a bench task panicked")?);
            }
        }
        Pace::Open(_) | Pace::Trace => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed ^ 0x5eed);
            let mut tasks = tokio::task::JoinSet::new();
            let mut at = 0.0f64;
            for i in 0..limit {
                let Some(item) = source.item(i) else { break };
                at = match (&pace, item.at) {
                    (Pace::Open(r), _) => at + -(1.0 - rng.random::<f64>()).ln() / r,
                    (_, Some(t)) => t,
                    _ => at,
                };
                let when = clock + Duration::from_secs_f64(at);
                if when >= stop_sending {
                    break;
                }
                tokio::time::sleep_until(when.into()).await;
                tasks.spawn(one.clone()(item));
            }
            while let Some(r) = tasks.join_next().await {
                samples.push(r.context("a bench request panicked")?);
            }
        }
    }
    ticker.abort();
    progress.finish_and_clear();
    if let Some(w) = watcher {
        w.abort();
        let pts = points.lock().map(|p| p.clone()).unwrap_or_default();
        print!("{}", watch::summary(&watch_cfg, &pts, args.watch_warmup));
        if let Some(p) = &args.watch_csv {
            std::fs::write(p, watch::csv(&watch_cfg, &pts)).with_context(|| format!("write {}", p.display()))?;
        }
        if let Some(p) = &args.watch_png {
            let title = format!(
                "ferry bench watch: {} ({}), {:.0} s",
                crate::flag_name(&args.workload),
                mode,
                clock.elapsed().as_secs_f64()
            );
            let png = watch::render(&watch_cfg, &pts, &title).map_err(anyhow::Error::msg)?;
            std::fs::write(p, png).with_context(|| format!("write {}", p.display()))?;
        }
    }

    let slo = Slo { ttft_ms: args.slo_ttft_ms, itl_ms: args.slo_itl_ms, e2e_ms: args.slo_e2e_ms };
    let mut report = Report::new(&samples, slo);
    report.workload = crate::flag_name(&args.workload);
    report.endpoint = args.url.clone();
    report.mode = mode;
    report.cut_to_fit = cut;
    if let Some(p) = &args.json {
        let v = serde_json::to_string_pretty(&report)?;
        std::fs::write(p, v + "\n").with_context(|| format!("write {}", p.display()))?;
    }
    if let Some(p) = &args.png {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
        let ttft: Vec<f64> = ok.iter().filter_map(|s| s.token_times.first().map(|t| t - s.start)).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|s| s.token_times.windows(2).map(|w| w[1] - w[0])).collect();
        let e2e: Vec<f64> = ok.iter().map(|s| s.end - s.start).collect();
        let png = chart::render(&report, &ttft, &itl, &e2e).map_err(anyhow::Error::msg)?;
        std::fs::write(p, png).with_context(|| format!("write {}", p.display()))?;
    }
    Ok(report)
}

fn progress_bar(args: &BenchArgs) -> indicatif::ProgressBar {
    if args.quiet {
        return indicatif::ProgressBar::hidden();
    }
    let p = indicatif::ProgressBar::new((args.duration * 10.0) as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {msg}") {
        p.set_style(style);
    }
    p
}
