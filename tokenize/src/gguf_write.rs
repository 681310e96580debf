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

fn type_of(v: &Value) -> u32 {
    match v {
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
        Value::Bool(_) => 7,
        Value::Str(_) => 8,
        Value::Array(_) => 9,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::Str(s) => put_str(out, s),
        Value::Array(items) => {
            let inner = items.first().map_or(8, type_of);
            out.extend_from_slice(&inner.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
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
        out.extend_from_slice(&type_of(v).to_le_bytes());
        put_value(&mut out, v);
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
        ];
        let t = TensorData { name: "w".into(), dims: vec![4, 2], ggml_type: 0, data: vec![1u8; 32] };
        let bytes = encode(&md, &[t]);
        let h = parse(&bytes)?;
        assert_eq!(h.metadata.get("a.n"), Some(&Value::U64(7)));
        assert_eq!(h.tensors[0].dims, vec![4, 2]);
        assert_eq!(&bytes[h.tensors[0].offset as usize..][..32], &[1u8; 32]);
        // Every truncation is an error, never a panic.
        for cut in 0..bytes.len() - 1 {
            assert!(parse(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        Ok(())
    }
}
