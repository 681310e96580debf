//! Tokenization of chat prompts as the router does it (issue 17): HF `tokenizers`' `encode`
//! alone, Ferry's tokenizer without the head cache (its byte-level BPE fast path,
//! `tokenize/src/fast_bpe.rs`) and with it (`--tokenizer-cache-mib`), on the same texts in the
//! same order, in one process. (HF's `encode_fast`, which skips offsets, measured no faster
//! than its `encode` here.)
//!
//! The workload: C conversations share one system prompt (~1,400 tokens); each has T turns of
//! a ~150-token user message and a ~150-token answer; requests arrive round-robin across the
//! conversations, turn by turn, each rendered with the model's own chat template. Prints
//! tokens/s for both (rendering not counted), their ratio, per-request p50 / p99 at the last
//! turn, the cost of the cache on prompts it cannot help (unique 16 KB chats, every
//! segment a miss), and completion prompts without special tokens whose first half is shared
//! (reused through the cache's word cuts), also through a full cache (its eviction's tail);
//! then prose with accented words, Russian and Chinese prose (and Chinese completion prompts
//! half shared), English prose under Llama 3's and Qwen2's pre-tokenizers, and never-repeating
//! words.
//! Every cached result is compared with HF's ids. Both run on jemalloc, the allocator of the
//! router's binaries.
//!
//! `cargo bench -p ferry-router --bench tokenize`; needs SmolLM2 (`FERRY_SMOLLM2` or the
//! `ferry model fetch smollm2-135m` cache); `FERRY_BENCH_QUICK=1` runs fewer rounds.

#[path = "common/rng.rs"]
#[allow(dead_code)]
mod rng;
#[path = "common/scripts.rs"]
mod scripts;
#[path = "common/text.rs"]
mod text;

use std::time::Instant;

use ferry_tokenize::{ChatMessage, ServedModel, Tokenizer};
use rng::Rng;
use text::{WORDS, model_path, pct};

/// jemalloc, as the router's binaries run: the word cache's clears and the texts' buffers cost
/// what they cost there (glibc's malloc gives the cache's clear a tail three times as long).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn median(v: &mut [f64]) -> f64 {
    pct(v, 0.5)
}

fn sentence(rng: &mut Rng, words: usize) -> String {
    let mut s = String::new();
    for i in 0..words {
        let w = WORDS[(rng.next() % WORDS.len() as u64) as usize];
        if i > 0 {
            s.push(' ');
        }
        s.push_str(w);
        match rng.next() % 16 {
            0 => s.push(','),
            1 => s.push_str(".\n"),
            _ => {}
        }
    }
    s.push('.');
    s
}

/// The rendered prompts, in arrival order, and which are last turns.
fn workload(tok: &Tokenizer, conversations: usize, turns: usize) -> Vec<(String, bool)> {
    let template = tok.chat_template().expect("chat template");
    let mut rng = Rng(0x5eed);
    let system = sentence(&mut rng, 1_100);
    let mut chats: Vec<Vec<ChatMessage>> =
        (0..conversations).map(|_| vec![ChatMessage::new("system", system.clone())]).collect();
    let mut out = Vec::new();
    for turn in 0..turns {
        for chat in &mut chats {
            chat.push(ChatMessage::new("user", sentence(&mut rng, 110)));
            out.push((template.render(chat, true).expect("render"), turn + 1 == turns));
            chat.push(ChatMessage::new("assistant", sentence(&mut rng, 110)));
        }
    }
    out
}

/// Seconds per request, tokens in all.
fn run(texts: &[(String, bool)], encode: impl Fn(&str) -> Vec<u32>) -> (Vec<f64>, Vec<f64>, usize) {
    let (mut all, mut last, mut tokens) = (Vec::new(), Vec::new(), 0);
    for (t, is_last) in texts {
        let start = Instant::now();
        let ids = encode(t);
        let s = start.elapsed().as_secs_f64();
        tokens += ids.len();
        all.push(s);
        if *is_last {
            last.push(s);
        }
    }
    (all, last, tokens)
}

/// HF's and Ferry's p50 µs on `texts` (no head cache), each text's ids compared.
fn hf_and_fast(tok: &Tokenizer, texts: &[String]) -> (f64, f64) {
    let (mut hf, mut fast) = (Vec::new(), Vec::new());
    for t in texts {
        let s = Instant::now();
        let a = tok.hf().encode(t.as_str(), false).expect("encode").get_ids().to_vec();
        hf.push(s.elapsed().as_secs_f64() * 1e6);
        let s = Instant::now();
        let b = tok.encode(t).expect("encode");
        fast.push(s.elapsed().as_secs_f64() * 1e6);
        assert_eq!(a, b);
    }
    (median(&mut hf), median(&mut fast))
}

