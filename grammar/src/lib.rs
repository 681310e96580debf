//! Structured outputs: the constraints a request may put on its whole output
//! ([`ferry_tokenize::Constraint`]: any JSON object, a JSON Schema, a regular expression, one
//! of some strings), compiled with [`llguidance`] over the model's own tokenizer.
//!
//! A [`Grammars`] per process (router and workers alike) compiles each distinct constraint
//! once and keeps it by its hash; every request gets a fresh copy of the compiled parser (a
//! [`Matcher`]), which computes the set of tokens allowed next and is told each token chosen.
//! The router compiles to refuse a bad schema with a 400 before any worker sees it; workers
//! compile (a cache hit after the first time) on a blocking thread, never on the engine's.

mod compiler;
mod tok_env;

pub use compiler::{Grammars, GrammarsStats, MAX_CONSTRAINT_BYTES};
pub use llguidance::Matcher;
pub use tok_env::tok_env;
pub use toktrie::SimpleVob as TokenMask;

/// A constraint that cannot be compiled: the request is refused, naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The constraint's text is not what its kind needs (a schema that is not JSON, a regex
    /// that does not parse, an empty choice list).
    #[error("{field}: {message}")]
    Invalid {
        /// The request field at fault.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The tokenizer could not be turned into the grammar engine's token table.
    #[error("structured outputs are unavailable for this model: {0}")]
    Unavailable(String),
}

/// The request field a constraint of this kind comes from (for error messages).
pub fn field(c: &ferry_tokenize::Constraint) -> &'static str {
    use ferry_tokenize::Constraint as C;
    match c {
        C::JsonObject => "response_format",
        C::JsonSchema(_) => "response_format.json_schema.schema",
        C::Regex(_) => "regex",
        C::Choice(_) => "choice",
    }
}
