//! Writes a tiny random Llama (the one the tests use, or a very small one with `--small`) as
//! a Hugging Face directory `DIR/hf` and a GGUF file `DIR/tiny.gguf`:
//!
//!   cargo run -p ferry-engine --example tiny_model -- DIR [--small]
//!
//! `fuzz/seed.sh` uses it for the fuzz targets' seed files.

use ferry_engine::tiny::{TinySpec, write_gguf, write_hf};

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: tiny_model DIR [--small]");
        std::process::exit(2);
    };
    let spec = if args.next().as_deref() == Some("--small") {
        TinySpec { hidden: 8, ffn: 16, layers: 1, heads: 2, kv_heads: 1, ctx: 64, merges: 4, ..TinySpec::default() }
    } else {
        TinySpec::default()
    };
    let dir = std::path::Path::new(&dir);
    write_hf(&dir.join("hf"), &spec)?;
    write_gguf(&dir.join("tiny.gguf"), &spec)?;
    Ok(())
}
