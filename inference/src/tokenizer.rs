//! `tokenizer.json` through the `tokenizers` crate (pure-Rust features only).

use std::path::Path;

use crate::LoadError;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// `tokenizer.json` in the checkpoint directory `dir`, or beside the GGUF file `dir`
    /// names (reading a GGUF file's own tokenizer from its metadata is not written yet).
    pub fn load(dir: &Path) -> Result<Tokenizer, LoadError> {
        let path = if crate::gguf::is_gguf(dir) {
            dir.with_file_name("tokenizer.json")
        } else {
            dir.join("tokenizer.json")
        };
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| LoadError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LoadError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Whether decoding joins the tokens' bytes and reads them as UTF-8 (the byte-level
    /// decoder of GPT-2 and Qwen), so that bytes added later can change only the last,
    /// unfinished character of the text. A byte-fallback decoder, for one, reads a whole run
    /// of byte tokens at once: a later byte can turn the run's earlier characters into U+FFFD.
    pub fn joins_bytes(&self) -> bool {
        matches!(
            self.inner.get_decoder(),
            Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_))
        )
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, LoadError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))
    }
}
