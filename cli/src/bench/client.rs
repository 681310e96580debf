//! Sending one request and timing it: over the OpenAI HTTP API (streamed, SSE) or the gRPC
//! `Router.Generate` stream.
//!
//! A token "arrives" with each streamed message that carries output: over gRPC, each message's
//! token ids; over SSE, each chunk before the last (the router sends one chunk per decode
//! step, and the last one carries only the finish reason, the held-back text and the usage).

use std::time::Instant;

use ferry_proto::v1 as pb;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use super::workload::{Item, Prompt};

/// How one request went. Times are seconds since the run started.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Sample {
    /// When it was sent.
    pub start: f64,
    /// When each output token arrived.
    pub token_times: Vec<f64>,
    /// When it ended.
    pub end: f64,
    /// Prompt tokens (from the usage).
    pub prompt_tokens: u32,
    /// Generated tokens (from the usage).
    pub completion_tokens: u32,
    /// Prompt tokens found in a prefill cache (from the usage).
    pub cached_tokens: u32,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Where its time went, as the router reported it (`ferry-phases`): each phase of its
    /// critical path and seconds, in order.
    pub phases: Vec<(String, f64)>,
    /// Its `multi-turn` conversation (other workloads: 0).
    pub conversation: u32,
    /// Its turn in a `multi-turn` conversation (0: the first; other workloads: 0).
    pub turn: u32,
    /// The answer's text (what `multi-turn` puts in the conversation's next turn).
    #[serde(skip)]
    pub text: String,
}

/// Where requests go.
#[derive(Clone)]
pub enum Target {
    /// The OpenAI HTTP API at `host:port`.
    Http {
        /// `host:port`.
        authority: String,
        /// The served model's name.
        model: String,
        /// `Authorization: Bearer` key.
        api_key: Option<String>,
    },
    /// The gRPC Router service.
    Grpc {
        /// A connected client.
        client: pb::router_client::RouterClient<tonic::transport::Channel>,
        /// `authorization` metadata key.
        api_key: Option<String>,
    },
}

/// Sampling for every request.
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    /// 0: greedy.
    pub temperature: f32,
    /// Generate exactly `max_tokens` (ignore end-of-sequence).
    pub ignore_eos: bool,
}

impl Target {
    /// Sends `item`, timing it against `clock`.
    pub async fn send(&self, item: &Item, sampling: Sampling, clock: Instant) -> Sample {
        let mut s = Sample { start: clock.elapsed().as_secs_f64(), ..Sample::default() };
        let r = match self {
            Self::Http { authority, model, api_key } => {
                http(authority, model, api_key.as_deref(), item, sampling, clock, &mut s).await
            }
            Self::Grpc { client, api_key } => {
                grpc(client.clone(), api_key.as_deref(), item, sampling, clock, &mut s).await
            }
        };
        if let Err(e) = r {
            s.error = Some(e);
        } else if s.completion_tokens == 0 && s.token_times.is_empty() {
            s.error = Some("no output and no usage".into());
        }
        s.end = clock.elapsed().as_secs_f64();
        s
    }
}

/// The served model's name, from `GET /v1/models`.
pub async fn first_model(authority: &str, api_key: Option<&str>) -> Result<String, String> {
    let (status, body) = call(authority, "GET", "/v1/models", api_key, String::new()).await?;
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    if status != 200 {
        return Err(format!("GET /v1/models: HTTP {status}: {}", String::from_utf8_lossy(&body)));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| format!("GET /v1/models: {e}"))?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| "GET /v1/models lists no model".into())
}

