//! A chat turned into the prompt the checkpoint was trained on: its own Jinja
//! `chat_template` from `tokenizer_config.json`, rendered as transformers'
//! `apply_chat_template` renders it (`messages`, `add_generation_prompt` true, `bos_token`,
//! `eos_token`, `raise_exception`, Python's string methods), or, for a checkpoint without
//! one, ChatML, Qwen's own format: `<|im_start|>role\ncontent<|im_end|>\n` per message, then
//! `<|im_start|>assistant\n`.
//!
//! The template is the operator's file, the messages are the public's: rendering runs on a
//! fuel budget, so no message makes it loop without end, and its errors are the request's.

use std::path::Path;

use anyhow::{Context, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// Template instructions one rendering may run: far above what a real chat template spends on
/// a long conversation.
const FUEL: u64 = 5_000_000;

/// One message, as the template sees it.
#[derive(Serialize)]
pub struct Turn {
    pub role: String,
    pub content: String,
}

pub enum Chat {
    Template {
        source: String,
        bos: String,
        eos: String,
    },
    ChatMl,
}

/// A special token in tokenizer_config.json: a string, or `{"content": ...}`.
fn token_text(value: Option<&serde_json::Value>) -> String {
    match value {
        Some(serde_json::Value::String(text)) => text.clone(),
        Some(serde_json::Value::Object(token)) => token
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl Chat {
    /// The template of the checkpoint in `dir` (`tokenizer_config.json`'s `chat_template`, a
    /// string or the one named `default` of a list); ChatML when there is none.
    pub fn load(dir: &Path) -> Result<Chat> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(Chat::ChatMl);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let source = match config.get("chat_template") {
            Some(serde_json::Value::String(source)) => source.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string)
                .with_context(|| format!("{}: no chat_template named default", path.display()))?,
            _ => return Ok(Chat::ChatMl),
        };
        let chat = Chat::Template {
            source,
            bos: token_text(config.get("bos_token")),
            eos: token_text(config.get("eos_token")),
        };
        // A template that does not even parse is the operator's error, at start.
        if let Chat::Template { source, .. } = &chat {
            environment()
                .template_from_str(source)
                .with_context(|| format!("{}: its chat_template", path.display()))?;
        }
        Ok(chat)
    }

    /// The prompt for `turns`, ending where the assistant's answer begins; an error is the
    /// template's message (its `raise_exception`, or what it could not do).
    pub fn prompt(&self, turns: &[Turn]) -> std::result::Result<String, String> {
        match self {
            Chat::ChatMl => Ok(turns
                .iter()
                .map(|t| format!("<|im_start|>{}\n{}<|im_end|>\n", t.role, t.content))
                .chain(["<|im_start|>assistant\n".to_string()])
                .collect()),
            Chat::Template { source, bos, eos } => environment()
                .render_str(
                    source,
                    context! {
                        messages => turns,
                        add_generation_prompt => true,
                        bos_token => bos,
                        eos_token => eos,
                    },
                )
                .map_err(|e| match e.kind() {
                    ErrorKind::OutOfFuel => "the chat is too long for the chat template".into(),
                    _ => format!("the chat template refused this chat: {e}"),
                }),
        }
    }
}

/// The Jinja environment transformers renders chat templates in, on a fuel budget.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.set_fuel(Some(FUEL));
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turns(pairs: &[(&str, &str)]) -> Vec<Turn> {
        pairs
            .iter()
            .map(|(role, content)| Turn {
                role: role.to_string(),
                content: content.to_string(),
            })
            .collect()
    }

    /// Qwen's template, in the style of its published tokenizer_config.json (a system turn,
    /// string methods, loop variables, `raise_exception`).
    const QWEN_STYLE: &str = r#"{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content.strip() + '<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if message.role == 'wizard' %}{{ raise_exception('no wizards') }}{%- elif message.role != 'system' or not loop.first %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

    #[test]
    fn a_checkpoint_template_renders_as_transformers_would_and_chatml_is_the_fallback() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(Chat::load(dir.path()).unwrap(), Chat::ChatMl));
        let config = serde_json::json!({"chat_template": QWEN_STYLE, "eos_token": {"content": "<|im_end|>"}});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let chat = Chat::load(dir.path()).unwrap();
        let conversation = turns(&[("system", "  Be brief. "), ("user", "Hi")]);
        let rendered = chat.prompt(&conversation).unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        // The same chat in the fallback differs only by the template's strip().
        assert_eq!(
            Chat::ChatMl
                .prompt(&turns(&[("system", "Be brief."), ("user", "Hi")]))
                .unwrap(),
            rendered
        );
        // The template's own refusal is the request's error.
        let refused = chat.prompt(&turns(&[("wizard", "x")])).unwrap_err();
        assert!(refused.contains("no wizards"), "{refused}");
    }

    #[test]
    fn a_template_that_would_run_away_is_stopped_and_a_broken_one_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let endless =
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
        let config = serde_json::json!({"chat_template": endless});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let chat = Chat::load(dir.path()).unwrap();
        assert!(chat.prompt(&turns(&[("user", "x")])).is_err());
        let config = serde_json::json!({"chat_template": "{% for %}"});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        assert!(Chat::load(dir.path()).is_err());
    }
}
