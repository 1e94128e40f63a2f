//! Text to token ids and back, per model: the model's own tokenizer (a Hugging Face
//! `tokenizer.json`) when the fleet has one for it, else the stand-in ([`stand_in`]).
//!
//! Where a model's tokenizer comes from:
//! - `serve --tokenizer MODEL=PATH` pins it at start-up;
//! - an engine whose model folder holds `tokenizer.json` (or that was given `--tokenizer`)
//!   reports its SHA-256 when it registers (`EngineInfo::tokenizer_sha256`), and the control
//!   plane fetches it from the engine (`Engine.Tokenizer`) before the engine joins the fleet,
//!   so no request of that model is ever tokenized by the stand-in once an engine serves it.
//!
//! One model name has one tokenizer: an engine reporting another one for a model the fleet
//! already tokenizes is refused at registration, naming both digests.
//!
//! Token ids in a request are taken as they are. Output ids become text incrementally
//! ([`TextDecoder`]): a token that ends inside a multi-byte character (byte-level BPE)
//! waits for the next one, so each streamed chunk is valid UTF-8 and the chunks add up to
//! the decoding of the whole output.

pub mod chat_template;
pub mod stand_in;

use chat_template::ChatTemplate;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// A tokenizer read from a `tokenizer.json`.
#[derive(Clone)]
pub struct Loaded {
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    /// Hex SHA-256 of the file's bytes: the tokenizer's identity across processes.
    pub sha256: String,
    /// The file's bytes (what an engine serves to control planes).
    pub json: Arc<Vec<u8>>,
    /// The model folder's chat template, when it came from a folder that has one.
    pub chat: Option<Arc<ChatTemplate>>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("sha256", &self.sha256).finish_non_exhaustive()
    }
}

/// Reads a tokenizer from `bytes` (the content of a `tokenizer.json`).
pub fn parse(bytes: Vec<u8>) -> Result<Loaded, String> {
    let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| format!("not a tokenizer.json: {e}"))?;
    let sha256 = hex::encode(Sha256::digest(&bytes));
    Ok(Loaded { tokenizer: Arc::new(tokenizer), sha256, json: Arc::new(bytes), chat: None })
}

/// The `tokenizer.json` at `path`, or in folder `path` with the folder's chat template.
pub fn load(path: &Path) -> anyhow::Result<Loaded> {
    let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
    let bytes = std::fs::read(&file).map_err(|e| anyhow::anyhow!("cannot read tokenizer {}: {e}", file.display()))?;
    let mut loaded = parse(bytes).map_err(|e| anyhow::anyhow!("tokenizer {}: {e}", file.display()))?;
    if path.is_dir() {
        loaded.chat = ChatTemplate::in_model_dir(path).map_err(|e| anyhow::anyhow!(e))?.map(Arc::new);
    }
    Ok(loaded)
}

/// The tokenizer file a model folder brings, if any.
pub fn in_model_dir(dir: &Path) -> Option<PathBuf> {
    let file = dir.join("tokenizer.json");
    file.is_file().then_some(file)
}

/// How a request's text becomes ids, and its output ids text.
#[derive(Clone)]
pub enum Tokenizer {
    StandIn,
    /// A model's tokenizer, with its chat template when the fleet has one.
    Model(Arc<tokenizers::Tokenizer>, Option<Arc<ChatTemplate>>),
}

impl Tokenizer {
    /// The ids of `text`, with the special tokens the tokenizer adds (a beginning-of-text
    /// token, typically).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::StandIn => Ok(stand_in::encode(text)),
            Tokenizer::Model(t, _) => encode(t, text, true),
        }
    }

    /// The ids of a conversation of (role, content) messages as the engine sees it: the
    /// model's chat template rendered, its text encoded without added special tokens (the
    /// template writes them), as vLLM does; without a template, the stand-in's role markers.
    pub fn chat<'a>(&self, messages: impl Iterator<Item = (&'a str, &'a str)> + Clone) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::Model(t, Some(template)) => encode(t, &template.render(messages)?, false),
            _ => self.encode(&stand_in::chat_prompt(messages)),
        }
    }

    /// A decoder for one request's output.
    pub fn decoder(&self) -> TextDecoder {
        TextDecoder { tokenizer: self.clone(), ids: Vec::new(), prefix: 0, read: 0 }
    }
}

