//! Writing GGUF v3 files (test models and fixtures).

use std::io::Write;

use crate::gguf::Value;

/// A tensor to write: name, GGUF dims (`[ne0 = in, ne1 = out]`), GGML type and raw data.
#[derive(Debug, Clone)]
pub struct TensorData {
    /// Tensor name.
    pub name: String,
    /// Dims as GGUF lists them.
    pub dims: Vec<u64>,
    /// GGML type id.
    pub ggml_type: u32,
    /// Encoded bytes.
    pub data: Vec<u8>,
}

const ALIGN: usize = 32;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The GGUF type `v` is written as: integers in 32 bits where they fit, floats as f32 — the
/// widths llama.cpp's converter writes and its loader insists on (it refuses a u64
/// `context_length`), so llama.cpp loads the test models too. An array's items share the
/// widest type any of them needs.
fn type_of(v: &Value) -> u32 {
    match v {
        Value::U64(x) => {
            if u32::try_from(*x).is_ok() {
                4
            } else {
                10
            }
        }
        Value::I64(x) => {
            if i32::try_from(*x).is_ok() {
                5
            } else {
                11
            }
        }
        Value::F64(_) => 6,
        Value::Bool(_) => 7,
        Value::Str(_) => 8,
        Value::Array(_) => 9,
    }
}

/// The type an array's items are written as (strings for an empty one).
fn item_type(items: &[Value]) -> u32 {
    items.iter().map(type_of).max_by_key(|&t| if t == 4 || t == 5 { 0 } else { 1 }).unwrap_or(8)
}

/// Writes `v` as GGUF type `ty` (its [`type_of`], or its array's [`item_type`]).
fn put_value(out: &mut Vec<u8>, v: &Value, ty: u32) {
    match v {
        Value::U64(x) if ty == 4 => out.extend_from_slice(&(*x as u32).to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) if ty == 5 => out.extend_from_slice(&(*x as i32).to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&(*x as f32).to_le_bytes()),
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::Str(s) => put_str(out, s),
        Value::Array(items) => {
            let inner = item_type(items);
            out.extend_from_slice(&inner.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i, inner);
            }
        }
    }
}

/// Encodes a GGUF v3 file. Metadata arrays must be homogeneous.
pub fn encode(metadata: &[(String, Value)], tensors: &[TensorData]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut out, k);
        let ty = type_of(v);
        out.extend_from_slice(&ty.to_le_bytes());
        put_value(&mut out, v, ty);
    }
    let mut offset = 0usize;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ggml_type.to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += t.data.len().div_ceil(ALIGN) * ALIGN;
    }
    out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
    for t in tensors {
        out.extend_from_slice(&t.data);
        out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
    }
    out
}

/// Writes a GGUF v3 file.
pub fn write(path: &std::path::Path, metadata: &[(String, Value)], tensors: &[TensorData]) -> std::io::Result<()> {
    std::fs::File::create(path)?.write_all(&encode(metadata, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::parse;

    #[test]
    fn parse_reads_back_what_encode_wrote() -> Result<(), crate::TokenizeError> {
        let md = vec![
            ("general.architecture".to_string(), Value::Str("llama".into())),
            ("a.list".to_string(), Value::Array(vec![Value::Str("x".into()), Value::Str("y".into())])),
            ("a.n".to_string(), Value::U64(7)),
            ("a.big".to_string(), Value::U64(1 << 40)),
            ("a.neg".to_string(), Value::I64(-3)),
            ("a.f".to_string(), Value::F64(0.5)),
            ("a.ints".to_string(), Value::Array(vec![Value::U64(1), Value::U64(1 << 33)])),
        ];
        let t = TensorData { name: "w".into(), dims: vec![4, 2], ggml_type: 0, data: vec![1u8; 32] };
        let bytes = encode(&md, &[t]);
        let h = parse(&bytes)?;
        for (k, v) in &md {
            assert_eq!(h.metadata.get(k.as_str()), Some(v), "{k}");
        }
        // llama.cpp's widths: a u32 `a.n` (type 4 after its key), an f32 `a.f` (type 6).
        let after = |key: &str| {
            let at = bytes.windows(key.len()).position(|w| w == key.as_bytes()).expect("key written") + key.len();
            u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
        };
        assert_eq!((after("a.n"), after("a.big"), after("a.neg"), after("a.f")), (4, 10, 5, 6));
        assert_eq!(h.tensors[0].dims, vec![4, 2]);
        assert_eq!(&bytes[h.tensors[0].offset as usize..][..32], &[1u8; 32]);
        // Every truncation is an error, never a panic.
        for cut in 0..bytes.len() - 1 {
            assert!(parse(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        Ok(())
    }
}
