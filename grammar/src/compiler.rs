//! Compiling constraints, once each: a bounded cache of compiled parsers by constraint.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use ferry_tokenize::{Constraint, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use parking_lot::Mutex;

use crate::{GrammarError, field};

/// Compiled constraints kept by default.
const DEFAULT_CAPACITY: usize = 1024;

/// The longest constraint text accepted (a schema, a regex, the choices together): beyond
/// what any real schema needs, and it bounds what the cache and the compiler are given.
pub const MAX_CONSTRAINT_BYTES: usize = 256 << 10;

/// A constraint's cache key: SHA-256 of its kind and text (a key an attacker cannot make
/// collide; the texts themselves are not kept).
type Key = [u8; 32];

fn key(c: &Constraint) -> Key {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(c.kind().as_bytes());
    match c {
        Constraint::JsonObject => {}
        Constraint::JsonSchema(t) | Constraint::Regex(t) => h.update(t.as_bytes()),
        Constraint::Choice(options) => {
            for o in options {
                h.update((o.len() as u64).to_le_bytes());
                h.update(o.as_bytes());
            }
        }
    }
    h.finalize().into()
}

/// The bytes of a constraint's text.
fn size(c: &Constraint) -> usize {
    match c {
        Constraint::JsonObject => 0,
        Constraint::JsonSchema(t) | Constraint::Regex(t) => t.len(),
        Constraint::Choice(options) => options.iter().map(String::len).sum(),
    }
}

/// What a [`Grammars`] did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GrammarsStats {
    /// Constraints compiled (cache misses that compiled).
    pub compiled: u64,
    /// Requests served a copy of an already compiled constraint.
    pub hits: u64,
    /// Constraints held now.
    pub held: usize,
}

/// One model's constraint compiler and cache (see the crate docs). Cheap to share behind an
/// `Arc`; the token table is built on first use (a few hundred milliseconds for a 50 k
/// vocabulary), not at start.
pub struct Grammars {
    tok: Tokenizer,
    factory: OnceLock<Result<ParserFactory, GrammarError>>,
    cache: Mutex<HashMap<Key, (Arc<Matcher>, u64)>>,
    capacity: usize,
    clock: AtomicU64,
    compiled: AtomicU64,
    hits: AtomicU64,
}

impl Grammars {
    /// A compiler for `tok`'s model.
    pub fn new(tok: Tokenizer) -> Self {
        Self::with_capacity(tok, DEFAULT_CAPACITY)
    }

    /// The same, keeping at most `capacity` compiled constraints (least recently used go).
    pub fn with_capacity(tok: Tokenizer, capacity: usize) -> Self {
        Self {
            tok,
            factory: OnceLock::new(),
            cache: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
            clock: AtomicU64::new(0),
            compiled: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// Builds the token table now (a few hundred milliseconds of one core) rather than in the
    /// first constrained request: daemons call it on a background thread at start.
    pub fn prepare(&self) -> Result<(), GrammarError> {
        self.factory().map(drop)
    }

    /// [`prepare`](Self::prepare) on a thread of its own; a failure is kept and reported by
    /// the first constrained request.
    pub fn prepare_in_background(self: &std::sync::Arc<Self>) {
        let me = std::sync::Arc::clone(self);
        let spawned = std::thread::Builder::new().name("grammar-table".into()).spawn(move || {
            let _ = me.prepare();
        });
        drop(spawned);
    }

    fn factory(&self) -> Result<&ParserFactory, GrammarError> {
        let f = self.factory.get_or_init(|| {
            let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let env = crate::tok_env(&self.tok)?;
                let mut f = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Unavailable(e.to_string()))?;
                f.quiet();
                Ok(f)
            }));
            built.unwrap_or_else(|_| Err(GrammarError::Unavailable("building the token table panicked".into())))
        });
        f.as_ref().map_err(Clone::clone)
    }

    /// A fresh matcher for `c`: compiled now, or copied from the cache.
    pub fn matcher(&self, c: &Constraint) -> Result<Matcher, GrammarError> {
        if size(c) > MAX_CONSTRAINT_BYTES {
            let message = format!("{} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted", size(c));
            return Err(GrammarError::Invalid { field: field(c), message });
        }
        let k = key(c);
        let tick = self.clock.fetch_add(1, Ordering::Relaxed);
        let hit = self.cache.lock().get_mut(&k).map(|(m, used)| {
            *used = tick;
            Arc::clone(m)
        });
        if let Some(m) = hit {
            // Copied outside the lock: requests with other schemas do not wait for it.
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(m.deep_clone());
        }
        // Compiled outside the lock: a slow schema does not hold up other requests' hits. A
        // panic in the compiler is a refusal of this constraint, not a dead thread.
        let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.compile(c)));
        let m = compiled.unwrap_or_else(|_| {
            Err(GrammarError::Invalid { field: field(c), message: "the grammar compiler failed on it".into() })
        })?;
        self.compiled.fetch_add(1, Ordering::Relaxed);
        let mut cache = self.cache.lock();
        if cache.len() >= self.capacity
            && let Some(oldest) = cache.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| *k)
        {
            cache.remove(&oldest);
        }
        cache.insert(k, (Arc::new(m.deep_clone()), tick));
        Ok(m)
    }

    fn compile(&self, c: &Constraint) -> Result<Matcher, GrammarError> {
        let invalid = |message: String| GrammarError::Invalid { field: field(c), message };
        let grammar = match c {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(layout(serde_json::json!({"type": "object"}))),
            Constraint::JsonSchema(text) => {
                let v: serde_json::Value = serde_json::from_str(text).map_err(|e| invalid(format!("not JSON: {e}")))?;
                if !(v.is_object() || v.is_boolean()) {
                    return Err(invalid("a JSON Schema is an object or a boolean".into()));
                }
                TopLevelGrammar::from_json_schema(layout(v))
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Choice(options) => {
                if options.is_empty() {
                    return Err(invalid("must list at least one string".into()));
                }
                let alts: Vec<String> = options.iter().map(|o| regex_syntax::escape(o)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alts.join("|")))
            }
        };
        let parser = self.factory()?.create_parser(grammar).map_err(|e| invalid(first_line(&e.to_string())))?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(invalid(first_line(&e))),
            None => Ok(m),
        }
    }

    /// Counts so far.
    pub fn stats(&self) -> GrammarsStats {
        GrammarsStats {
            compiled: self.compiled.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            held: self.cache.lock().len(),
        }
    }
}

/// The JSON layout Ferry asks for unless the schema says otherwise (llguidance's
/// `x-guidance` key): one line, `", "` between items and `": "` after keys, as Python's
/// `json.dumps` writes it. Free whitespace lets a model pad forever (the tiny test model
/// wrote newlines until `max_tokens`), and fixed separators are what jump-forward skips.
fn layout(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut()
        && !o.contains_key("x-guidance")
    {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// An error's first line, without llguidance's parser dump.
fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).trim().to_string()
}
