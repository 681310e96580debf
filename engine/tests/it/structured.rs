//! Structured outputs in the engine: SmolLM2 and the tiny model (random weights, so only the
//! constraint keeps them in line) generate JSON for a schema, text for a regex and one of
//! some choices, greedy and sampled; what they write parses and fits.

use crate::common::{TinyModel, load, pool, smollm2};
use ferry_engine::tiny::TinySpec;
use ferry_engine::{BatchOptions, FinishReason, Model, Request, SamplingParams, generate};
use ferry_kernels::cpu::CpuBackend;
use ferry_tokenize::Constraint;

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "age", "tags", "ok"],
  "additionalProperties": false
}"#;

fn run(model: &Model<CpuBackend>, prompt: &str, c: Constraint, temperature: f32, seed: u64) -> (String, FinishReason) {
    let tok = model.tokenizer();
    let prompt = tok.encode(prompt).expect("encode");
    let params = SamplingParams {
        temperature,
        seed: Some(seed),
        max_new_tokens: 120,
        constraint: Some(c),
        ..Default::default()
    };
    let mut pool = pool(model, 16, 64);
    let out = generate(model, &mut pool, &[Request { prompt, params }], BatchOptions::default()).expect("generate");
    let o = &out[0];
    let eos = tok.eos_ids();
    let text: Vec<u32> = o.tokens.iter().copied().filter(|t| !eos.contains(t)).collect();
    (tok.decode(&text, true).expect("decode"), o.finish)
}

fn check_person(text: &str) {
    let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "name", "ok", "tags"], "{text}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 12), "{text}");
    assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{text}");
    assert!(o["ok"].is_boolean(), "{text}");
    let tags = o["tags"].as_array().unwrap_or_else(|| panic!("tags: {text}"));
    assert!(tags.len() <= 3 && tags.iter().all(|t| t == "red" || t == "green"), "{text}");
}

#[test]
fn generated_json_fits_its_schema_greedy_and_sampled() {
    let smol = load(&smollm2());
    let tiny = TinyModel::new(TinySpec::default());
    let tiny = load(&tiny.gguf());
    for (name, model) in [("smollm2", &smol), ("tiny", &tiny)] {
        for (t, seed) in [(0.0, 0), (1.0, 1), (1.0, 2)] {
            let (text, finish) =
                run(model, "Describe a person as JSON:", Constraint::JsonSchema(SCHEMA.into()), t, seed);
            assert_eq!(finish, FinishReason::Stop, "{name} t={t}: {text}");
            check_person(&text);
        }
    }
    // Any object: unbounded, so only a model that means to stop stops (the tiny one writes
    // keys until max_tokens, and so do some sampled SmolLM2 answers: 10 of 16 seeds stopped
    // within 120 tokens, 11 with the full-sort sampler): every answer that stopped is an
    // object, and some stop.
    let mut stopped = 0;
    for seed in 0..8 {
        let (text, finish) = run(&smol, "Any JSON object:", Constraint::JsonObject, 1.0, seed);
        if finish == FinishReason::Stop {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(v.is_object(), "{text}");
            stopped += 1;
        }
    }
    assert!(stopped >= 2, "{stopped} of 8 sampled JSON objects ended");
}

