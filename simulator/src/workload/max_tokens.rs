//! What simulated clients ask as `max_tokens`: all that routers, the engines' load reports and
//! KV admission know of a request's output before it ends. A live gateway sees nothing more;
//! a trace also says where each output ended, which only the simulated engine may use.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

/// How the simulated clients bound their outputs (`[workload] max_tokens`, `--max-tokens`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "MaxTokensValue", into = "MaxTokensValue")]
pub enum MaxTokens {
    /// Each request asks for exactly the output the trace says it generated: output lengths
    /// known in advance, which no live router has (an upper bound on what routing can learn
    /// from them).
    #[default]
    Exact,
    /// Every client asks for at most this many tokens, and the output ends where the trace
    /// says (the model's end-of-sequence). An output the trace has longer counts as asked for
    /// in full, so that every setting replays the same work.
    Bound(u32),
}

impl MaxTokens {
    /// `(max_output_tokens, ends_after)` of a request whose trace output is `output` tokens
    /// (at least one: the token its prefill samples).
    pub fn apply(self, output: u32) -> (u32, Option<NonZeroU32>) {
        match self {
            MaxTokens::Bound(n) if n > output => (n, NonZeroU32::new(output.max(1))),
            _ => (output, None),
        }
    }
}

impl fmt::Display for MaxTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaxTokens::Exact => f.write_str("exact"),
            MaxTokens::Bound(n) => write!(f, "{n}"),
        }
    }
}

/// Why a `max_tokens` setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("max_tokens `{0}` is neither `exact` nor a number of tokens >= 1")]
pub struct BadMaxTokens(pub String);

impl FromStr for MaxTokens {
    type Err = BadMaxTokens;

    fn from_str(s: &str) -> Result<MaxTokens, BadMaxTokens> {
        if s == "exact" {
            return Ok(MaxTokens::Exact);
        }
        match s.parse::<u32>() {
            Ok(n) if n >= 1 => Ok(MaxTokens::Bound(n)),
            _ => Err(BadMaxTokens(s.to_string())),
        }
    }
}

/// The setting as written: `"exact"` or a number.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum MaxTokensValue {
    Tokens(i64),
    Word(String),
}

impl TryFrom<MaxTokensValue> for MaxTokens {
    type Error = BadMaxTokens;

    fn try_from(v: MaxTokensValue) -> Result<MaxTokens, BadMaxTokens> {
        match v {
            MaxTokensValue::Tokens(n) => n.to_string().parse(),
            MaxTokensValue::Word(w) => w.parse(),
        }
    }
}

impl From<MaxTokens> for MaxTokensValue {
    fn from(m: MaxTokens) -> MaxTokensValue {
        match m {
            MaxTokens::Exact => MaxTokensValue::Word("exact".into()),
            MaxTokens::Bound(n) => MaxTokensValue::Tokens(i64::from(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_above_the_output_ends_it_early_and_one_below_asks_for_the_whole_output() {
        assert_eq!(MaxTokens::Exact.apply(300), (300, None));
        assert_eq!(MaxTokens::Bound(4096).apply(300), (4096, NonZeroU32::new(300)));
        assert_eq!(MaxTokens::Bound(4096).apply(0), (4096, NonZeroU32::new(1)), "the prefill samples one");
        assert_eq!(MaxTokens::Bound(100).apply(300), (300, None));
        assert_eq!(MaxTokens::Bound(300).apply(300), (300, None));
    }

    #[test]
    fn it_reads_a_word_or_a_number_and_names_what_it_refuses() {
        #[derive(Deserialize)]
        struct W {
            max_tokens: MaxTokens,
        }
        let read = |s: &str| toml::from_str::<W>(s).map(|w| w.max_tokens);
        assert_eq!(read("max_tokens = \"exact\"").ok(), Some(MaxTokens::Exact));
        assert_eq!(read("max_tokens = 4096").ok(), Some(MaxTokens::Bound(4096)));
        for bad in ["max_tokens = 0", "max_tokens = -3", "max_tokens = \"lots\""] {
            let e = read(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("neither `exact` nor a number"), "{bad}: {e}");
        }
        assert_eq!("8192".parse::<MaxTokens>(), Ok(MaxTokens::Bound(8192)));
        assert!("0".parse::<MaxTokens>().is_err());
    }
}