/// Turns a request's output ids into text as they come. With a model's tokenizer a token's
/// text depends on its neighbours (leading spaces, bytes of one character split over
/// tokens), so each step decodes a window from a few tokens back (`prefix`) and emits what
/// the new tokens added to the window's text; text ending in an incomplete character
/// (U+FFFD) is held back until the tokens that complete it arrive (the rule of Hugging Face's
/// `DecodeStream`, vLLM and TGI).
pub struct TextDecoder {
    tokenizer: Tokenizer,
    ids: Vec<u32>,
    /// `ids[prefix..read]` were emitted already and give the next window its context;
    /// `ids[read..]` are waiting to be emitted.
    prefix: usize,
    read: usize,
}

impl TextDecoder {
    /// The text `ids` add to the output (possibly empty while a character is incomplete).
    pub fn push(&mut self, ids: &[u32]) -> String {
        let Tokenizer::Model(t, _) = &self.tokenizer else { return stand_in::decode(ids) };
        self.ids.extend_from_slice(ids);
        let before = decode(t, &self.ids[self.prefix..self.read]);
        let now = decode(t, &self.ids[self.prefix..]);
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return String::new();
        }
        let text = added(&before, &now);
        self.prefix = self.read;
        self.read = self.ids.len();
        text
    }

    /// What is still held back when the output ends (an incomplete character stays as
    /// U+FFFD).
    pub fn finish(&mut self) -> String {
        let Tokenizer::Model(t, _) = &self.tokenizer else { return String::new() };
        let before = decode(t, &self.ids[self.prefix..self.read]);
        let now = decode(t, &self.ids[self.prefix..]);
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        added(&before, &now)
    }
}

fn encode(t: &tokenizers::Tokenizer, text: &str, special: bool) -> Result<Vec<u32>, String> {
    t.encode(text, special).map(|e| e.get_ids().to_vec()).map_err(|e| format!("cannot tokenize: {e}"))
}

/// Ids the tokenizer has no token for (an engine's made-up tokens) decode to nothing.
fn decode(t: &tokenizers::Tokenizer, ids: &[u32]) -> String {
    t.decode(ids, true).unwrap_or_default()
}

/// `now` past its common prefix with `before`, cut at a character boundary.
fn added(before: &str, now: &str) -> String {
    let mut cut = before.bytes().zip(now.bytes()).take_while(|(a, b)| a == b).count();
    while !now.is_char_boundary(cut) {
        cut -= 1;
    }
    now[cut..].to_string()
}

/// The tokenizer of each model the fleet knows one for.
#[derive(Default)]
pub struct Tokenizers {
    by_model: RwLock<HashMap<String, Known>>,
}

struct Known {
    loaded: Loaded,
    /// Where it came from, for messages: a file, or the engine that sent it.
    source: String,
}

/// What [`Tokenizers::check`] found for an engine's report.
#[derive(Debug, PartialEq, Eq)]
pub enum Check {
    /// Nothing to do: the engine reports none, or the one the fleet has.
    Known,
    /// The fleet has none for this model: fetch it from the engine.
    Fetch,
}

impl Tokenizers {
    /// The tokenizer requests for `model` use.
    pub fn get(&self, model: &str) -> Tokenizer {
        let by_model = self.by_model.read().unwrap_or_else(|p| p.into_inner());
        by_model
            .get(model)
            .map_or(Tokenizer::StandIn, |k| Tokenizer::Model(k.loaded.tokenizer.clone(), k.loaded.chat.clone()))
    }

