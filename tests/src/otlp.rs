//! A real OTLP/gRPC trace collector (the OpenTelemetry project's generated server) on a
//! loopback port: it keeps every span it is sent. The `--otlp-endpoint` test reads them; the
//! `otlp-sink` example serves one for `scripts/bench-tracing`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;

/// A span as the collector got it.
#[derive(Debug, Clone)]
pub struct Got {
    /// Trace id, hex.
    pub trace: String,
    /// Span id, hex.
    pub id: String,
    /// Parent span id, hex (empty: a root).
    pub parent: String,
    /// String attributes.
    pub attrs: HashMap<String, String>,
}

/// The spans received so far (`keep: false`: counted only).
#[derive(Default, Clone)]
pub struct Collector {
    spans: Arc<Mutex<Vec<Got>>>,
    count: Arc<std::sync::atomic::AtomicU64>,
    forget: bool,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Collector {
    /// Serves the trace service on `addr` (port 0: any); returns the collector and its address.
    pub async fn serve(addr: &str, keep: bool) -> (Self, SocketAddr) {
        let c = Self { forget: !keep, ..Self::default() };
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind the collector");
        let at = listener.local_addr().expect("addr");
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(c.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (c, at)
    }

    /// The spans kept.
    pub fn spans(&self) -> Vec<Got> {
        self.spans.lock().expect("collector").clone()
    }

    /// Spans received, kept or not.
    pub fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rs in req.into_inner().resource_spans {
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let attrs = s
                        .attributes
                        .iter()
                        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
                            Value::StringValue(v) => Some((kv.key.clone(), v.trim_matches('"').to_string())),
                            _ => None,
                        })
                        .collect();
                    got.push(Got {
                        trace: hex(&s.trace_id),
                        id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        attrs,
                    });
                }
            }
        }
        self.count.fetch_add(got.len() as u64, std::sync::atomic::Ordering::Relaxed);
        if !self.forget {
            self.spans.lock().expect("collector").extend(got);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}
