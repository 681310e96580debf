//! The router's OpenAI request parsing (`openai::parse`): any body to either endpoint gives a
//! checked request or a 4xx, never a panic. The first input byte picks the endpoint.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_router::admission::{Admission, Limits};
use ferry_router::generate::Ctx;
use ferry_router::index::SharedIndex;
use ferry_router::openai::{Kind, parse};
use ferry_router::placement::Placer;
use ferry_router::workers::Registry;
use libfuzzer_sys::fuzz_target;
use parking_lot::Mutex;

fn ctx() -> &'static Ctx {
    static CTX: OnceLock<(tempfile::TempDir, Ctx)> = OnceLock::new();
    &CTX.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        // Served as "hf", the name the seed inputs use.
        let path = dir.path().join("hf");
        ferry_engine::tiny::write_hf(&path, &ferry_engine::tiny::TinySpec::default()).expect("tiny model");
        let model = ferry_tokenize::ServedModel::load(&path).expect("served model");
        let index = Arc::new(SharedIndex::new(16, 1024));
        let ctx = Ctx {
            grammars: Arc::new(ferry_engine::Grammars::new(model.tokenizer.clone())),
            model,
            workers: Arc::new(Registry::new(Arc::clone(&index))),
            index,
            placer: Mutex::new(Placer::new("cache-aware".parse().expect("policy"), 1000.0, 0.0, 2.5e9)),
            local_prefill_below: 0,
            local_prefill_max: 0,
            page_size: 16,
            api_keys: Vec::new(),
            migration_limit: 0,
            limits: ferry_router::limits::Limits::default(),
            admission: Admission::new(Limits { max_running: 0, max_queued: 0, timeout: Duration::ZERO }),
        };
        (dir, ctx)
    })
    .1
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else { return };
    let kind = if first & 1 == 0 { Kind::Completion } else { Kind::Chat };
    let c = ctx();
    match parse(c, body, kind) {
        Ok((ps, shape)) => {
            assert!((1..=ferry_router::openai::MAX_PROMPTS).contains(&ps.len()), "{} prompts", ps.len());
            assert!(shape.echo.is_empty() || shape.echo.len() == ps.len(), "an echo per prompt");
            for p in ps {
                assert!(!p.tokens.is_empty() && p.tokens.len() < c.model.context_length);
                assert!(p.tokens.iter().all(|&t| (t as usize) < c.model.vocab_size));
            }
        }
        Err(r) => assert!(r.status().is_client_error(), "{}", r.status()),
    }
});