    /// The digest of the tokenizer the fleet has for `model`.
    pub fn sha256(&self, model: &str) -> Option<String> {
        let by_model = self.by_model.read().unwrap_or_else(|p| p.into_inner());
        by_model.get(model).map(|k| k.loaded.sha256.clone())
    }

    /// Whether an engine serving `model` with a tokenizer of digest `sha256` (empty: none)
    /// fits the fleet; an error names both tokenizers when it does not.
    pub fn check(&self, model: &str, sha256: &str) -> Result<Check, String> {
        if sha256.is_empty() {
            return Ok(Check::Known);
        }
        let by_model = self.by_model.read().unwrap_or_else(|p| p.into_inner());
        match by_model.get(model) {
            None => Ok(Check::Fetch),
            Some(k) if k.loaded.sha256 == sha256 => Ok(Check::Known),
            Some(k) => Err(format!(
                "its tokenizer for model `{model}` (SHA-256 {sha256}) is not the fleet's ({}, from {})",
                k.loaded.sha256, k.source
            )),
        }
    }

    /// Makes `loaded` the tokenizer of `model`, unless another one already is.
    pub fn insert(&self, model: &str, loaded: Loaded, source: String) -> Result<(), String> {
        let mut by_model = self.by_model.write().unwrap_or_else(|p| p.into_inner());
        match by_model.get(model) {
            Some(k) if k.loaded.sha256 != loaded.sha256 => Err(format!(
                "model `{model}` has two tokenizers: {} ({}) and {} ({source})",
                k.loaded.sha256, k.source, loaded.sha256
            )),
            Some(_) => Ok(()),
            None => {
                tracing::info!(%model, sha256 = %loaded.sha256, %source, "tokenizer in use");
                by_model.insert(model.to_string(), Known { loaded, source });
                Ok(())
            }
        }
    }
}

/// `MODEL=PATH` of `serve --tokenizer`.
pub fn parse_pin(arg: &str) -> Result<(String, PathBuf), String> {
    match arg.split_once('=') {
        Some((model, path)) if !model.is_empty() && !path.is_empty() => Ok((model.to_string(), PathBuf::from(path))),
        _ => Err(format!("`{arg}` is not MODEL=PATH (PATH: a tokenizer.json or a folder holding one)")),
    }
}

