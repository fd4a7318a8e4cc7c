//! A reasoning model's thinking, told apart from its answer: Qwen3, QwQ and DeepSeek-R1's
//! distills write `<think> ... </think>` before the answer (R1's templates open the block in
//! the prompt, so only its end is generated). [`ThinkSplit`] splits an answer's text as it
//! streams, exactly at the tags even when a tag arrives over several tokens, as vLLM's
//! `qwen3` and `deepseek_r1` reasoning parsers do; [`split`] does it for a whole text.

/// The tags around the thinking.
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// `--reasoning-parser`: how thinking is told apart, decided per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningChoice {
    /// Detected from the chat template: think tags where it writes them.
    Auto,
    /// `<think>` tags (vLLM's `qwen3` and `deepseek_r1` parsers).
    ThinkTags,
    /// Thinking stays in the answer's text.
    Off,
}

impl ReasoningChoice {
    /// The flag's values: vLLM's parser names, `auto` and `none`.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "auto" => Ok(Self::Auto),
            "qwen3" | "deepseek_r1" | "think" => Ok(Self::ThinkTags),
            "none" => Ok(Self::Off),
            other => Err(format!("--reasoning-parser {other:?}: expected auto, qwen3, deepseek_r1 or none")),
        }
    }

    /// Whether a model whose chat template is `template` (its source; None: no template) has
    /// its thinking split out.
    pub fn splits(self, template: Option<&str>) -> bool {
        match self {
            Self::Auto => template.is_some_and(|t| t.contains(THINK_END)),
            Self::ThinkTags => true,
            Self::Off => false,
        }
    }
}

/// Where a prompt (its rendered text's end, from the assistant's turn on) leaves the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptThinking {
    /// No think tags: the model may open a thinking block (Qwen3 thinking).
    Open,
    /// Inside a block the template opened (DeepSeek-R1's templates).
    Inside,
    /// After a block the template opened and closed: no thinking (Qwen3's
    /// `enable_thinking: false`).
    Closed,
}

impl PromptThinking {
    pub fn of(prompt_tail: &str) -> Self {
        match (prompt_tail.rfind(THINK_START), prompt_tail.rfind(THINK_END)) {
            (Some(open), Some(close)) if open < close => Self::Closed,
            (None, Some(_)) => Self::Closed,
            (Some(_), _) => Self::Inside,
            (None, None) => Self::Open,
        }
    }

    /// Whether the answer starts inside the thinking (else it may open it, or never will).
    pub fn inside(self) -> bool {
        self == Self::Inside
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing shown yet: the answer may open with `<think>`.
    Start,
    Thinking,
    Answer,
}

/// How long a reasoning model may think: once its thinking has `tokens` tokens, the next tokens
/// are `close_ids` (the template's end of a thinking block, e.g. `\n</think>\n\n`) instead of
/// sampled ones, and the answer follows: the end the model would write, written for it.
#[derive(Debug, Clone, PartialEq)]
pub struct ThinkingBudget {
    pub tokens: usize,
    pub close_ids: Vec<u32>,
}

/// Splits an answer's text into thinking and answer as it arrives.
#[derive(Debug, Clone)]
pub struct ThinkSplit {
    phase: Phase,
    /// Text that may be the start of a tag, held until the next piece tells.
    held: String,
    /// The answer thought (it began inside a block, or opened one).
    thought: bool,
}

/// One piece's share of thinking and of answer (either may be empty).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl ThinkSplit {
    /// `opened`: the prompt left the answer inside a thinking block ([`PromptThinking::Inside`]).
    pub fn new(opened: bool) -> Self {
        Self { phase: if opened { Phase::Thinking } else { Phase::Start }, held: String::new(), thought: opened }
    }

