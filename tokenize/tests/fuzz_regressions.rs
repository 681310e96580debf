//! Inputs the fuzz targets once crashed on (fuzz/corpus keeps them too): each must now be a
//! clean error.

#[test]
fn gguf_tensor_whose_byte_size_overflows_is_an_error() {
    let bytes = include_bytes!("fuzz-regressions/gguf-size-overflow.bin");
    let e = ferry_tokenize::gguf::parse(bytes).expect_err("refused");
    assert!(e.to_string().contains("overflow"), "{e}");
}
