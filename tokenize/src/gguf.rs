//! The GGUF container: header, metadata key/values and the tensor directory.
//!
//! Layout (GGUF v2/v3, little-endian): magic `GGUF`, version `u32`, tensor count `u64`,
//! metadata count `u64`; the metadata entries (key string, type `u32`, value); the tensor
//! infos (name, rank `u32`, dims `u64 × rank` listed `[ne0 = in, ne1 = out]`, type `u32`,
//! offset `u64` from the data section); then the data section, aligned to
//! `general.alignment` (default 32).
//!
//! Every count and length is checked against the bytes that remain before anything is
//! allocated, so a truncated or hostile file gives an error, never a panic or a huge
//! allocation.

use std::collections::BTreeMap;
use std::path::Path;

use crate::TokenizeError;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// `f32` or `f64`.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions as GGUF lists them: `[ne0, ne1, ...]`, `ne0` the fastest-varying.
    pub dims: Vec<u64>,
    /// The GGML type id.
    pub ggml_type: u32,
    /// Byte offset of the data, from the start of the file.
    pub offset: u64,
    /// Number of elements.
    pub elements: u64,
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    /// Start of the data section.
    pub data_offset: u64,
}

/// A memory-mapped GGUF file.
pub struct GgufFile {
    /// The parsed header.
    pub header: GgufHeader,
    map: memmap2::Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.header.version)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, TokenizeError> {
        let io = |source| TokenizeError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the file is opened read-only; Ferry's model files are not modified while
        // served (the same assumption every mmap-based loader makes).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let header = parse(&map)?;
        Ok(Self { header, map })
    }

    /// The bytes of the whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Drops the mapping's pages of `start..start + len` from this process's resident memory
    /// (the page cache keeps them; touching them again reads them back): a loader that has
    /// copied a tensor out calls it, so the file and its copy are not both resident. Best
    /// effort: an error (an unsupported kernel) changes nothing but the memory.
    pub fn release(&self, start: usize, len: usize) {
        if start.saturating_add(len) <= self.map.len() {
            // SAFETY: the map is a read-only file mapping: dropped pages read back as the
            // file's bytes, so no slice handed out sees a change.
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len) };
        }
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }
}

/// Byte size of one block, and the elements it holds, for a GGML type (None if unknown).
pub fn type_block(ggml_type: u32) -> Option<(usize, usize)> {
    Some(match ggml_type {
        0 => (4, 1),     // F32
        1 => (2, 1),     // F16
        2 => (18, 32),   // Q4_0
        3 => (20, 32),   // Q4_1
        6 => (22, 32),   // Q5_0
        7 => (24, 32),   // Q5_1
        8 => (34, 32),   // Q8_0
        9 => (36, 32),   // Q8_1
        10 => (84, 256), // Q2_K
        11 => (110, 256),
        12 => (144, 256), // Q4_K
        13 => (176, 256), // Q5_K
        14 => (210, 256), // Q6_K
        15 => (292, 256), // Q8_K
        24 => (1, 1),     // I8
        25 => (2, 1),     // I16
        26 => (4, 1),     // I32
        27 => (8, 1),     // I64
        28 => (8, 1),     // F64
        30 => (2, 1),     // BF16
        _ => return None,
    })
}

/// The GGML type's name, for messages.
pub fn type_name(ggml_type: u32) -> String {
    let n = match ggml_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16..=23 => "IQ*",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        _ => return format!("type {ggml_type}"),
    };
    n.to_string()
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TokenizeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end =
            end.ok_or_else(|| TokenizeError::Gguf(format!("truncated: {n} bytes wanted at offset {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], TokenizeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, TokenizeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, TokenizeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A count of items that each need at least `min_item` bytes.
    fn count(&mut self, min_item: usize, what: &str) -> Result<usize, TokenizeError> {
        let n = self.u64()?;
        if n.saturating_mul(min_item as u64) > self.remaining() as u64 {
            return Err(TokenizeError::Gguf(format!("{what} count {n} exceeds the file")));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, TokenizeError> {
        let n = self.count(1, "string length")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| TokenizeError::Gguf(format!("invalid UTF-8 string at offset {}", self.pos - n)))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, TokenizeError> {
        Ok(match ty {
            0 => Value::U64(u64::from(self.array::<1>()?[0])),
            1 => Value::I64(i64::from(i8::from_le_bytes(self.array()?))),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.array()?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.array()?))),
            4 => Value::U64(u64::from(self.u32()?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.array()?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.array()?))),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(TokenizeError::Gguf("arrays nested too deep".into()));
                }
                let inner = self.u32()?;
                let n = self.count(1, "array length")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            t => {
                return Err(TokenizeError::Gguf(format!("unknown metadata value type {t}")));
            }
        })
    }
}

