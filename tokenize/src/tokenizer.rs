//! The tokenizer: HF `tokenizers` plus the model's BOS/EOS rules and chat template.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value as Json;

use crate::byte_decode::ByteDecoder;
use crate::fast_bpe::FastBpe;
use crate::gguf::{GgufHeader, Value};
use crate::{ChatTemplate, HeadCache, TokenizeError};

/// A model's tokenizer with its special-token rules.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    add_bos: bool,
    eos_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
    vocab_size: usize,
    /// Shared by clones.
    head_cache: Option<Arc<HeadCache>>,
    /// HF's ids without HF's pipeline, where the vocabulary's shape allows.
    fast: Option<Arc<FastBpe>>,
    /// HF's decoding without HF's pipeline, for a `ByteLevel` decoder.
    bytes: Option<Arc<ByteDecoder>>,
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` from an
    /// HF model directory. `vocab_size` is the model's embedding rows.
    pub fn from_hf_dir(dir: &Path, vocab_size: usize) -> Result<Self, TokenizeError> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TokenizeError::Tokenizer(format!("{}: {e}", path.display())))?;
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
        let gen_config = read_json(&dir.join("generation_config.json"))?.unwrap_or(Json::Null);
        let token_text = |key: &str| -> Option<String> {
            match config.get(key)? {
                Json::String(s) => Some(s.clone()),
                Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos_text = token_text("bos_token");
        let eos_text = token_text("eos_token");
        let bos_id = gen_config
            .get("bos_token_id")
            .and_then(Json::as_u64)
            .map(|v| v as u32)
            .or_else(|| bos_text.as_deref().and_then(|t| inner.token_to_id(t)));
        // Whether to prepend BOS: tokenizer_config's `add_bos_token` when given, else what the
        // tokenizer's own post-processor does.
        let add_bos = match config.get("add_bos_token").and_then(Json::as_bool) {
            Some(b) => b,
            None => {
                let probe = inner.encode("a", true).map_err(|e| TokenizeError::Tokenizer(e.to_string()))?;
                bos_id.is_some() && probe.get_ids().first().copied() == bos_id
            }
        };
        let mut eos_ids: Vec<u32> = match gen_config.get("eos_token_id") {
            Some(Json::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Json::Array(a)) => a.iter().filter_map(Json::as_u64).map(|v| v as u32).collect(),
            _ => Vec::new(),
        };
        if let Some(id) = eos_text.as_deref().and_then(|t| inner.token_to_id(t))
            && !eos_ids.contains(&id)
        {
            eos_ids.push(id);
        }
        let chat_template = match config.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        let chat_template = chat_template
            .map(|t| ChatTemplate::new(&t, bos_text.clone().unwrap_or_default(), eos_text.clone().unwrap_or_default()))
            .transpose()?;
        Self::finish(inner, bos_id, add_bos, eos_ids, chat_template, vocab_size)
    }

    /// Builds the tokenizer from a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(header: &GgufHeader, vocab_size: usize) -> Result<Self, TokenizeError> {
        let md = &header.metadata;
        let json = crate::gguf_vocab::tokenizer_json(md)?;
        let inner: tokenizers::Tokenizer =
            json.parse().map_err(|e| TokenizeError::Tokenizer(format!("GGUF vocabulary: {e}")))?;
        let id = |key: &str| md.get(key).and_then(Value::as_u64).map(|v| v as u32);
        let bos_id = id("tokenizer.ggml.bos_token_id");
        // llama.cpp's default: SentencePiece vocabularies get BOS, byte-level BPE ones do not.
        let spm = md.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("llama");
        let add_bos = md.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(spm);
        let mut eos_ids: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        if let Some(e) = id("tokenizer.ggml.eot_token_id").filter(|e| !eos_ids.contains(e)) {
            eos_ids.push(e);
        }
        let text = |id: Option<u32>| id.and_then(|i| inner.id_to_token(i)).unwrap_or_default();
        let chat_template = md
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map(|t| ChatTemplate::new(t, text(bos_id), text(eos_ids.first().copied())))
            .transpose()?;
        Self::finish(inner, bos_id, add_bos, eos_ids, chat_template, vocab_size)
    }

    fn finish(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        add_bos: bool,
        mut eos_ids: Vec<u32>,
        chat_template: Option<ChatTemplate>,
        vocab_size: usize,
    ) -> Result<Self, TokenizeError> {
        // `<|endoftext|>` also ends generation where the vocabulary has it and it is not BOS.
        if let Some(eot) = inner.token_to_id("<|endoftext|>").filter(|&e| Some(e) != bos_id && !eos_ids.contains(&e)) {
            eos_ids.push(eot);
        }
        if let Some(&bad) = eos_ids.iter().chain(bos_id.iter()).find(|&&i| i as usize >= vocab_size) {
            return Err(TokenizeError::Tokenizer(format!(
                "special token id {bad} is outside the vocabulary of {vocab_size}"
            )));
        }
        let fast = FastBpe::new(&inner).map(Arc::new);
        let bytes = ByteDecoder::new(&inner).map(Arc::new);
        Ok(Self { inner, bos_id, add_bos, eos_ids, chat_template, vocab_size, head_cache: None, fast, bytes })
    }

    /// This tokenizer with a [`HeadCache`] of at most `max_bytes` (shared by its clones), where
    /// its vocabulary allows one; 0 turns the cache off.
    pub fn with_head_cache(mut self, max_bytes: usize) -> Self {
        // Word cuts wherever the fast path runs (every pattern it accepts holds them), and cuts
        // after a mark for GPT-2's alone.
        let wide = self.fast.as_ref().map(|f| f.gpt2());
        self.head_cache = HeadCache::new(&self.inner, max_bytes)
            .map(|c| match wide {
                Some(wide) => c.with_word_cuts(&self.inner, wide),
                None => c,
            })
            .map(Arc::new);
        self
    }

    /// The head cache, when there is one.
    pub fn head_cache(&self) -> Option<&HeadCache> {
        self.head_cache.as_deref()
    }

    /// Token ids of `text` from HF `tokenizers`' own pipeline alone — no head cache, no
    /// `FastBpe` — with the same BOS rule: the reference [`encode`](Self::encode) equals.
    pub fn encode_hf(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.with_bos(self.hf_ids(text)?))
    }

    fn hf_ids(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let enc = self.inner.encode(text, false).map_err(|e| TokenizeError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids of the added tokens HF marks special (control tokens: end of turn, BOS, ...).
    pub fn special_ids(&self) -> Vec<u32> {
        self.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect()
    }

    /// The tokenizer's ids for `text` without BOS (special tokens written in it recognised):
    /// the fast path where there is one.
    pub fn encode_without_bos(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.fast {
            Some(f) => Ok(f.encode(text)),
            None => self.hf_ids(text),
        }
    }

    /// Whether [`encode`](Self::encode) skips HF's pipeline (a byte-level BPE vocabulary of a
    /// shape it reproduces exactly).
    pub fn is_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// Why [`is_fast`](Self::is_fast) is false (`None` when it is true).
    pub fn why_not_fast(&self) -> Option<String> {
        FastBpe::build(&self.inner).err().map(|e| e.to_string())
    }

    /// The HF `tokenizers` tokenizer underneath.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let (true, Some(bos)) = (self.add_bos, self.bos_id)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        ids
    }

    /// Token ids of `text`. Special tokens written in the text are recognised; BOS is
    /// prepended when the model asks for it and the text does not already start with it.
    /// Segments held by the head cache ([`with_head_cache`](Self::with_head_cache)) are reused.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let ids = match &self.head_cache {
            Some(c) => c.encode(text, |s| self.encode_without_bos(s))?,
            None => self.encode_without_bos(text)?,
        };
        Ok(self.with_bos(ids))
    }

    /// The text of `ids`; special tokens are kept when `skip_special` is false.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizeError> {
        self.inner.decode(ids, skip_special).map_err(|e| TokenizeError::Tokenizer(e.to_string()))
    }

    /// The byte table of a `ByteLevel` decoder ([`crate::Detokenizer`] reads it).
    pub(crate) fn byte_decoder(&self) -> Option<&ByteDecoder> {
        self.bytes.as_deref()
    }

    /// The token string of one id (as the vocabulary writes it).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The raw bytes token `id` stands for (empty for an unknown id): what OpenAI's logprobs
    /// report as `bytes`; [`crate::token_display`] makes its `token` string.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else { return Vec::new() };
        let byte_level = matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        if byte_level {
            // Special tokens are plain ASCII, which the table maps to itself.
            piece.chars().filter_map(crate::token_bytes::byte_level_byte).collect()
        } else {
            crate::token_bytes::sentencepiece_bytes(&piece)
        }
    }

    /// Ids that end generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether [`encode`](Self::encode) prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The model's chat template.
    pub fn chat_template(&self) -> Result<&ChatTemplate, TokenizeError> {
        self.chat_template.as_ref().ok_or(TokenizeError::NoChatTemplate)
    }

    /// The model's vocabulary size (embedding rows).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

fn read_json(path: &Path) -> Result<Option<Json>, TokenizeError> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| TokenizeError::Tokenizer(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizeError::Io { path: path.to_path_buf(), source }),
    }
}
