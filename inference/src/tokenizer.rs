//! `tokenizer.json` through the `tokenizers` crate (pure-Rust features only), or a GGUF
//! file's own byte-level BPE tokenizer (`tokenizer.ggml.*`), rebuilt as the `tokenizer.json`
//! it was converted from.

use std::path::Path;

use serde_json::{json, Map, Value as Json};

use crate::gguf::{Gguf, Header, Value};
use crate::LoadError;

/// The pre-tokenizers that split on a regex before a byte-level step without its own, by
/// their `tokenizer.ggml.pre` name: Qwen2's (Qwen2 and Qwen3's tokenizers as published), and
/// Qwen3.5's, which keeps combining marks with the letters before them.
const SPLITS: &[(&str, &str)] = &[
    (
        "qwen2",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        "qwen35",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// The pre-tokenizer of each `tokenizer.ggml.pre` this engine rebuilds: GPT-2's byte-level
/// split, or one of `SPLITS`.
fn pre_tokenizer(pre: &str) -> Option<Json> {
    if pre == "gpt-2" {
        return Some(json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
        }));
    }
    let (_, regex) = SPLITS.iter().find(|(name, _)| *name == pre)?;
    Some(json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
    ]}))
}

/// The `tokenizer.ggml.pre` name of a `tokenizer.json` pre-tokenizer, if it is one of those
/// `pre_tokenizer` rebuilds (what splits text, compared; offsets and prefix spaces aside).
pub(crate) fn pre_tokenizer_name(pre_tokenizer: &Json) -> Option<&'static str> {
    let byte_level = |p: &Json, regex: bool| {
        p["type"] == "ByteLevel"
            && p["add_prefix_space"] != true
            && p["use_regex"].as_bool().unwrap_or(true) == regex
    };
    if byte_level(pre_tokenizer, true) {
        return Some("gpt-2");
    }
    let Some([split, bytes]) = pre_tokenizer["pretokenizers"].as_array().map(Vec::as_slice) else {
        return None;
    };
    if split["type"] != "Split"
        || split["behavior"] != "Isolated"
        || split["invert"] == true
        || !byte_level(bytes, false)
    {
        return None;
    }
    let (name, _) = SPLITS
        .iter()
        .find(|(_, regex)| split["pattern"]["Regex"] == *regex)?;
    Some(name)
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// `tokenizer.json` in the checkpoint directory `dir`; for a GGUF file, its own tokenizer
    /// when its metadata holds one this engine rebuilds (tokens and merges of a byte-level
    /// BPE), else `tokenizer.json` beside it.
    pub fn load(dir: &Path) -> Result<Tokenizer, LoadError> {
        let path = if crate::gguf::is_gguf(dir) {
            let file = Gguf::open(dir).map_err(|e| LoadError::Format {
                file: dir.display().to_string(),
                reason: e.to_string(),
            })?;
            let beside = dir.with_file_name("tokenizer.json");
            if file.header().get("tokenizer.ggml.merges").is_some() {
                // A tokenizer this engine cannot rebuild from the metadata is the file beside
                // it, when there is one; else the metadata's error says what to do.
                match Tokenizer::of_gguf(file.header()) {
                    Err(_) if beside.exists() => {}
                    own => return own,
                }
            }
            beside
        } else {
            dir.join("tokenizer.json")
        };
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| LoadError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner })
    }

    /// The byte-level BPE tokenizer a GGUF header describes.
    fn of_gguf(header: &Header) -> Result<Tokenizer, LoadError> {
        let bad = |what: String| LoadError::Tokenizer(format!("GGUF metadata: {what}"));
        let text = |key: &str| header.get(key).and_then(Value::as_text);
        let texts = |key: &str| -> Result<Vec<&str>, LoadError> {
            match header.get(key) {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(Value::as_text)
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad(format!("{key} holds something other than text"))),
                _ => Err(bad(format!("no {key}"))),
            }
        };
        if text("tokenizer.ggml.model") != Some("gpt2") {
            return Err(bad(format!(
                "tokenizer.ggml.model {:?} is not the byte-level BPE (gpt2) this engine rebuilds; put its tokenizer.json beside the file",
                text("tokenizer.ggml.model")
            )));
        }
        let pre = text("tokenizer.ggml.pre").unwrap_or("gpt-2");
        let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
            bad(format!(
                "pre-tokenizer {pre:?} is not one this engine rebuilds (gpt-2, qwen2, qwen35); put its tokenizer.json beside the file"
            ))
        })?;
        let tokens = texts("tokenizer.ggml.tokens")?;
        let kinds: Vec<u64> = match header.get("tokenizer.ggml.token_type") {
            Some(Value::Array(kinds)) => kinds.iter().map(|k| k.as_u64().unwrap_or(1)).collect(),
            _ => Vec::new(),
        };
        let mut vocab = Map::new();
        let mut added = Vec::new();
        for (id, token) in tokens.iter().enumerate() {
            vocab.insert(token.to_string(), json!(id));
            // llama.cpp's token types: 3 control (special), 4 user-defined.
            if let kind @ (3 | 4) = kinds.get(id).copied().unwrap_or(1) {
                added.push(json!({
                    "id": id, "content": token, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": kind == 4, "special": kind == 3
                }));
            }
        }
        let merges = texts("tokenizer.ggml.merges")?;
        let description = json!({
            "version": "1.0",
            "added_tokens": added,
            "normalizer": if pre == "gpt-2" { Json::Null } else { json!({"type": "NFC"}) },
            "pre_tokenizer": pre_tokenizer,
            "decoder": {
                "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true
            },
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges
            }
        });
        let inner = description
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| bad(e.to_string()))?;
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
