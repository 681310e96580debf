//! `/v1/completions` with several prompts, as evaluation harnesses send them (lm-eval's
//! `local-completions` sends lists of token-id lists): each prompt answered as it would be
//! alone, its `n` choices after those of the prompts before it, echo and usage per prompt,
//! whole and streamed; bad batches refused with the prompt named; no page held after.

use ferry_tests::{TinyModel, http, one_of_each, settle};
use serde_json::{Value, json};

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

async fn post(a: std::net::SocketAddr, req: &Value) -> (u16, Value) {
    let (s, _, body) = http(a, "POST", "/v1/completions", req.to_string().as_bytes()).await;
    (s, parse(&body))
}

/// The choices' texts by index and the last chunk's usage, from a streamed answer.
async fn streamed(a: std::net::SocketAddr, req: &Value, choices: usize) -> (Vec<String>, Value) {
    let mut req = req.clone();
    req["stream"] = true.into();
    req["stream_options"] = json!({"include_usage": true});
    let (s, _, body) = http(a, "POST", "/v1/completions", req.to_string().as_bytes()).await;
    assert_eq!(s, 200, "{body}");
    let (mut texts, mut usage, mut ended) = (vec![String::new(); choices], Value::Null, 0);
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let chunk = parse(data);
        for c in chunk["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            texts[i].push_str(c["text"].as_str().expect("text"));
            ended += usize::from(!c["finish_reason"].is_null());
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    assert_eq!(ended, choices, "every choice ends once: {body}");
    (texts, usage)
}

fn texts(v: &Value) -> Vec<String> {
    let choices = v["choices"].as_array().expect("choices");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "choices in index order: {v}");
    }
    choices.iter().map(|c| c["text"].as_str().expect("text").to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_prompts_answers_each_as_it_would_alone() {
    let m = TinyModel::new();
    // At most 8 requests at once: a batch of 9 can never run.
    let (p, d, r) = one_of_each(&m, 512, |a| a.max_running_requests = 8).await;
    let a = r.http_addr;
    let (_, _, models) = http(a, "GET", "/v1/models", b"").await;
    let model = parse(&models)["data"][0]["id"].clone();
    let req = |prompt: Value| json!({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true});

    // Strings: each answered alone first.
    let prompts = ["Once upon a time", "The sky is", "Hello there, my friend"];
    let (mut alone, mut prompt_tokens) = (Vec::new(), 0);
    for t in prompts {
        let (s, v) = post(a, &req(t.into())).await;
        assert_eq!(s, 200, "{v}");
        alone.extend(texts(&v));
        prompt_tokens += v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    }
    let batch = req(json!(prompts));
    let (s, v) = post(a, &batch).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(texts(&v), alone, "each prompt's answer as alone, in the prompts' order");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "every prompt counted: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 4 * prompts.len(), "{v}");
    let (streamed_texts, usage) = streamed(a, &batch, prompts.len()).await;
    assert_eq!(streamed_texts, alone, "streamed: the same answers");
    assert_eq!(usage, v["usage"], "streamed: the same usage");

    // Token-id lists (what lm-eval sends), two choices each, echoed: choices 0 and 1 answer
    // the first prompt, 2 and 3 the second, each starting with its own prompt.
    let ids = [json!([5, 6, 7, 8]), json!([9, 10, 11])];
    let echoed = |prompt: Value| {
        let mut r = req(prompt);
        r["n"] = 2.into();
        r["echo"] = true.into();
        r
    };
    let mut alone = Vec::new();
    for one in &ids {
        let (s, v) = post(a, &echoed(one.clone())).await;
        assert_eq!(s, 200, "{v}");
        alone.extend(texts(&v));
    }
    assert_ne!(alone[0], alone[2], "two prompts, two answers");
    let batch = echoed(json!(ids));
    let (s, v) = post(a, &batch).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(texts(&v), alone);
    assert_eq!(v["usage"]["prompt_tokens"], 4 + 3, "each prompt once, however many its choices: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 4 * 4, "{v}");
    let (streamed_texts, usage) = streamed(a, &batch, 4).await;
    assert_eq!(streamed_texts, alone);
    assert_eq!(usage, v["usage"]);
    // A list of one list is one prompt.
    let (s, v) = post(a, &req(json!([ids[1]]))).await;
    assert_eq!((s, v["choices"].as_array().map(Vec::len)), (200, Some(1)), "{v}");

    // Bad batches: a 400 naming the prompt, and nothing else disturbed.
    let too_many = vec!["a"; ferry_router::openai::MAX_PROMPTS + 1];
    for (prompt, code, names) in [
        (json!([]), "bad_prompt", "`prompt` is an empty list".to_string()),
        (json!([[5, 6], []]), "empty_prompt", "prompt[1]: ".to_string()),
        (json!([[5], [1_000_000]]), "token_out_of_vocabulary", "prompt[1]: token id 1000000".to_string()),
        (json!(too_many), "too_many_prompts", format!("at most {}", ferry_router::openai::MAX_PROMPTS)),
        (json!(vec!["a"; 9]), "too_many_prompts", "runs at most 8 at once".to_string()),
        (json!([["a"]]), "bad_json", "a list of such lists".to_string()),
    ] {
        let (s, v) = post(a, &req(prompt.clone())).await;
        assert_eq!((s, v["error"]["code"].as_str()), (400, Some(code)), "{prompt}: {v}");
        let message = v["error"]["message"].as_str().expect("message");
        assert!(message.contains(&names), "{prompt}: {message}");
    }
    // A fault of the sampling is the whole request's, not its first prompt's.
    let mut cold = req(json!(["a", "b"]));
    cold["temperature"] = (-1.0).into();
    let (s, v) = post(a, &cold).await;
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert_eq!((s, v["error"]["code"].as_str()), (400, Some("bad_sampling")), "{v}");
    assert!(message.contains("temperature") && !message.contains("prompt["), "{message}");
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}