async fn call(
    authority: &str,
    method: &str,
    path: &str,
    api_key: Option<&str>,
    body: String,
) -> Result<(u16, hyper::body::Incoming), String> {
    let tcp = tokio::net::TcpStream::connect(authority).await.map_err(|e| format!("connect {authority}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", authority)
        .header("content-type", "application/json")
        .header("ferry-phases", "1");
    if let Some(k) = api_key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = req.body(http_body_util::Full::new(hyper::body::Bytes::from(body))).map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    Ok((resp.status().as_u16(), resp.into_body()))
}

async fn http(
    authority: &str,
    model: &str,
    api_key: Option<&str>,
    item: &Item,
    sampling: Sampling,
    clock: Instant,
    s: &mut Sample,
) -> Result<(), String> {
    let mut body = json!({
        "model": model, "max_tokens": item.max_tokens, "temperature": sampling.temperature,
        "ignore_eos": sampling.ignore_eos, "stream": true,
    });
    let path = match &item.prompt {
        Prompt::Chat(m) => {
            body["messages"] = m.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
            "/v1/chat/completions"
        }
        Prompt::Text(t) => {
            body["prompt"] = json!(t);
            "/v1/completions"
        }
        Prompt::Ids(ids) => {
            body["prompt"] = json!(ids);
            "/v1/completions"
        }
    };
    let (status, mut incoming) = call(authority, "POST", path, api_key, body.to_string()).await?;
    if status != 200 {
        let b = incoming.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        return Err(format!("HTTP {status}: {}", v["error"]["message"].as_str().unwrap_or("(no message)")));
    }
    let mut buf = Vec::new();
    while let Some(frame) = incoming.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        let Ok(data) = frame.into_data() else { continue };
        buf.extend_from_slice(&data);
        while let Some(at) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..at + 2).collect();
            let now = clock.elapsed().as_secs_f64();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    return Ok(());
                }
                let v: Value = serde_json::from_str(data).map_err(|e| format!("a bad event: {e}"))?;
                if let Some(m) = v["error"]["message"].as_str() {
                    return Err(m.to_string());
                }
                if let Some(p) = v["ferry_phases"].as_object() {
                    s.phases = p.iter().map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(0.0))).collect();
                }
                let choice = &v["choices"][0];
                if let Some(t) = choice["delta"]["content"].as_str().or_else(|| choice["text"].as_str()) {
                    s.text.push_str(t);
                }
                match v.get("usage") {
                    Some(u) => {
                        s.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as u32;
                        s.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as u32;
                        s.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as u32;
                    }
                    None => s.token_times.push(now),
                }
            }
        }
    }
    Err("the stream ended without [DONE]".into())
}

async fn grpc(
    mut client: pb::router_client::RouterClient<tonic::transport::Channel>,
    api_key: Option<&str>,
    item: &Item,
    sampling: Sampling,
    clock: Instant,
    s: &mut Sample,
) -> Result<(), String> {
    use pb::generate_request::Prompt as P;
    let prompt = match &item.prompt {
        Prompt::Chat(m) => P::Chat(pb::ChatMessages {
            messages: m.iter().map(|(r, c)| pb::ChatMessage { role: r.clone(), content: c.clone() }).collect(),
        }),
        Prompt::Text(t) => P::Text(t.clone()),
        Prompt::Ids(ids) => P::TokenIds(pb::TokenIds { ids: ids.clone() }),
    };
    let req = pb::GenerateRequest {
        prompt: Some(prompt),
        sampling: Some(pb::SamplingParams {
            temperature: sampling.temperature,
            top_p: 1.0,
            repetition_penalty: 1.0,
            max_new_tokens: item.max_tokens,
            ignore_eos: sampling.ignore_eos,
            ..Default::default()
        }),
        return_token_ids: true,
        return_phases: true,
        ..Default::default()
    };
    let mut req = tonic::Request::new(req);
    if let Some(k) = api_key
        && let Ok(v) = format!("Bearer {k}").parse()
    {
        req.metadata_mut().insert("authorization", v);
    }
    let mut stream =
        client.generate(req).await.map_err(|st| format!("{:?}: {}", st.code(), st.message()))?.into_inner();
    while let Some(m) = stream.message().await.map_err(|st| format!("{:?}: {}", st.code(), st.message()))? {
        let now = clock.elapsed().as_secs_f64();
        s.token_times.extend(std::iter::repeat_n(now, m.token_ids.len()));
        s.text.push_str(&m.text);
        if m.finish_reason != 0 || m.completion_tokens > 0 {
            s.prompt_tokens = m.prompt_tokens;
            s.completion_tokens = m.completion_tokens;
            s.cached_tokens = m.cached_tokens;
            s.phases = ferry_cluster::wire::phases_from_proto(&m.phases);
        }
    }
    Ok(())
}
