//! Which rows a tick runs: the one policy of the runtime, kept apart so it can be read and
//! tested alone.
//!
//! Policy (vLLM's chunked prefill with decode first, first come first served):
//! 1. every decoding sequence gets its one row, in admission order, while the token budget
//!    lasts;
//! 2. what is left of the budget goes to sequences still processing their prompts, in admission
//!    order: each takes up to `chunk` of its pending tokens, ending its step early at the next
//!    position where a snapshot is due (a stride multiple or a chat turn boundary), so the
//!    snapshot needs no extra step.
//!
//! Logits do not depend on how prompts are split or what shares a step (docs/numerics.md), so
//! the policy decides speed and fairness, never results.

/// What the scheduler needs to know of one resident sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqView {
    /// Tokens not yet fed (a prompt's remainder, or the one sampled token).
    pub pending: usize,
    /// Whether the sequence is generating (its pending token is a sampled one).
    pub decoding: bool,
    /// Tokens until the next position where a step must end (a snapshot is due), if any.
    pub until_boundary: Option<usize>,
}

/// Rows each sequence feeds this tick (0: none), for a step of at most `budget` rows and prompt
/// chunks of at most `chunk` tokens.
pub fn plan(seqs: &[SeqView], budget: usize, chunk: usize) -> Vec<usize> {
    let mut take = vec![0; seqs.len()];
    let mut left = budget;
    for (t, s) in take.iter_mut().zip(seqs) {
        if s.decoding && s.pending > 0 && left > 0 {
            *t = 1;
            left -= 1;
        }
    }
    for (t, s) in take.iter_mut().zip(seqs) {
        if s.decoding || s.pending == 0 || left == 0 {
            continue;
        }
        let mut n = s.pending.min(chunk.max(1)).min(left);
        if let Some(b) = s.until_boundary.filter(|&b| b > 0) {
            n = n.min(b);
        }
        *t = n;
        left -= n;
    }
    take
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode() -> SeqView {
        SeqView { pending: 1, decoding: true, until_boundary: None }
    }
    fn prompt(n: usize, b: Option<usize>) -> SeqView {
        SeqView { pending: n, decoding: false, until_boundary: b }
    }

    #[test]
    fn decode_rows_come_first_then_prompt_chunks_in_order() {
        let s = [prompt(700, None), decode(), prompt(50, None), decode()];
        assert_eq!(plan(&s, 512, 256), vec![256, 1, 50, 1]);
        // A small budget: decode rows, then what is left to the first prompt.
        assert_eq!(plan(&s, 10, 256), vec![8, 1, 0, 1]);
        // Fewer rows than decoding sequences: the first ones run.
        assert_eq!(plan(&s, 1, 256), vec![0, 1, 0, 0]);
    }

    #[test]
    fn a_chunk_ends_at_the_next_snapshot_position() {
        let s = [prompt(300, Some(17)), prompt(40, Some(0))];
        assert_eq!(plan(&s, 512, 256), vec![17, 40]);
    }
}
