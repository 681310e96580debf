//! A daemon's logs and traces: log lines on stderr (`RUST_LOG` picks what), and, when
//! `--otlp-endpoint` is set, each request's spans exported over OTLP/gRPC to a collector
//! (Jaeger, Tempo, an OpenTelemetry Collector). The router's, prefill's and decode's spans of
//! one request share the W3C trace context the router passes on ([`crate::traces`]), so a
//! collector shows them as one trace. Unset, nothing is exported and no exporter exists.

use std::sync::atomic::{AtomicBool, Ordering};

use ferry_core::TraceContext;
use opentelemetry::trace::{SpanContext, TraceContextExt as _, TraceFlags, TraceState, TracerProvider as _};
use opentelemetry::{SpanId, TraceId};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The flag that turns export on, shared by every daemon.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TelemetryArgs {
    /// OTLP/gRPC endpoint (`http://host:4317`) to export every request's spans to: the
    /// router's, prefill's and decode's span of a request form one trace (request id, room,
    /// role as attributes). Unset: nothing is exported; log lines still carry the trace id.
    #[arg(long, env = ferry_core::env::OTLP_ENDPOINT, help_heading = "Observability")]
    pub otlp_endpoint: Option<String>,
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built (a malformed endpoint).
    #[error("--otlp-endpoint {endpoint}: {why}")]
    Exporter {
        /// The endpoint given.
        endpoint: String,
        /// The exporter's reason.
        why: String,
    },
}

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Keeps the exporter alive; dropping it sends what is still buffered (a graceful stop).
#[must_use = "dropping it stops the export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans ended so far now instead of at the next batch.
    pub fn flush(&self) {
        if let Some(p) = &self.provider
            && let Err(e) = p.force_flush()
        {
            tracing::warn!(error = %e, "OTLP export failed");
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            EXPORTING.store(false, Ordering::Relaxed);
            let _ = p.shutdown();
        }
    }
}

/// Installs this process's logging (stderr; `RUST_LOG`, else `level`) and, with `otlp`, the
/// span export as `service` (`service.name`). Must run inside a Tokio runtime when `otlp` is
/// set (the exporter's gRPC client lives there). A process that already installed logging
/// keeps it: the call then changes nothing and exports nothing.
pub fn init(service: &'static str, level: &str, otlp: Option<&str>) -> Result<Telemetry, TelemetryError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let fmt = tracing_subscriber::fmt::layer().with_filter(filter);
    let Some(endpoint) = otlp else {
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        return Ok(Telemetry { provider: None });
    };
    let bad = |why: String| TelemetryError::Exporter { endpoint: endpoint.to_string(), why };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    // Requests' spans are at info: export those whatever RUST_LOG says of the log lines.
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("ferry"))
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    if tracing_subscriber::registry().with(fmt).with(spans).try_init().is_err() {
        let _ = provider.shutdown();
        return Ok(Telemetry { provider: None });
    }
    EXPORTING.store(true, Ordering::Relaxed);
    Ok(Telemetry { provider: Some(provider) })
}

/// Puts `span` in the trace of `caller` (the caller's own span is its parent; None: a new
/// trace) and records its `trace_id` and `span_id` fields. Returns the span's context: the
/// parent to name in the calls made for it. With export on, the ids are the exported span's.
pub fn join(span: &tracing::Span, caller: Option<TraceContext>) -> TraceContext {
    let own = if EXPORTING.load(Ordering::Relaxed) { exported(span, caller) } else { None };
    let own = own.unwrap_or_else(|| caller.map_or_else(TraceContext::random, |c| c.child()));
    span.record("trace_id", tracing::field::display(own.trace_id_hex()));
    span.record("span_id", tracing::field::display(own.span_id_hex()));
    own
}

/// The exported span's context, its parent set to `caller`'s span.
fn exported(span: &tracing::Span, caller: Option<TraceContext>) -> Option<TraceContext> {
    if let Some(c) = caller {
        let flags = if c.sampled { TraceFlags::SAMPLED } else { TraceFlags::NOT_SAMPLED };
        let remote = SpanContext::new(
            TraceId::from_bytes(c.trace_id),
            SpanId::from_bytes(c.span_id),
            flags,
            true,
            TraceState::NONE,
        );
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| TraceContext {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        sampled: sc.is_sampled(),
    })
}
