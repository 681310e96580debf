//! The router's OpenAI-compatible HTTP API against real workers: completions and chat
//! completions, streamed and not, models and health; bad input gets a 4xx with a message,
//! is counted, and disturbs nothing.

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, colocated_scored, greedy, http, one_of_each, settle};

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_endpoints_work_and_refuse_bad_input() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 512, |_| ()).await;
    let a = r.http_addr;
    let (s, _, body) = http(a, "GET", "/v1/models", b"").await;
    assert_eq!(s, 200);
    let model = json(&body)["data"][0]["id"].as_str().expect("a model id").to_string();
    assert_eq!(http(a, "GET", "/health", b"").await.0, 200);

    // A completion, whole.
    let req = serde_json::json!({"model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (s, _, body) = http(a, "POST", "/v1/completions", req.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 6);
    let whole = v["choices"][0]["text"].as_str().expect("text").to_string();

    // The same, streamed over SSE: the pieces add up to the same text, usage on the last.
    let mut sreq = req.clone();
    sreq["stream"] = true.into();
    sreq["stream_options"] = serde_json::json!({"include_usage": true});
    let (s, h, body) = http(a, "POST", "/v1/completions", sreq.to_string().as_bytes()).await;
    assert_eq!(s, 200);
    assert!(h.iter().any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream")));
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1].iter().map(|e| json(e)).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, whole);
    assert_eq!(chunks.last().map(|c| c["usage"]["completion_tokens"].clone()), Some(6.into()));

    // Chat, whole and streamed.
    let chat = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0});
    let (s, _, body) = http(a, "POST", "/v1/chat/completions", chat.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let mut schat = chat.clone();
    schat["stream"] = true.into();
    let (s, _, body) = http(a, "POST", "/v1/chat/completions", schat.to_string().as_bytes()).await;
    assert_eq!(s, 200);
    let first = body.lines().find_map(|l| l.strip_prefix("data: ")).map(json).expect("a chunk");
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");

    // What real clients send: content as a list of parts (the same answer as the string),
    // fields Ferry does not read (ignored, counted), fields that ask for nothing, and
    // GET /v1/models/{id}.
    let whole_chat = v["choices"][0]["message"]["content"].clone();
    let mut parts = chat.clone();
    parts["messages"][0]["content"] = serde_json::json!([{"type": "text", "text": "Hello there"}]);
    parts["metadata"] = serde_json::json!({"trace": "x"});
    parts["store"] = false.into();
    parts["frobnicate"] = 1.into();
    parts["logprobs"] = false.into();
    parts["tools"] = serde_json::json!([]);
    parts["messages"][0]["name"] = "alice".into();
    let (s, _, body) = http(a, "POST", "/v1/chat/completions", parts.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(json(&body)["choices"][0]["message"]["content"], whole_chat, "parts read as the string");
    let (s, _, body) = http(a, "GET", &format!("/v1/models/{model}"), b"").await;
    assert_eq!((s, json(&body)["id"].as_str()), (200, Some(model.as_str())), "{body}");
    let (s, _, body) = http(a, "GET", "/v1/models/gpt-9", b"").await;
    assert_eq!((s, json(&body)["error"]["code"].as_str()), (404, Some("model_not_found")), "{body}");

    // Bad input: each a 4xx with a message.
    let chat_with = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut c = chat.clone();
        f(&mut c);
        c.to_string().into_bytes()
    };
    let named: Vec<(Vec<u8>, &str, &str)> = vec![
        (
            chat_with(&|c| {
                c["messages"][0]["content"] = serde_json::json!([
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                ])
            }),
            "bad_messages",
            "messages[0].content[1]",
        ),
        (chat_with(&|c| c["messages"] = serde_json::json!([])), "bad_messages", "`messages` is empty"),
        (chat_with(&|c| c["messages"] = serde_json::json!([{"content": "hi"}])), "bad_messages", "messages[0].role"),
        (chat_with(&|c| c["echo"] = true.into()), "unsupported", "`echo`"),
        (chat_with(&|c| c["logprobs"] = "yes".into()), "bad_logprobs", "`logprobs`"),
        (chat_with(&|c| c["top_logprobs"] = 3.into()), "bad_logprobs", "`top_logprobs` needs `logprobs: true`"),
        (
            chat_with(&|c| {
                c["logprobs"] = true.into();
                c["top_logprobs"] = 21.into();
            }),
            "bad_sampling",
            "top_logprobs",
        ),
        (
            chat_with(&|c| c["response_format"] = serde_json::json!({"type": "xml"})),
            "bad_response_format",
            "`response_format.type`",
        ),
        (
            chat_with(
                &|c| c["response_format"] = serde_json::json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "no such type"}}}}}),
            ),
            "invalid_constraint",
            "response_format.json_schema.schema",
        ),
        (chat_with(&|c| c["guided_regex"] = "a{2,1}".into()), "invalid_constraint", "regex"),
        // A field of the wrong type or range is named, not only placed by line and column.
        (chat_with(&|c| c["max_tokens"] = (-3).into()), "bad_json", "max_tokens: invalid value: integer `-3`"),
        (chat_with(&|c| c["temperature"] = "hot".into()), "bad_json", "temperature: invalid type"),
        (chat_with(&|c| c["stop"] = 5.into()), "bad_json", "stop: a string or a list of strings"),
    ];
    for (body, code, names) in named {
        let (s, _, text) = http(a, "POST", "/v1/chat/completions", &body).await;
        assert_eq!(s, 400, "{code}: {text}");
        let v = json(&text);
        assert_eq!(v["error"]["code"], code, "{text}");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains(names), "names {names}: {text}");
    }
    // Completions name their own field, not the sampler's.
    let (s, _, text) = http(
        a,
        "POST",
        "/v1/completions",
        serde_json::json!({"model": model, "prompt": "x", "logprobs": 30}).to_string().as_bytes(),
    )
    .await;
    assert_eq!((s, json(&text)["error"]["code"].as_str()), (400, Some("bad_logprobs")), "{text}");
    assert!(text.contains("`logprobs` must be at most 20"), "{text}");
    let long: Vec<u32> = vec![5; 2048];
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("/v1/completions", b"{not json".to_vec(), 400, "bad_json"),
        (
            "/v1/completions",
            serde_json::json!({"model": "gpt-9", "prompt": "x"}).to_string().into_bytes(),
            404,
            "model_not_found",
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": model, "prompt": "x", "temperature": -1}).to_string().into_bytes(),
            400,
            "bad_sampling",
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": model, "prompt": long}).to_string().into_bytes(),
            400,
            "prompt_too_long",
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": model, "prompt": ""}).to_string().into_bytes(),
            400,
            "empty_prompt",
        ),
        ("/v1/completions", vec![b'{', 0xff, 0xfe, b'}'], 400, "invalid_utf8"),
        ("/v1/completions", vec![b' '; ferry_router::openai::MAX_BODY + 1], 413, "body_too_large"),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": model, "prompt": "x"}).to_string().into_bytes(),
            400,
            "bad_messages",
        ),
    ];
    for (path, body, status, code) in cases {
        let (s, _, text) = http(a, "POST", path, &body).await;
        assert_eq!(s, status, "{code}: {text}");
        let v = json(&text);
        assert_eq!(v["error"]["code"], code, "{text}");
        assert!(!v["error"]["message"].as_str().unwrap_or("").is_empty());
    }
    let (_, _, metrics) = http(a, "GET", "/metrics", b"").await;
    for m in [
        "ferry_router_placements_total{target=\"prefill\"",
        "ferry_router_requests_total{outcome=\"length\"}",
        "ferry_router_ttft_seconds_count",
        "ferry_router_prompt_tokens_total{kind=\"prompt\"}",
        "ferry_router_workers{role=\"decode\",state=\"healthy\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l.starts_with(m)), "{m} missing from the router's /metrics");
    }
    // The second chat request (the same messages as parts) found its head in the tokenizer's
    // cache.
    let hits = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ferry_router_tokenizer_cache_tokens_total{kind=\"hit\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(hits.is_some_and(|h| h > 0.0), "head cache hits: {hits:?}");
    for field in ["metadata", "other"] {
        assert!(
            metrics.lines().any(|l| l.starts_with(&format!("ferry_openai_ignored_fields_total{{field=\"{field}\"}}"))),
            "ignored {field} not counted"
        );
    }
    for code in [
        "bad_json",
        "model_not_found",
        "bad_sampling",
        "prompt_too_long",
        "empty_prompt",
        "invalid_utf8",
        "body_too_large",
        "bad_messages",
        "unsupported",
    ] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("ferry_bad_requests_total") && l.contains(&format!("reason=\"{code}\""))),
            "{code}"
        );
    }
    // Nothing was disturbed.
    let (s, _, body) = http(a, "POST", "/v1/completions", req.to_string().as_bytes()).await;
    assert_eq!(s, 200);
    assert_eq!(json(&body)["choices"][0]["text"].as_str(), Some(whole.as_str()));
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