    /// The share of the next piece of text (and of what was held before it).
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.phase {
                Phase::Start => {
                    let lead = self.held.len() - self.held.trim_start().len();
                    let rest = &self.held[lead..];
                    if let Some(after) = rest.strip_prefix(THINK_START) {
                        self.held = after.to_string();
                        (self.phase, self.thought) = (Phase::Thinking, true);
                    } else if THINK_START.starts_with(rest) {
                        return out; // whitespace, or a tag begun: wait
                    } else {
                        self.phase = Phase::Answer;
                    }
                }
                Phase::Thinking => match self.held.find(THINK_END) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held = self.held[at + THINK_END.len()..].to_string();
                        self.phase = Phase::Answer;
                    }
                    None => {
                        let keep = partial_tag_len(&self.held, THINK_END);
                        let shown = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..shown]);
                        self.held.drain(..shown);
                        return out;
                    }
                },
                Phase::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// What is held at the end of the answer: no tag can complete any more.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Thinking => Split { reasoning: rest, content: String::new() },
            Phase::Start | Phase::Answer => Split { reasoning: String::new(), content: rest },
        }
    }

    /// Whether the thinking is over (its end tag seen, or the answer began without one).
    pub fn answering(&self) -> bool {
        self.phase == Phase::Answer
    }

    /// Whether the answer thought (it began inside a thinking block, or opened one).
    pub fn thought(&self) -> bool {
        self.thought
    }
}

/// A whole answer's thinking (None when it has none) and answer.
pub fn split(text: &str, opened: bool) -> (Option<String>, String) {
    let mut s = ThinkSplit::new(opened);
    let (a, b) = (s.push(text), s.finish());
    (s.thought().then(|| a.reasoning + &b.reasoning), a.content + &b.content)
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&n| text.ends_with(&tag[..n])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of cutting a text into pieces (here: at every byte pair) splits it as the whole
    /// text splits: tags spanning pieces are found, nothing is lost or shown twice.
    #[test]
    fn streamed_pieces_split_as_the_whole_text() {
        for (text, opened, reasoning, content) in [
            ("<think>\nplan it\n</think>\n\nHello!", false, Some("\nplan it\n"), "\n\nHello!"),
            ("  <think>a<b</think>c", false, Some("a<b"), "c"),
            ("plan it\n</think>\n\nHi", true, Some("plan it\n"), "\n\nHi"),
            ("Hello <think> there", false, None, "Hello <think> there"),
            ("<think>never ends", false, Some("never ends"), ""),
            ("<thin", false, None, "<thin"),
            ("", true, Some(""), ""),
        ] {
            let whole = split(text, opened);
            assert_eq!((whole.0.as_deref(), whole.1.as_str()), (reasoning, content), "{text:?}");
            for cut in 1..text.len() {
                let pieces: Vec<&str> = text.as_bytes().chunks(cut).map(|c| std::str::from_utf8(c).unwrap()).collect();
                let mut s = ThinkSplit::new(opened);
                let (mut r, mut c) = (String::new(), String::new());
                let mut parts: Vec<Split> = pieces.iter().map(|p| s.push(p)).collect();
                parts.push(s.finish());
                for p in parts {
                    r.push_str(&p.reasoning);
                    c.push_str(&p.content);
                }
                assert_eq!((r.as_str(), c.as_str()), (reasoning.unwrap_or(""), content), "{text:?} in pieces of {cut}");
            }
        }
    }

    #[test]
    fn the_prompt_and_the_template_decide() {
        assert_eq!(PromptThinking::of("<|im_start|>assistant\n<think>\n"), PromptThinking::Inside);
        assert_eq!(PromptThinking::of("<|im_start|>assistant\n<think>\n\n</think>\n\n"), PromptThinking::Closed);
        assert_eq!(PromptThinking::of("<|im_start|>assistant\n"), PromptThinking::Open);
        assert!(ReasoningChoice::Auto.splits(Some("... {{ '</think>' }} ...")));
        assert!(!ReasoningChoice::Auto.splits(Some("{{ messages }}")) && !ReasoningChoice::Auto.splits(None));
        assert!(ReasoningChoice::parse("deepseek_r1").unwrap().splits(None));
        assert!(ReasoningChoice::parse("mistral").unwrap_err().contains("--reasoning-parser"));
    }
}