/// A word-level tokenizer of `words` words, `w0` to `w{words - 1}` (id N is `wN`, unknown
/// words `[UNK]`, id `words`), split on whitespace: a real `tokenizer.json` small enough to
/// write in a test.
#[cfg(test)]
pub fn word_level(words: u32) -> tokenizers::Tokenizer {
    use tokenizers::models::wordlevel::WordLevel;
    let vocab = (0..words).map(|i| (format!("w{i}"), i)).chain([("[UNK]".to_string(), words)]).collect();
    let model = WordLevel::builder().vocab(vocab).unk_token("[UNK]".into()).build().expect("a word-level model");
    let mut t = tokenizers::Tokenizer::new(model);
    t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::WhitespaceSplit));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(t: &tokenizers::Tokenizer) -> Loaded {
        parse(t.to_string(false).unwrap().into_bytes()).unwrap()
    }

    /// A byte-level BPE whose tokens are single bytes (no merges): a character of several
    /// UTF-8 bytes spans several tokens, as in GPT-2 and Llama 3's tokenizers.
    fn byte_level() -> tokenizers::Tokenizer {
        use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
        use tokenizers::models::bpe::{Vocab, BPE};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        let vocab: Vocab = alphabet.iter().enumerate().map(|(i, c)| (c.to_string(), i as u32)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, Vec::new()).build().expect("a BPE model");
        let mut t = tokenizers::Tokenizer::new(bpe);
        t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        t.with_decoder(Some(ByteLevelDecoder::default()));
        t
    }

    #[test]
    fn a_word_level_tokenizer_round_trips_through_its_json() {
        let t = Tokenizer::Model(loaded(&word_level(512)).tokenizer, None);
        assert_eq!(t.encode("w3 w511 w0").unwrap(), [3, 511, 0]);
        assert_eq!(t.encode("w3 nonsense").unwrap(), [3, 512], "unknown words are [UNK]");
        let mut d = t.decoder();
        assert_eq!(d.push(&[3]), "w3");
        assert_eq!(d.push(&[511, 0]), " w511 w0");
        assert_eq!(d.push(&[9999]), "", "an id outside the vocabulary decodes to nothing");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn a_character_split_over_tokens_is_held_back_until_it_is_whole() {
        let t = Tokenizer::Model(loaded(&byte_level()).tokenizer, None);
        let text = "né 🚀 ok";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte");
        let mut d = t.decoder();
        let mut chunks: Vec<String> = ids.iter().map(|&id| d.push(&[id])).collect();
        chunks.push(d.finish());
        assert_eq!(chunks.concat(), text);
        // "é" is two bytes: its first token emits nothing, its second the whole character.
        assert_eq!(chunks[1..3], ["", "é"]);
        assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "{chunks:?}");
        // A stream cut inside a character ends with what it has.
        let mut d = t.decoder();
        assert_eq!(d.push(&ids[..2]), "", "the window's text ends inside a character");
        assert_eq!(d.finish(), "n\u{FFFD}");
    }

    #[test]
    fn the_stand_in_serves_models_without_a_tokenizer_and_one_model_keeps_one_tokenizer() {
        let fleet = Tokenizers::default();
        assert!(matches!(fleet.get("m"), Tokenizer::StandIn));
        assert_eq!(fleet.get("m").encode("hello world").unwrap(), stand_in::encode("hello world"));
        let (a, b) = (loaded(&word_level(16)), loaded(&word_level(32)));
        assert_eq!(fleet.check("m", ""), Ok(Check::Known), "an engine without a tokenizer fits");
        assert_eq!(fleet.check("m", &a.sha256), Ok(Check::Fetch));
        fleet.insert("m", a.clone(), "engine e0".into()).unwrap();
        assert!(matches!(fleet.get("m"), Tokenizer::Model(..)));
        assert_eq!(fleet.check("m", &a.sha256), Ok(Check::Known));
        let err = fleet.check("m", &b.sha256).unwrap_err();
        assert!(err.contains(&b.sha256) && err.contains(&a.sha256) && err.contains("engine e0"), "{err}");
        let err = fleet.insert("m", b.clone(), "engine e1".into()).unwrap_err();
        assert!(err.contains("two tokenizers"), "{err}");
        fleet.insert("m", a, "engine e2".into()).unwrap();
        assert_eq!(fleet.check("other", &b.sha256), Ok(Check::Fetch), "tokenizers are per model");
    }

    #[test]
    fn bad_tokenizer_files_and_flags_are_named() {
        let dir = std::env::temp_dir().join(format!("fleetplane-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = load(&dir).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json") && err.contains("cannot read"), "{err}");
        std::fs::write(dir.join("tokenizer.json"), b"{\"model\": 3}").unwrap();
        let err = load(&dir).unwrap_err().to_string();
        assert!(err.contains("not a tokenizer.json"), "{err}");
        word_level(8).save(dir.join("tokenizer.json"), false).unwrap();
        let from_dir = load(&dir).unwrap();
        assert_eq!(from_dir.sha256, load(&dir.join("tokenizer.json")).unwrap().sha256);
        assert_eq!(in_model_dir(&dir), Some(dir.join("tokenizer.json")));
        assert_eq!(parse_pin("llama=/m/tokenizer.json"), Ok(("llama".into(), PathBuf::from("/m/tokenizer.json"))));
        assert!(parse_pin("llama").unwrap_err().contains("MODEL=PATH"));
        assert!(parse_pin("=x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