/// Logprobs in OpenAI's shapes through a prefill and a decode worker: the chosen tokens and
/// logprobs equal the colocated engine's, the first token's alternatives (sampled on the
/// prefill node, which sends the token alone on the data plane) are there like every other
/// token's, streamed equals whole, and each token's bytes spell the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_match_the_engine_through_prefill_and_decode() {
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 512, |_| ()).await;
    let a = r.http_addr;
    let (_, _, body) = http(a, "GET", "/v1/models", b"").await;
    let model = json(&body)["data"][0]["id"].as_str().expect("a model id").to_string();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
    let want = &colocated_scored(&m.path(), std::slice::from_ref(&prompt), &greedy(6))[0];

    // Completions: `logprobs: 2`, whole and streamed.
    let req = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": 2});
    let (s, _, body) = http(a, "POST", "/v1/completions", req.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    let lp = json(&body)["choices"][0]["logprobs"].clone();
    let lps: Vec<f64> =
        lp["token_logprobs"].as_array().expect("token_logprobs").iter().filter_map(|x| x.as_f64()).collect();
    assert_eq!(lps.len(), 6, "{lp}");
    for (i, (&got, &(_, w))) in lps.iter().zip(want).enumerate() {
        assert!((got - f64::from(w)).abs() < 1e-3, "token {i}: logprob {got}, colocated {w}");
    }
    for (i, top) in lp["top_logprobs"].as_array().expect("top_logprobs").iter().enumerate() {
        let top = top.as_object().expect("a map");
        // Greedy: the chosen token is the best alternative, so the map holds 2.
        assert_eq!(top.len(), 2, "token {i}: {top:?}");
        let chosen = lp["tokens"][i].as_str().expect("token");
        assert!((top[chosen].as_f64().unwrap_or(0.0) - lps[i]).abs() < 1e-6, "token {i}: {top:?}");
    }
    let offsets: Vec<u64> = lp["text_offset"].as_array().expect("offsets").iter().filter_map(|x| x.as_u64()).collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0, "{offsets:?}");
    let mut sreq = req.clone();
    sreq["stream"] = true.into();
    let (_, _, body) = http(a, "POST", "/v1/completions", sreq.to_string().as_bytes()).await;
    let chunks: Vec<serde_json::Value> =
        body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|e| *e != "[DONE]").map(json).collect();
    let streamed: Vec<f64> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap_or_default())
        .filter_map(|x| x.as_f64())
        .collect();
    assert_eq!(streamed.len(), lps.len());
    assert!(streamed.iter().zip(&lps).all(|(x, y)| (x - y).abs() < 1e-3), "streamed {streamed:?}, whole {lps:?}");

    // Chat: `logprobs: true, top_logprobs: 3`.
    let chat = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let (s, _, body) = http(a, "POST", "/v1/chat/completions", chat.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    let v = json(&body);
    let content = v["choices"][0]["logprobs"]["content"].as_array().expect("content").clone();
    assert_eq!(content.len(), 5, "{v}");
    let mut bytes = Vec::new();
    for (i, e) in content.iter().enumerate() {
        let top = e["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 3, "token {i} (the first is sampled on the prefill node): {e}");
        assert_eq!((top[0]["token"].clone(), top[0]["logprob"].clone()), (e["token"].clone(), e["logprob"].clone()));
        bytes.extend(e["bytes"].as_array().expect("bytes").iter().filter_map(|b| b.as_u64()).map(|b| b as u8));
    }
    let text = v["choices"][0]["message"]["content"].as_str().expect("text");
    assert_eq!(String::from_utf8_lossy(&bytes), text, "the tokens' bytes spell the text");
    let mut schat = chat.clone();
    schat["stream"] = true.into();
    let (_, _, body) = http(a, "POST", "/v1/chat/completions", schat.to_string().as_bytes()).await;
    let streamed: Vec<serde_json::Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .flat_map(|e| json(e)["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default())
        .collect();
    // The same tokens and alternatives; logprobs within float noise (the second request
    // finds its prompt in the prefix cache and computes it in other chunks).
    let close = |x: &serde_json::Value, y: &serde_json::Value| {
        x["token"] == y["token"]
            && (x["logprob"].as_f64().unwrap_or(0.0) - y["logprob"].as_f64().unwrap_or(9.0)).abs() < 1e-3
    };
    assert_eq!(streamed.len(), content.len());
    for (x, y) in streamed.iter().zip(&content) {
        let (tx, ty) = (x["top_logprobs"].as_array().expect("top"), y["top_logprobs"].as_array().expect("top"));
        assert!(close(x, y) && tx.len() == ty.len() && tx.iter().zip(ty).all(|(a, b)| close(a, b)), "{x} vs {y}");
    }
    // Not asked for: null.
    let mut plain = chat.clone();
    plain.as_object_mut().map(|o| (o.remove("logprobs"), o.remove("top_logprobs")));
    let (_, _, body) = http(a, "POST", "/v1/chat/completions", plain.to_string().as_bytes()).await;
    assert!(json(&body)["choices"][0]["logprobs"].is_null(), "{body}");

    // The router's gRPC API: each token's alternatives, the first one's too.
    let mut client = pb::router_client::RouterClient::new(ferry_tests::channel(r.grpc_addr).await);
    let mut sampling = greedy(4);
    sampling.top_logprobs = 2;
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt.clone() })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&sampling)),
        return_token_ids: true,
        ..Default::default()
    };
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let mut got = Vec::new();
    while let Some(m) = stream.message().await.expect("a message") {
        if m.token_ids.is_empty() {
            continue;
        }
        assert_eq!(m.top_logprobs.len(), m.token_ids.len(), "{m:?}");
        for (t, top) in m.token_ids.iter().zip(&m.top_logprobs) {
            assert_eq!(top.candidates.len(), 2, "{m:?}");
            assert_eq!(top.candidates[0].token_id, *t, "greedy: the best alternative is the token");
        }
        got.extend(m.token_ids.iter().zip(&m.logprobs).map(|(&t, l)| (t, l.logprob)));
    }
    assert_eq!(got.len(), 4);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.0 == w.0 && (g.1 - w.1).abs() < 1e-3, "token {i}: {g:?}, colocated {w:?}");
    }
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_the_public_endpoints() {
    let m = TinyModel::new();
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 256;
    let d = ferry_decode::start(a).await.expect("decode up");
    let mut args = ferry_router::RouterArgs::new(m.path(), Vec::new(), vec![d.grpc_addr.to_string()]);
    args.api_keys = vec!["k-one".into(), "k-two".into()];
    let r = ferry_router::start(args).await.expect("router up");
    let (s, _, body) = http(r.http_addr, "GET", "/v1/models", b"").await;
    assert_eq!(s, 401, "{body}");
    assert_eq!(json(&body)["error"]["code"], "invalid_api_key");
    let wrong = [("Authorization", "Bearer k-wrong")];
    assert_eq!(ferry_tests::http_with(r.http_addr, "GET", "/v1/models", &wrong, b"").await.0, 401);
    let right = [("Authorization", "Bearer k-two")];
    assert_eq!(ferry_tests::http_with(r.http_addr, "GET", "/v1/models", &right, b"").await.0, 200);
    assert_ne!(http(r.http_addr, "GET", "/health", b"").await.0, 401, "health needs no key");
    let mut c = ferry_proto::v1::router_client::RouterClient::new(ferry_tests::channel(r.grpc_addr).await);
    let e = c.list_workers(ferry_proto::v1::ListWorkersRequest {}).await.expect_err("no key");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(ferry_proto::v1::ListWorkersRequest {});
    req.metadata_mut().insert("authorization", "Bearer k-one".parse().expect("ascii"));
    assert_eq!(c.list_workers(req).await.expect("with a key").into_inner().workers.len(), 1);
    r.stop().await;
    d.stop().await;
}
