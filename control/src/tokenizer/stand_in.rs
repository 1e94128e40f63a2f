//! The gateway's stand-in tokenizer, for models whose engines bring none (the cost-model
//! engine, and the CUDA engine on random weights without a `tokenizer.json`).
//!
//! Text is cut into pieces the way byte-pair encodings cut English (a word of up to four
//! characters with its leading space, longer words in four-character pieces, each punctuation
//! mark alone: about 4 characters per token), and each piece maps to a fixed id by hashing. Equal
//! texts give equal ids, so shared prefixes are cached; ids carry no meaning back, so output
//! tokens render as words of a small fixed vocabulary.

/// Ids 0..RESERVED are left to special tokens.
const RESERVED: u32 = 256;
pub const VOCAB: u32 = 32_000;

pub fn encode(text: &str) -> Vec<u32> {
    let mut ids = Vec::with_capacity(text.len() / 4 + 1);
    let mut piece = String::new();
    let flush = |piece: &mut String, ids: &mut Vec<u32>| {
        if !piece.is_empty() {
            ids.push(piece_id(piece));
            piece.clear();
        }
    };
    for c in text.chars() {
        if c.is_alphanumeric() {
            if piece.chars().filter(|c| c.is_alphanumeric()).count() == 4 {
                flush(&mut piece, &mut ids);
            }
            piece.push(c);
        } else if c.is_whitespace() {
            flush(&mut piece, &mut ids);
            piece.push(c);
        } else {
            flush(&mut piece, &mut ids);
            piece.push(c);
            flush(&mut piece, &mut ids);
        }
    }
    flush(&mut piece, &mut ids);
    ids
}

fn piece_id(piece: &str) -> u32 {
    let h = piece.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    RESERVED + (engine::ids::mix64(h) % u64::from(VOCAB - RESERVED)) as u32
}

const WORDS: [&str; 64] = [
    " the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " as", " was", " with", " be", " by",
    " on", " not", " he", " this", " are", " or", " his", " from", " at", " which", " but", " have", " an", " had",
    " they", " you", " were", " their", " one", " all", " we", " can", " her", " has", " there", " been", " if",
    " more", " when", " will", " would", " who", " so", " no", " cache", " token", " fleet", " prefill", " decode",
    " block", " engine", " route", " pool", ".", ",", " model", " GPU", " request", "\n",
];

/// Text of generated tokens.
pub fn decode(tokens: &[u32]) -> String {
    tokens.iter().map(|&t| WORDS[t as usize % WORDS.len()]).collect()
}

/// The prompt of a chat: each message under its role, then the assistant's turn.
pub fn chat_prompt<'a>(messages: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    let mut text = String::new();
    for (role, content) in messages {
        text.push_str("<|");
        text.push_str(role);
        text.push_str("|>\n");
        text.push_str(content);
        text.push('\n');
    }
    text.push_str("<|assistant|>\n");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_give_equal_ids_and_lengths_are_about_four_characters_a_token() {
        let a = encode("You are a helpful assistant. Summarise the following report.");
        let b = encode("You are a helpful assistant. Translate this.");
        assert_eq!(a[..8], b[..8]);
        let text = "Inference fleets serve long-context, agentic traffic at scale. ".repeat(20);
        let per_token = text.len() as f64 / encode(&text).len() as f64;
        assert!((2.5..6.0).contains(&per_token), "{per_token} characters per token");
        assert!(encode(&text).iter().all(|&t| (RESERVED..VOCAB).contains(&t)));
    }

    #[test]
    fn empty_text_has_no_tokens() {
        assert!(encode("").is_empty());
        assert_eq!(decode(&[0, 1]), " the of");
    }
}
