//! A sequence's output text and its stop rules: end-of-sequence ids, stop strings found across
//! token boundaries (the text that could still become a stop string is held back from the
//! stream), the token limit and the context limit.

use std::sync::Arc;

use crate::tokenizer::{TokenStream, Tokenizer};

/// When a sequence ends (besides cancellation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopRules {
    /// Ids that end the sequence when sampled (the id itself adds no text). Empty: none
    /// (`ignore_eos`).
    pub eos_ids: Vec<u32>,
    /// Strings that end the sequence where they first appear in the output; the output stops
    /// before them (OpenAI's `stop`, Anthropic's `stop_sequences`).
    pub strings: Vec<String>,
    /// Tokens to generate at most (`None`: until a stop or the context is full).
    pub max_tokens: Option<usize>,
}

/// Why a sequence ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id was sampled.
    Eos(u32),
    /// A stop string appeared in the output.
    StopString(String),
    /// `max_tokens` were generated.
    Length,
    /// The next token would not fit the model's context (`max_position_embeddings`).
    ContextFull,
    /// The client cancelled the request or went away.
    Cancelled,
    /// The backend failed running the sequence's step.
    Error(String),
}

impl FinishReason {
    /// OpenAI's `finish_reason`: `stop`, `length` (or `None` for a cancel or an error).
    pub fn openai(&self) -> Option<&'static str> {
        match self {
            FinishReason::Eos(_) | FinishReason::StopString(_) => Some("stop"),
            FinishReason::Length | FinishReason::ContextFull => Some("length"),
            FinishReason::Cancelled | FinishReason::Error(_) => None,
        }
    }

    /// Whether generation was stopped from outside (`max_tokens`, the context, a cancel, an
    /// error) rather than ended by the model (EOS, a stop string): how the output parser tells
    /// a cut tag from text ([`crate::server::parse::OutputParser::finish`]).
    pub fn cut(&self) -> bool {
        !matches!(self, FinishReason::Eos(_) | FinishReason::StopString(_))
    }
}

/// What one generated token does to the output.
#[derive(Debug, PartialEq, Eq)]
pub struct Step {
    /// Text now certain to be output (may be empty).
    pub text: String,
    /// Set when this token ends the sequence.
    pub finish: Option<FinishReason>,
}

/// The output text of one sequence under its stop rules.
pub struct Output {
    rules: StopRules,
    stream: Option<TokenStream<'static>>,
    /// Decoded text not yet emitted (a possible start of a stop string).
    held: String,
    generated: usize,
}

impl Output {
    /// Without a tokenizer there is no text: stop strings cannot match (the runtime refuses
    /// requests that give some).
    pub fn new(rules: StopRules, tokenizer: Option<&Arc<Tokenizer>>) -> Self {
        Self { rules, stream: tokenizer.map(Tokenizer::stream_shared), held: String::new(), generated: 0 }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Takes the token `id`, sampled as the sequence's `length`-th id (prompt included), in a
    /// model of `max_positions` positions.
    pub fn push(&mut self, id: u32, length: usize, max_positions: usize) -> Step {
        self.generated += 1;
        if self.rules.eos_ids.contains(&id) {
            return Step { text: self.flush(), finish: Some(FinishReason::Eos(id)) };
        }
        let mut piece = String::new();
        if let Some(s) = self.stream.as_mut() {
            // An id the tokenizer does not know adds no text (sampling is limited to its ids).
            if let Ok(Some(t)) = s.push(id) {
                piece = t;
            }
        }
        self.advance(&piece, length, max_positions)
    }

    /// Takes `id` as an end-of-sequence id whether or not the stop rules list it (the
    /// sequence's grammar ended there): it adds no text, and the held text is emitted.
    pub fn end_of_sequence(&mut self, id: u32) -> Step {
        self.generated += 1;
        Step { text: self.flush(), finish: Some(FinishReason::Eos(id)) }
    }

    /// Adds a token's text to the held text and applies the stop rules.
    fn advance(&mut self, piece: &str, length: usize, max_positions: usize) -> Step {
        self.held.push_str(piece);
        if let Some((at, stop)) = self.first_stop() {
            self.held.truncate(at);
            let text = std::mem::take(&mut self.held);
            self.stream = None;
            return Step { text, finish: Some(FinishReason::StopString(stop)) };
        }
        let finish = if self.rules.max_tokens.is_some_and(|m| self.generated >= m) {
            Some(FinishReason::Length)
        } else if length >= max_positions {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        if finish.is_some() {
            return Step { text: self.flush(), finish };
        }
        let keep = self.holdback();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Step { text, finish: None }
    }

    /// Everything not yet emitted: the held text and the detokenizer's tail.
    fn flush(&mut self) -> String {
        let mut text = std::mem::take(&mut self.held);
        if let Some(s) = self.stream.take() {
            text.push_str(&s.finish());
        }
        // The tail may complete a stop string.
        if let Some((at, _)) = self.first_stop_in(&text) {
            text.truncate(at);
        }
        text
    }

    /// The earliest stop string in the held text (position, string).
    fn first_stop(&self) -> Option<(usize, String)> {
        self.first_stop_in(&self.held)
    }

    fn first_stop_in(&self, text: &str) -> Option<(usize, String)> {
        self.rules.strings.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str()).map(|i| (i, s.clone()))).min_by_key(|(i, _)| *i)
    }