/// Parses the header of a GGUF file held in `buf` and checks that every tensor lies inside it.
pub fn parse(buf: &[u8]) -> Result<GgufHeader, TokenizeError> {
    let mut r = Reader { buf, pos: 0 };
    if r.take(4).map_err(|_| TokenizeError::Gguf("file shorter than the GGUF magic".into()))? != b"GGUF" {
        return Err(TokenizeError::Gguf("not a GGUF file (bad magic)".into()));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(TokenizeError::Gguf(format!("unsupported GGUF version {version}")));
    }
    let n_tensors = r.count(24, "tensor")?;
    let n_kv = r.count(12, "metadata")?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        let v = r.value(ty, 0)?;
        metadata.insert(key, v);
    }
    let mut infos = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string()?;
        let rank = r.u32()?;
        if rank == 0 || rank > 4 {
            return Err(TokenizeError::Gguf(format!("tensor {name}: rank {rank}")));
        }
        let dims = (0..rank).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        let ggml_type = r.u32()?;
        let offset = r.u64()?;
        let elements = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let elements = elements.ok_or_else(|| TokenizeError::Gguf(format!("tensor {name}: dims overflow")))?;
        infos.push(TensorInfo { name, dims, ggml_type, offset, elements });
    }
    let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32);
    if align == 0 || align > 1 << 20 {
        return Err(TokenizeError::Gguf(format!("alignment {align}")));
    }
    let data_offset = (r.pos as u64).div_ceil(align) * align;
    for t in &mut infos {
        t.offset = t
            .offset
            .checked_add(data_offset)
            .ok_or_else(|| TokenizeError::Gguf(format!("tensor {}: offset overflow", t.name)))?;
        if let Some((bytes, per)) = type_block(t.ggml_type) {
            if t.elements % per as u64 != 0 {
                return Err(TokenizeError::Gguf(format!(
                    "tensor {}: {} elements is not whole blocks",
                    t.name, t.elements
                )));
            }
            let size = (t.elements / per as u64)
                .checked_mul(bytes as u64)
                .ok_or_else(|| TokenizeError::Gguf(format!("tensor {}: size overflow", t.name)))?;
            if t.offset.saturating_add(size) > buf.len() as u64 {
                return Err(TokenizeError::Gguf(format!(
                    "tensor {} ends at byte {} but the file has {} bytes (truncated file?)",
                    t.name,
                    t.offset.saturating_add(size),
                    buf.len()
                )));
            }
        }
    }
    Ok(GgufHeader { version, metadata, tensors: infos, data_offset })
}

/// Helpers to read typed metadata with clear errors.
pub trait MetadataExt {
    /// A required unsigned integer.
    fn req_u64(&self, key: &str) -> Result<u64, TokenizeError>;
    /// A required string.
    fn req_str(&self, key: &str) -> Result<&str, TokenizeError>;
    /// A required array.
    fn req_array(&self, key: &str) -> Result<&[Value], TokenizeError>;
}

impl MetadataExt for BTreeMap<String, Value> {
    fn req_u64(&self, key: &str) -> Result<u64, TokenizeError> {
        self.get(key).ok_or_else(|| missing(key))?.as_u64().ok_or_else(|| wrong(key, "an unsigned integer"))
    }
    fn req_str(&self, key: &str) -> Result<&str, TokenizeError> {
        self.get(key).ok_or_else(|| missing(key))?.as_str().ok_or_else(|| wrong(key, "a string"))
    }
    fn req_array(&self, key: &str) -> Result<&[Value], TokenizeError> {
        self.get(key).ok_or_else(|| missing(key))?.as_array().ok_or_else(|| wrong(key, "an array"))
    }
}

fn missing(key: &str) -> TokenizeError {
    TokenizeError::Metadata { key: key.into(), problem: "missing".into() }
}

fn wrong(key: &str, want: &str) -> TokenizeError {
    TokenizeError::Metadata { key: key.into(), problem: format!("is not {want}") }
}