/// Medians of encoding each of `texts` without and with a fresh head cache of 64 MiB, the two
/// in turns (which goes first alternates); every result compared with HF's ids.
fn without_and_with_cache(plain: &Tokenizer, texts: &[String]) -> (f64, f64) {
    let cached = plain.clone().with_head_cache(64 << 20);
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for (i, t) in texts.iter().enumerate() {
        let want = plain.hf().encode(t.as_str(), false).expect("encode").get_ids().to_vec();
        for second in [false, true] {
            let s = Instant::now();
            let (ids, into) =
                if (i % 2 == 0) == second { (cached.encode(t), &mut with) } else { (plain.encode(t), &mut without) };
            into.push(s.elapsed().as_secs_f64() * 1e6);
            assert_eq!(ids.expect("encode"), want);
        }
    }
    (median(&mut without), median(&mut with))
}

fn main() {
    let quick = ferry_core::bench::quick();
    let path = model_path();
    assert!(path.exists(), "{} is missing: run `cargo run -p ferry -- model fetch smollm2-135m`", path.display());
    let plain = ServedModel::load(&path).expect("model").tokenizer;
    let (conversations, turns, rounds) = if quick { (8, 4, 1) } else { (32, 8, 5) };
    let texts = workload(&plain, conversations, turns);
    let bytes: usize = texts.iter().map(|(t, _)| t.len()).sum();
    println!(
        "chat workload: {conversations} conversations x {turns} turns, one shared system prompt, {} requests, {:.1} MB of text",
        texts.len(),
        bytes as f64 / 1e6
    );
    let want: Vec<Vec<u32>> = texts.iter().map(|(t, _)| plain.encode_hf(t).expect("encode")).collect();
    let (mut hf_rate, mut cached_rate, mut hf_last, mut cached_last, mut hf_p99, mut cached_p99) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut fast_rate, mut fast_last) = (Vec::new(), Vec::new());
    let mut hit_share = 0.0;
    for _ in 0..rounds {
        let (all, mut last, tokens) = run(&texts, |t| plain.hf().encode(t, false).expect("encode").get_ids().to_vec());
        hf_rate.push(tokens as f64 / all.iter().sum::<f64>());
        hf_last.push(median(&mut last) * 1e6);
        hf_p99.push(pct(&mut last, 0.99) * 1e6);
        let (all, mut last, tokens) = run(&texts, |t| plain.encode(t).expect("encode"));
        fast_rate.push(tokens as f64 / all.iter().sum::<f64>());
        fast_last.push(median(&mut last) * 1e6);
        // A fresh cache each round.
        let cached = plain.clone().with_head_cache(64 << 20);
        let (all, mut last, tokens) = run(&texts, |t| cached.encode(t).expect("encode"));
        cached_rate.push(tokens as f64 / all.iter().sum::<f64>());
        cached_last.push(median(&mut last) * 1e6);
        cached_p99.push(pct(&mut last, 0.99) * 1e6);
        let s = cached.head_cache().expect("SmolLM2 gets a head cache").stats();
        hit_share = s.hit_tokens as f64 / (s.hit_tokens + s.miss_tokens) as f64;
        for (t, w) in texts.iter().zip(&want) {
            assert_eq!(&cached.encode(&t.0).expect("encode"), w, "the head cache changed a prompt's ids");
        }
    }
    let (hf, ca) = (median(&mut hf_rate), median(&mut cached_rate));
    println!("medians of {rounds} rounds:");
    let fast = median(&mut fast_rate);
    println!("  HF tokenizers alone      {:>10.0} tokens/s", hf);
    println!(
        "  Ferry, no head cache     {:>10.0} tokens/s   {:.1}x   last turn p50 {:.0} us",
        fast,
        fast / hf,
        median(&mut fast_last)
    );
    println!(
        "  with the head cache      {:>10.0} tokens/s   {:.1}x   ({:.0} % of ids from the cache)",
        ca,
        ca / hf,
        hit_share * 100.0
    );
    let (hl, cl) = (median(&mut hf_last), median(&mut cached_last));
    println!(
        "  last turn ({} tokens):   HF p50 {:.0} us p99 {:.0} us, cached p50 {:.0} us p99 {:.0} us ({:.1}x at p50)",
        want.last().map_or(0, Vec::len),
        hl,
        median(&mut hf_p99),
        cl,
        median(&mut cached_p99),
        hl / cl
    );
    // What the cache costs where it cannot help: unique chats, every segment new.
    let template = plain.chat_template().expect("template");
    let mut rng = Rng(0xc01d);
    let unique: Vec<String> = (0..if quick { 20 } else { 200 })
        .map(|_| {
            let msgs = [
                ChatMessage::new("system", sentence(&mut rng, 200)),
                ChatMessage::new("user", sentence(&mut rng, 1_900)),
                ChatMessage::new("assistant", sentence(&mut rng, 200)),
                ChatMessage::new("user", sentence(&mut rng, 300)),
            ];
            template.render(&msgs, true).expect("render")
        })
        .collect();
    let avg = unique.iter().map(String::len).sum::<usize>() / unique.len();
    let (mut hf_us, mut cached_us, mut fast_us) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let cached = plain.clone().with_head_cache(64 << 20);
        for (i, t) in unique.iter().enumerate() {
            let s = Instant::now();
            let a = plain.hf().encode(t.as_str(), false).expect("encode").get_ids().to_vec();
            hf_us.push(s.elapsed().as_secs_f64() * 1e6);
            // Which of the two runs first (right after HF's, on colder caches) alternates.
            for second in [false, true] {
                let s = Instant::now();
                if (i % 2 == 0) == second {
                    let b = cached.encode(t).expect("encode");
                    cached_us.push(s.elapsed().as_secs_f64() * 1e6);
                    assert_eq!(a, b);
                } else {
                    let c = plain.encode(t).expect("encode");
                    fast_us.push(s.elapsed().as_secs_f64() * 1e6);
                    assert_eq!(a, c);
                }
            }
        }
    }
    // Words that never repeat (random letters): every word misses both tokenizers' word caches.
    let mut rng = Rng(0xfeed);
    let fresh: Vec<String> = (0..if quick { 20 } else { 200 })
        .map(|_| {
            let mut t = String::new();
            while t.len() < 16 * 1024 {
                let len = 3 + rng.next() % 7;
                t.extend((0..len).map(|_| (b'a' + (rng.next() % 26) as u8) as char));
                t.push_str(if rng.next().is_multiple_of(9) { ". " } else { " " });
            }
            t
        })
        .collect();
    let (hr, fr) = hf_and_fast(&plain, &fresh);
    // Completion prompts (no special tokens): ~18 KB, the first half shared by all. The head
    // cache reuses the shared half through its word cuts (`tokenize/src/head_cache.rs`).
    let mut rng = Rng(0xab1e);
    let head = sentence(&mut rng, 1_600);
    let prompts: Vec<String> =
        (0..if quick { 20 } else { 200 }).map(|i| format!("{head} {i} {}", sentence(&mut rng, 1_600))).collect();
    let (pl, re) = without_and_with_cache(&plain, &prompts);
    let tokens = plain.encode(&prompts[0]).expect("encode").len();
    println!(
        "completion prompts (~{tokens} tokens, half shared, no special tokens): Ferry p50 {pl:.0} us, with the head cache {re:.0} us ({:.2}x)",
        pl / re
    );
    // The same kind of prompts through a full cache (the router's default 64 MiB): each new
    // half makes room by forgetting the least recently used segments. The tail shows what
    // eviction holds the cache's lock for (timed: the second half, the cache full by then).
    let (mib, n) = if quick { (1, 300) } else { (64, 6_000) };
    let full = plain.clone().with_head_cache(mib << 20);
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = format!("{head} {i} {}", sentence(&mut rng, 1_600));
        let s = Instant::now();
        let ids = full.encode(&t).expect("encode");
        lat.push(s.elapsed().as_secs_f64() * 1e6);
        assert!(ids.len() > 1_000);
    }
    let steady = &mut lat[n / 2..];
    let (p50, p99, p999) = (pct(steady, 0.5), pct(steady, 0.99), pct(steady, 0.999));
    println!(
        "  through a full {mib} MiB cache ({} prompts): p50 {p50:.0} us, p99 {p99:.0} us, p99.9 {p999:.0} us, max {:.0} us",
        steady.len(),
        pct(steady, 1.0)
    );
    // A vocabulary that never stops growing: the word cache fills (65,536 words) every ~200
    // texts and starts again. The tail shows what that costs the text that empties it. A
    // tokenizer of its own (an empty word cache), from the header read once for the rows below
    // too; HF's p50 on every 8th text beside it.
    let header = ferry_tokenize::gguf::GgufFile::open(&path).expect("model").header;
    let named = scripts::with_names(&mut Rng(0x4a4e), if quick { 1_200 } else { 4_000 });
    let fresh_tok = Tokenizer::from_gguf(&header, plain.vocab_size()).expect("tokenizer");
    let timed = |encode: &dyn Fn(&str) -> Vec<u32>, t: &str| {
        let s = Instant::now();
        std::hint::black_box(encode(t));
        s.elapsed().as_secs_f64() * 1e6
    };
    let mut lat: Vec<f64> = named.iter().map(|t| timed(&|t| fresh_tok.encode(t).expect("encode"), t)).collect();
    let mut hf: Vec<f64> = named
        .iter()
        .skip(named.len() / 4)
        .step_by(8)
        .map(|t| timed(&|t| fresh_tok.hf().encode(t, false).expect("encode").get_ids().to_vec(), t))
        .collect();
    // Past the first fill, when the cache's tables grow.
    let steady = &mut lat[named.len() / 4..];
    println!(
        "16 KB chats, one word in eight a never-seen name ({} texts, the word cache emptied every ~200): HF p50 {:.0} us; Ferry p50 {:.0} us, p99 {:.0} us, p99.9 {:.0} us, max {:.0} us",
        steady.len(),
        median(&mut hf),
        pct(steady, 0.5),
        pct(steady, 0.99),
        pct(steady, 0.999),
        pct(steady, 1.0)
    );
    // Prose in other languages: 30 % of the words French, German, Spanish, Polish or Czech
    // (Latin-1 and Latin Extended-A letters), the rest English; Russian; Chinese.
    let n = if quick { 20 } else { 200 };
    let accented = scripts::accented(&mut Rng(0xacce), n);
    let (ha, fa) = hf_and_fast(&plain, &accented);
    println!("16 KB of prose, 30 % of its words accented: HF p50 {ha:.0} us, Ferry p50 {fa:.0} us ({:.1}x)", ha / fa);
    let (hru, fru) = hf_and_fast(&plain, &scripts::russian(&mut Rng(0x5a5a), n));
    println!("16 KB of Russian prose: HF p50 {hru:.0} us, Ferry p50 {fru:.0} us ({:.1}x)", hru / fru);
    let (hzh, fzh) = hf_and_fast(&plain, &scripts::chinese(&mut Rng(0xc4c4), n));
    println!("16 KB of Chinese prose: HF p50 {hzh:.0} us, Ferry p50 {fzh:.0} us ({:.1}x)", hzh / fzh);
    let emoji = scripts::emoji(&mut Rng(0xe0e0), n);
    let (hem, fem) = hf_and_fast(&plain, &emoji);
    println!(
        "16 KB of English chat, an emoji every 8 words: HF p50 {hem:.0} us, Ferry p50 {fem:.0} us ({:.1}x)",
        hem / fem
    );
    // Chinese completion prompts: 16 KB shared, 16 KB new. Without spaces, only the head
    // cache's cuts after full-width punctuation find the shared half.
    let mut zh = scripts::chinese(&mut Rng(0xc4c5), n + 1);
    let head = zh.pop().expect("a head");
    let zh: Vec<String> = zh.iter().map(|tail| format!("{head}{tail}")).collect();
    let (zp, zc) = without_and_with_cache(&plain, &zh);
    println!(
        "  Chinese completion prompts (32 KB, half shared): Ferry p50 {zp:.0} us, with the head cache {zc:.0} us ({:.2}x)",
        zp / zc
    );
    // The same English prose under the pre-tokenizers of Llama 3 and Qwen2 (SmolLM2's
    // vocabulary, their patterns): the fast path cuts those with the regex, not by hand.
    let prose: Vec<String> = (0..n).map(|i| sentence(&mut Rng(0x11a3 + i as u64), 3_000)).collect();
    let (hs, fs) = hf_and_fast(&plain, &prose);
    println!("16 KB of English prose: HF p50 {hs:.0} us, Ferry p50 {fs:.0} us ({:.1}x)", hs / fs);
    for pre in ["llama-bpe", "qwen2"] {
        let mut h = header.clone();
        h.metadata.insert("tokenizer.ggml.pre".into(), ferry_tokenize::gguf::Value::Str(pre.into()));
        let tok = Tokenizer::from_gguf(&h, plain.vocab_size()).expect("tokenizer");
        assert!(tok.is_fast(), "{pre}: {:?}", tok.why_not_fast());
        let (hp, fp) = hf_and_fast(&tok, &prose);
        println!("  the same under {pre}'s pre-tokenizer: HF p50 {hp:.0} us, Ferry p50 {fp:.0} us ({:.1}x)", hp / fp);
        let (he, fe) = hf_and_fast(&tok, &emoji);
        println!("    and the chat with emoji: HF p50 {he:.0} us, Ferry p50 {fe:.0} us ({:.1}x)", he / fe);
        let (pl, re) = without_and_with_cache(&tok, &prompts);
        println!(
            "    and the completion prompts: Ferry p50 {pl:.0} us, with the head cache {re:.0} us ({:.2}x)",
            pl / re
        );
    }
    println!("16 KB of never-repeating random words: HF p50 {hr:.0} us, Ferry p50 {fr:.0} us ({:.1}x)", hr / fr);
    let (h, c, f) = (median(&mut hf_us), median(&mut cached_us), median(&mut fast_us));
    println!(
        "unique {avg}-byte chats (all misses): HF p50 {h:.0} us; Ferry p50 {f:.0} us ({:.1}x), with the head cache {c:.0} us ({:+.1} % on Ferry's)",
        h / f,
        (c / f - 1.0) * 100.0
    );
}
