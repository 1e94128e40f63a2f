//! A model's chat template (Jinja, from its `tokenizer_config.json` or `chat_template.jinja`)
//! rendered with minijinja the way Hugging Face's `apply_chat_template` and vLLM render it:
//! `messages`, `add_generation_prompt`, the special tokens by name, `raise_exception`, and
//! Python's string methods. The control plane renders it only to know the token ids the
//! engine will see, so that a chat's block hashes are the engine's.

use minijinja::{Environment, Error, ErrorKind, Value};
use std::path::Path;

/// One model's chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; an error names the template's line.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        // HF templates call Python's str methods (`.strip()`, `.startswith()`, ...).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        // As transformers compiles chat templates.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| format!("chat template syntax: {e}"))?;
        env.set_syntax(syntax);
        env.add_template_owned(NAME, source).map_err(|e| format!("the chat template does not compile: {e:#}"))?;
        Ok(ChatTemplate { env, bos_token, eos_token })
    }

    /// The template a model folder brings: `chat_template.jinja`, or the `chat_template` of
    /// `tokenizer_config.json` (with its `bos_token` and `eos_token`). `None` when it has none.
    pub fn in_model_dir(dir: &Path) -> Result<Option<ChatTemplate>, String> {
        let config_file = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read(&config_file) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| format!("{} is not JSON: {e}", config_file.display()))?
            }
            Err(_) => serde_json::Value::Null,
        };
        let token = |key: &str| match &config[key] {
            serde_json::Value::String(s) => s.clone(),
            // `{"content": "<s>", ...}` in older configs.
            v => v["content"].as_str().unwrap_or_default().to_string(),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.is_file() {
            std::fs::read_to_string(&jinja).map_err(|e| format!("cannot read {}: {e}", jinja.display()))?
        } else {
            match &config["chat_template"] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => return Ok(None),
                // A list of named templates: the one named "default".
                serde_json::Value::Array(named) => match named.iter().find(|t| t["name"] == "default") {
                    Some(t) => t["template"].as_str().unwrap_or_default().to_string(),
                    None => return Err(format!("{}: no chat template named `default`", config_file.display())),
                },
                _ => return Err(format!("{}: `chat_template` is not a string", config_file.display())),
            }
        };
        ChatTemplate::new(source, token("bos_token"), token("eos_token"))
            .map(Some)
            .map_err(|e| format!("{}: {e}", dir.display()))
    }

    /// The prompt text of a conversation of (role, content) messages, ready for the
    /// assistant's answer.
    pub fn render<'a>(&self, messages: impl Iterator<Item = (&'a str, &'a str)>) -> Result<String, String> {
        let messages: Vec<Value> =
            messages.map(|(role, content)| minijinja::context! { role => role, content => content }).collect();
        let template = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| format!("the chat template failed: {e:#}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3's template, trimmed to its shape (header tokens, `| trim`, a generation prompt).
    const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    #[test]
    fn renders_like_hugging_face() {
        let t = ChatTemplate::new(LLAMA3.into(), "<|begin_of_text|>".into(), "<|eot_id|>".into()).unwrap();
        let text = t.render([("system", "Be brief. "), ("user", "Hi")].into_iter()).unwrap();
        assert_eq!(
            text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}{% for m in messages %}{{ m['content'].strip().upper() }}{% endfor %}";
        let t = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
        assert_eq!(t.render([("user", " hi ")].into_iter()).unwrap(), "HI");
        let e = t.render([("system", "x")].into_iter()).unwrap_err();
        assert!(e.contains("Conversations must start with the user"), "{e}");
        let e = ChatTemplate::new("{% for %}".into(), String::new(), String::new()).unwrap_err();
        assert!(e.contains("does not compile"), "{e}");
    }

    #[test]
    fn read_from_a_model_folder() {
        let dir = std::env::temp_dir().join(format!("fleetplane-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(ChatTemplate::in_model_dir(&dir).unwrap().is_none(), "no template: none");
        let config = serde_json::json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::in_model_dir(&dir).unwrap().expect("a template");
        assert_eq!(t.render([("user", "a")].into_iter()).unwrap(), "<s>[user]a</s>");
        std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}{{ m.content }}{% endfor %}!").unwrap();
        let t = ChatTemplate::in_model_dir(&dir).unwrap().expect("the .jinja file wins");
        assert_eq!(t.render([("user", "a")].into_iter()).unwrap(), "a!");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
