//! How a generation ends: the one rule `serve` and `generate` share.
//!
//! A generation ends as [`FinishReason::Stop`] on an end-of-sequence token (unless the request
//! ignores it), on one of its stop token ids, or when its text reaches one of its stop strings;
//! and as [`FinishReason::Length`] when it has generated all it may. Token rules are decided
//! where tokens are sampled ([`finish_after`]); stop strings where tokens become text
//! ([`StopMatcher`]), which in `serve` is the HTTP layer: it tells the scheduler, which ends the
//! request as `stop` like any other (see `actors::RequestStream::stop`).
//!
//! [`StopMatcher`] owns the text between "decoded" and "safe to send": it holds back the end of
//! the stream while that end could still grow into a stop string, and ends the stream at the
//! first stop string to complete, cutting it and everything after it. It never emits text that
//! could still turn out to be part of a stop string, never splits a UTF-8 character, and knows
//! nothing of tokens.
//!
//! "First" means first to complete when reading left to right, the only order a stream can
//! honour; of stop strings completing at the same place, the longest is cut. Each push searches
//! only the held-back text plus the new chunk, and the held-back text is always shorter than the
//! longest stop string, so a push costs O(stops × (chunk + longest stop)) plus, when nothing
//! matched, O(stops × longest stop²) to find what to hold back.

use crate::sampling::SamplingParams;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` were generated, or the context is full.
    Length,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Whether `token` ends a generation with `params` by itself: one of its stop token ids, or
/// the model's end of sequence unless it ignores that.
pub fn is_stop_token(params: &SamplingParams, eos_token_ids: &[u32], token: u32) -> bool {
    params.stop_token_ids.contains(&token) || (!params.ignore_eos && eos_token_ids.contains(&token))
}

/// Whether a generation ends with `token`, its `generated`-th token, when it may generate at
/// most `max_new` (`max_tokens` already clipped to the room left in the context).
pub fn finish_after(
    params: &SamplingParams,
    eos_token_ids: &[u32],
    token: u32,
    generated: usize,
    max_new: usize,
) -> Option<FinishReason> {
    if is_stop_token(params, eos_token_ids, token) {
        Some(FinishReason::Stop)
    } else if generated >= max_new {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Ends a stream of text at the first of a set of stop strings.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Received but not yet emitted: a suffix that is a proper prefix of some stop string.
    held: String,
    finished: bool,
}

/// What one push lets through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutcome {
    /// Text safe to send now.
    pub text: String,
    /// Index, in the list given to [`StopMatcher::new`], of the stop string that just ended the
    /// stream; `text` is everything before it.
    pub matched: Option<usize>,
}

impl StopMatcher {
    /// A matcher for these stop strings. Empty strings are ignored (validation refuses them; one
    /// slipping through must not end every stream before its first character).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.to_vec(),
            held: String::new(),
            finished: false,
        }
    }

    /// Takes the next chunk of generated text. After a stop string matched, every push returns
    /// nothing.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.finished {
            return StopOutcome::default();
        }
        self.held.push_str(text);
        if let Some((at, index)) = self.first_match() {
            self.held.truncate(at);
            self.finished = true;
            let text = std::mem::take(&mut self.held);
            return StopOutcome {
                text,
                matched: Some(index),
            };
        }
        let safe_len = self.held.len() - self.partial_match_len();
        let still_held = self.held.split_off(safe_len);
        StopOutcome {
            text: std::mem::replace(&mut self.held, still_held),
            matched: None,
        }
    }

    /// Ends the stream, releasing the held-back text: it can no longer become a stop string.
    pub fn finish(&mut self) -> String {
        self.finished = true;
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string matched or [`StopMatcher::finish`] was called.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Byte offset in `held` and list index of the first stop string to complete. The first
    /// occurrence of a string is also its earliest-ending one, so one `find` per stop suffices.
    fn first_match(&self) -> Option<(usize, usize)> {
        let stops = self.stops.iter().enumerate().filter(|(_, s)| !s.is_empty());
        let found = stops.filter_map(|(index, stop)| {
            let at = self.held.find(stop.as_str())?;
            Some((at + stop.len(), at, index))
        });
        found.min().map(|(_, at, index)| (at, index))
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_match_len(&self) -> usize {
        let overlaps = self
            .stops
            .iter()
            .map(|stop| suffix_prefix_overlap(&self.held, stop));
        overlaps.max().unwrap_or(0)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`. Only prefixes