    /// Bytes at the end of the held text that are a proper prefix of some stop string (and so
    /// may not be emitted yet), on a character boundary.
    fn holdback(&self) -> usize {
        let h = &self.held;
        let mut keep = 0;
        for s in self.rules.strings.iter().filter(|s| !s.is_empty()) {
            // The longest suffix of `h` that is a prefix of `s`.
            for (i, _) in h.char_indices().rev().take_while(|(i, _)| h.len() - i < s.len()) {
                if s.starts_with(&h[i..]) {
                    keep = keep.max(h.len() - i);
                }
            }
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(strings: &[&str], max: Option<usize>) -> StopRules {
        StopRules { eos_ids: vec![7], strings: strings.iter().map(|s| s.to_string()).collect(), max_tokens: max }
    }

    /// Text pieces standing in for detokenized tokens, through the same rules as tokens.
    fn run(r: StopRules, pieces: &[&str]) -> (String, Option<FinishReason>) {
        let max = Some(pieces.len());
        let mut o = Output::new(StopRules { max_tokens: r.max_tokens.or(max), ..r }, None);
        let mut out = String::new();
        for (i, p) in pieces.iter().enumerate() {
            o.generated += 1;
            let step = o.advance(p, 10 + i, 1000);
            out.push_str(&step.text);
            if step.finish.is_some() {
                return (out, step.finish);
            }
        }
        (out, None)
    }

    #[test]
    fn a_stop_string_split_across_tokens_is_found_and_never_streamed() {
        let (out, fin) = run(rules(&["END"], None), &["hello E", "N", "D and more", "x"]);
        assert_eq!(out, "hello ");
        assert_eq!(fin, Some(FinishReason::StopString("END".into())));
        // A near miss is released once it can no longer become the stop string.
        let (out, fin) = run(rules(&["END"], None), &["hello E", "N", "d", "x"]);
        assert_eq!(out, "hello ENdx");
        assert_eq!(fin, Some(FinishReason::Length));
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let (out, fin) = run(rules(&["bb", "ab"], None), &["xa", "bb"]);
        assert_eq!(out, "x");
        assert_eq!(fin, Some(FinishReason::StopString("ab".into())));
    }

    #[test]
    fn holdback_respects_character_boundaries() {
        let mut o = Output::new(rules(&["é!"], None), None);
        o.held.push_str("caf\u{e9}");
        assert_eq!(o.holdback(), 2);
        o.held.push('x');
        assert_eq!(o.holdback(), 0);
    }

    #[test]
    fn eos_length_and_context_end_the_sequence() {
        let mut o = Output::new(rules(&[], Some(3)), None);
        assert_eq!(o.push(1, 10, 100).finish, None);
        assert_eq!(o.push(7, 11, 100).finish, Some(FinishReason::Eos(7)));
        let mut o = Output::new(rules(&[], Some(2)), None);
        assert_eq!(o.push(1, 10, 100).finish, None);
        assert_eq!(o.push(1, 11, 100).finish, Some(FinishReason::Length));
        let mut o = Output::new(rules(&[], None), None);
        assert_eq!(o.push(1, 99, 100).finish, None);
        assert_eq!(o.push(1, 100, 100).finish, Some(FinishReason::ContextFull));
    }
}