#[test]
fn regex_and_choice_outputs_match() {
    let smol = load(&smollm2());
    for t in [0.0, 1.0] {
        let (text, finish) =
            run(&smol, "A date:", Constraint::Regex(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]".into()), t, 5);
        assert_eq!(finish, FinishReason::Stop, "{text}");
        let b = text.as_bytes();
        assert!(
            b.len() == 10
                && text.starts_with("20")
                && b[4] == b'-'
                && b[7] == b'-'
                && text.replace('-', "").chars().all(|c| c.is_ascii_digit()),
            "{text:?}"
        );
        let choices = vec!["yes".to_string(), "no".to_string(), "maybe not".to_string()];
        let (text, finish) = run(&smol, "Is the sky green?", Constraint::Choice(choices.clone()), t, 6);
        assert!(choices.contains(&text) && finish == FinishReason::Stop, "{text:?}");
    }
}

#[test]
fn a_bad_constraint_is_an_invalid_request_naming_the_field() {
    let smol = load(&smollm2());
    let g = smol.grammars();
    let cases = [
        (Constraint::JsonSchema("{not json".into()), "response_format.json_schema.schema"),
        (
            Constraint::JsonSchema(r##"{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}"##.into()),
            "response_format.json_schema.schema",
        ),
        (Constraint::Regex("(unclosed".into()), "regex"),
        (Constraint::Regex(r"(?<=a)b".into()), "regex"),
        (Constraint::Choice(vec![]), "choice"),
    ];
    for (c, field) in cases {
        let e = g.matcher(&c).err().unwrap_or_else(|| panic!("{c:?} compiled"));
        let msg = e.to_string();
        assert!(msg.starts_with(field), "{c:?}: {msg}");
    }
    // Compiled once, copied after.
    let c = Constraint::JsonSchema(SCHEMA.into());
    let before = g.stats();
    for _ in 0..3 {
        g.matcher(&c).expect("compiles");
    }
    let after = g.stats();
    assert_eq!((after.compiled - before.compiled, after.hits - before.hits), (1, 2));
}

/// Jump-forward: a schema's fixed text comes out as the tokens the tokenizer itself makes of
/// it (so the model sees what it would have produced), the last one held back where what
/// follows could merge with it; the constraint then continues after them.
#[test]
fn forced_text_is_the_tokenizers_own_tokens() {
    let smol = load(&smollm2());
    let tok = smol.tokenizer();
    let schema = r#"{"type": "object", "properties": {"temperature_in_celsius": {"type": "integer"}, "weather_condition_today": {"enum": ["sunny", "rainy"]}}, "required": ["temperature_in_celsius", "weather_condition_today"], "additionalProperties": false}"#;
    let params = SamplingParams { constraint: Some(Constraint::JsonSchema(schema.into())), ..Default::default() };
    let mut s = ferry_engine::Sampler::new(params.clone(), &[]).guided(smol.guide(&params).expect("compiles"));
    let forced = s.jump(usize::MAX);
    let text = tok.decode(&forced, false).expect("decode");
    assert!(text.starts_with("{\"temperature_in_celsius"), "{text:?}");
    let own = tok.encode_without_bos(&text).expect("encode");
    assert_eq!(forced, own, "{text:?}");
    // An integer must come next: nothing more is forced until one is sampled.
    assert!(s.jump(usize::MAX).is_empty() || text.ends_with(": "), "{text:?}");
    // Sample greedily to the end: what was forced plus what was sampled parses.
    let mut out = forced.clone();
    let vocab = smol.config().vocab_size;
    for _ in 0..40 {
        if s.complete() {
            break;
        }
        let mut logits = vec![0.0f32; vocab];
        let t = s.sample(&mut logits).token;
        out.push(t);
        out.extend(s.jump(usize::MAX));
    }
    let text = tok.decode(&out, true).expect("decode");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(v["weather_condition_today"].is_string(), "{text}");
}

/// A token the constraint forbids, seen without sampling (a prefill node that sampled
/// unconstrained), fails the guide: the decode node then ends the request with an error
/// rather than letting free text through as a finished answer.
#[test]
fn a_forbidden_token_fails_the_guide() {
    let smol = load(&smollm2());
    let tok = smol.tokenizer();
    let params = SamplingParams { constraint: Some(Constraint::Regex("[0-9]+".into())), ..Default::default() };
    let mut s = ferry_engine::Sampler::new(params.clone(), &[]).guided(smol.guide(&params).expect("compiles"));
    assert!(s.guide_error().is_none());
    let letter = tok.encode_without_bos("x").expect("encode")[0];
    s.observe(letter);
    assert!(s.guide_error().is_some() && s.complete(), "{:?}", s.guide_error());
}

/// Migration: a seeded request under a JSON schema, resumed after k of its tokens (they end
/// its prompt, `resumed` = k), generates the rest of the undisturbed answer: the grammar and
/// the random stream stand where the answer left them. Not marked resumed, the same context
/// starts both over and the rest differs.
#[test]
fn a_resumed_constrained_request_finishes_the_undisturbed_answer() {
    let tiny = TinyModel::new(TinySpec::default());
    let model = load(&tiny.gguf());
    let prompt = model.tokenizer().encode("Describe a person as JSON:").expect("encode");
    let params = SamplingParams {
        temperature: 1.0,
        seed: Some(3),
        max_new_tokens: 120,
        constraint: Some(Constraint::JsonSchema(SCHEMA.into())),
        ..Default::default()
    };
    let generated = |prompt: Vec<u32>, params: SamplingParams| {
        let mut pool = pool(&model, 16, 64);
        generate(&model, &mut pool, &[Request { prompt, params }], BatchOptions::default()).expect("generate")[0]
            .tokens
            .clone()
    };
    let whole = generated(prompt.clone(), params.clone());
    assert!(whole.len() > 12, "{} tokens", whole.len());
    let context = |k: usize| prompt.iter().chain(&whole[..k]).copied().collect::<Vec<u32>>();
    for k in [1usize, 5, 12] {
        let left = params.max_new_tokens - k as u32;
        let rest = generated(context(k), SamplingParams { resumed: k as u32, max_new_tokens: left, ..params.clone() });
        assert_eq!(rest, whole[k..], "resumed after {k} tokens");
    }
    let fresh = generated(context(5), SamplingParams { max_new_tokens: params.max_new_tokens - 5, ..params.clone() });
    assert_ne!(fresh, whole[5..], "a fresh request starts the grammar and the random stream over");
}