/// ending on a character boundary of `stop` count; such a prefix starts with a leading byte, so
/// `text` is split on a character boundary too.
fn suffix_prefix_overlap(text: &str, stop: &str) -> usize {
    let longest = text.len().min(stop.len().saturating_sub(1));
    let fits = |&len: &usize| stop.is_char_boundary(len) && text.ends_with(&stop[..len]);
    (1..=longest).rev().find(fits).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        StopMatcher::new(&stops)
    }

    fn emitted(text: &str) -> StopOutcome {
        StopOutcome {
            text: text.to_owned(),
            matched: None,
        }
    }

    fn stopped(text: &str, index: usize) -> StopOutcome {
        StopOutcome {
            text: text.to_owned(),
            matched: Some(index),
        }
    }

    #[test]
    fn tokens_end_a_generation_by_stop_id_eos_or_length() {
        let eos = [2];
        let params = SamplingParams {
            stop_token_ids: vec![7],
            ..SamplingParams::default()
        };
        assert_eq!(finish_after(&params, &eos, 5, 1, 3), None);
        assert_eq!(
            finish_after(&params, &eos, 7, 1, 3),
            Some(FinishReason::Stop)
        );
        assert_eq!(
            finish_after(&params, &eos, 2, 1, 3),
            Some(FinishReason::Stop)
        );
        assert_eq!(
            finish_after(&params, &eos, 5, 3, 3),
            Some(FinishReason::Length)
        );
        // A stop token on the last allowed token is a stop, not a length.
        assert_eq!(
            finish_after(&params, &eos, 7, 3, 3),
            Some(FinishReason::Stop)
        );

        let ignoring = SamplingParams {
            ignore_eos: true,
            ..params
        };
        assert_eq!(finish_after(&ignoring, &eos, 2, 1, 3), None);
        assert_eq!(
            finish_after(&ignoring, &eos, 7, 1, 3),
            Some(FinishReason::Stop)
        );
    }

    #[test]
    fn without_stops_text_passes_through_unheld() {
        let mut stops = matcher(&[]);
        assert_eq!(stops.push("hel"), emitted("hel"));
        assert_eq!(stops.push("lo"), emitted("lo"));
        assert_eq!(stops.finish(), "");

        let mut empty_only = matcher(&[""]);
        assert_eq!(empty_only.push("hi"), emitted("hi"));
    }

    #[test]
    fn partial_match_is_held_until_it_fails() {
        let mut stops = matcher(&["</s>"]);
        assert_eq!(stops.push("ab</"), emitted("ab"));
        assert_eq!(stops.push("x"), emitted("</x"));
        assert_eq!(stops.push("<"), emitted(""));
        assert_eq!(stops.finish(), "<");
        assert!(stops.is_finished());
    }

    #[test]
    fn stop_spanning_several_pushes_cuts_before_it() {
        let mut stops = matcher(&["STOP"]);
        assert_eq!(stops.push("abS"), emitted("ab"));
        assert_eq!(stops.push("T"), emitted(""));
        assert_eq!(stops.push("O"), emitted(""));
        assert_eq!(stops.push("Pyz"), stopped("", 0));
        assert_eq!(stops.push("more"), emitted(""));
        assert_eq!(stops.finish(), "");
    }

    #[test]
    fn stop_inside_one_push_drops_the_rest() {
        let mut stops = matcher(&["\n\n"]);
        assert_eq!(stops.push("one\n"), emitted("one"));
        assert_eq!(stops.push("two\n\nthree"), stopped("\ntwo", 0));
    }

    #[test]
    fn overlapping_stops_end_at_the_first_to_complete() {
        let mut stops = matcher(&["abc", "bcd"]);
        assert_eq!(stops.push("xab"), emitted("x"));
        assert_eq!(stops.push("cd"), stopped("", 0));

        // "bcd" completes before "abcde" could, even within one push.
        let mut stops = matcher(&["abcde", "bcd"]);
        assert_eq!(stops.push("zabcdef"), stopped("za", 1));

        // Both complete at once: the longer one is cut whole.
        let mut stops = matcher(&["bcd", "abcd"]);
        assert_eq!(stops.push("zab"), emitted("z"));
        assert_eq!(stops.push("cd"), stopped("", 1));
    }

    #[test]
    fn hold_back_keeps_the_longest_possible_start() {
        let mut stops = matcher(&["aab"]);
        assert_eq!(stops.push("xaa"), emitted("x"));
        assert_eq!(stops.push("a"), emitted("a"));
        assert_eq!(stops.push("b"), stopped("", 0));
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let mut stops = matcher(&["é!"]);
        assert_eq!(stops.push("café"), emitted("caf"));
        assert_eq!(stops.push("?"), emitted("é?"));

        // "😁" shares its first three bytes with "😀": no partial match on bytes alone.
        let mut stops = matcher(&["😀x"]);
        assert_eq!(stops.push("a😁"), emitted("a😁"));
        assert_eq!(stops.push("😀"), emitted(""));
        assert_eq!(stops.push("y"), emitted("😀y"));

        let mut stops = matcher(&["→end"]);
        assert_eq!(stops.push("go→"), emitted("go"));
        assert_eq!(stops.push("en"), emitted(""));
        assert_eq!(stops.push("d→"), stopped("", 0));
    }

    /// The text as a reader going left to right would cut it: before the first stop string to
    /// complete, the longest of those completing at the same place.
    fn cut_at_first_stop<'a>(text: &'a str, stops: &[String]) -> (&'a str, bool) {
        let ends = text.char_indices().map(|(at, c)| at + c.len_utf8());
        for end in ends {
            let completing = stops.iter().filter(|s| text[..end].ends_with(s.as_str()));
            if let Some(longest) = completing.map(String::len).max() {
                return (&text[..end - longest], true);
            }
        }
        (text, false)
    }

    fn text_from(alphabet: &'static [char], max_len: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(proptest::sample::select(alphabet), 0..max_len)
            .prop_map(|chars| chars.into_iter().collect())
    }

    const ALPHABET: &[char] = &['a', 'b', 'é', '€', '😀', '😁'];

    proptest! {
        #[test]
        fn chunked_stream_equals_text_cut_at_first_stop(
            text in text_from(ALPHABET, 40),
            stops in proptest::collection::vec(text_from(ALPHABET, 4), 0..4),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..10),
        ) {
            let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
            let boundaries: Vec<usize> = text.char_indices().map(|(at, _)| at).collect();
            let mut cuts: Vec<usize> = if boundaries.is_empty() {
                Vec::new()
            } else {
                cuts.iter().map(|cut| boundaries[cut.index(boundaries.len())]).collect()
            };
            cuts.sort_unstable();
            cuts.push(text.len());

            let mut matcher = StopMatcher::new(&stops);
            let (mut streamed, mut matched, mut start) = (String::new(), false, 0);
            for cut in cuts {
                let outcome = matcher.push(&text[start..cut]);
                streamed.push_str(&outcome.text);
                matched |= outcome.matched.is_some();
                start = cut;
            }
            streamed.push_str(&matcher.finish());

            let (expected, expect_match) = cut_at_first_stop(&text, &stops);
            prop_assert_eq!(streamed, expected);
            prop_assert_eq!(matched, expect_match);
        }
    }
}
