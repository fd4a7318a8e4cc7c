//! Fill in the middle (FIM): a code model trained for it reads the text before a gap and the
//! text after it between its FIM tokens (`<|fim_prefix|>` prefix `<|fim_suffix|>` suffix
//! `<|fim_middle|>`) and writes what goes in the gap. The tokens are found in the vocabulary by
//! the spellings llama.cpp's vocabulary loader recognises, and the prompt is laid out as
//! llama.cpp's server lays out `/infill`'s: prefix, suffix, middle (PSM) order, after the
//! repository-level context (Qwen2.5-Coder's `<|repo_name|>` and `<|file_sep|>` files).

use anyhow::Result;

use super::TextTokenizer;

/// Spellings of each FIM token, as llama.cpp's vocabulary loader looks them up (Qwen's first).
const PREFIX: &[&str] = &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>", "<|prefix|>"];
const SUFFIX: &[&str] = &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>", "<|suffix|>"];
const MIDDLE: &[&str] = &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>", "<|middle|>"];
const PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"];
const REPO: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FILE_SEP: &[&str] = &["<|file_sep|>"];
/// Tokens that end an answer whatever the model's configuration says, by llama.cpp's spellings
/// (its end-of-generation set).
const END_OF_GENERATION: &[&str] =
    &["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>"];

/// The tokens of a vocabulary spelled as llama.cpp's end-of-generation ones.
pub fn end_of_generation(id: impl Fn(&str) -> Option<u32>) -> Vec<u32> {
    END_OF_GENERATION.iter().filter_map(|s| id(s)).collect()
}

/// The repository's name in the context's first line (llama.cpp writes this one too: requests
/// carry no project name).
const REPO_NAME: &str = "myproject";
/// The file the gap is in, named in the context's last line (llama.cpp's placeholder likewise).
const CURRENT_FILE: &str = "filename";
/// A context file's name when its chunk gives none.
pub const DEFAULT_FILE_NAME: &str = "tmp";
/// What separates context chunks for a model without a file separator token.
const CHUNK_SEPARATOR: &str = "\n\n--- snippet ---\n\n";

/// The FIM tokens of a vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// Ends an answer: the model pads a finished middle with it.
    pub pad: Option<u32>,
    /// Starts the repository-level context (and, written by the model, ends an answer).
    pub repo: Option<u32>,
    /// Starts each file of that context (and, written by the model, ends an answer).
    pub file_sep: Option<u32>,
    /// The vocabulary's tokens spelled as llama.cpp's end-of-generation ones.
    pub end_of_generation: Vec<u32>,
}

impl FimTokens {
    /// The FIM tokens of a vocabulary (`id` looks a token's text up), or which of the three a
    /// FIM prompt needs are missing, in llama.cpp's words ("prefix token is missing. ...").
    pub fn find(id: impl Fn(&str) -> Option<u32>) -> Result<FimTokens, String> {
        let first = |spellings: &[&str]| spellings.iter().find_map(|s| id(s));
        let (prefix, suffix, middle) = (first(PREFIX), first(SUFFIX), first(MIDDLE));
        match (prefix, suffix, middle) {
            (Some(prefix), Some(suffix), Some(middle)) => Ok(FimTokens {
                prefix,
                suffix,
                middle,
                pad: first(PAD),
                repo: first(REPO),
                file_sep: first(FILE_SEP),
                end_of_generation: end_of_generation(&id),
            }),
            _ => {
                let parts = [("prefix", prefix), ("suffix", suffix), ("middle", middle)];
                let missing = parts.iter().filter(|(_, t)| t.is_none()).map(|(name, _)| format!("{name} token is missing."));
                Err(missing.collect::<Vec<_>>().join(" "))
            }
        }
    }

    /// The FIM tokens of a model's tokenizer.
    pub fn of(tokenizer: &TextTokenizer) -> Result<FimTokens, String> {
        Self::find(|t| tokenizer.token_id(t))
    }

    /// Tokens that end a FIM answer besides the model's end-of-sequence ones, as llama.cpp's
    /// end-of-generation set has them: the pad, the starts of another context part, and the
    /// tokens spelled as ends (`<|endoftext|>`, `<|im_end|>`, ...).
    pub fn ends(&self) -> Vec<u32> {
        [self.pad, self.repo, self.file_sep].into_iter().flatten().chain(self.end_of_generation.iter().copied()).collect()
    }
}

/// One file of the repository-level context (`/infill`'s `input_extra`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextFile {
    pub name: String,
    pub text: String,
}

/// The repository-level context before a FIM prompt, tokenised: `<|repo_name|>myproject`, then
/// each file as `<|file_sep|>` name and text, then `<|file_sep|>` for the current file; a model
/// without those tokens gets the files' texts apart by a plain-text separator.
pub fn context(tokenizer: &TextTokenizer, fim: &FimTokens, files: &[ContextFile]) -> Result<Vec<u32>> {
    let text = |s: &str| tokenizer.encode(s, false);
    let mut ids = vec![];
    if let Some(repo) = fim.repo {
        ids.push(repo);
        ids.extend(text(&format!("{REPO_NAME}\n"))?);
    }
    for file in files {
        match fim.file_sep {
            Some(sep) => {
                ids.push(sep);
                ids.extend(text(&format!("{}\n", file.name))?);
            }
            None => ids.extend(text(CHUNK_SEPARATOR)?),
        }
        ids.extend(text(&file.text)?);
    }
    if let Some(sep) = fim.file_sep {
        ids.push(sep);
        ids.extend(text(&format!("{CURRENT_FILE}\n"))?);
    }
    Ok(ids)
}

/// A FIM prompt's parts, tokenised.
#[derive(Debug, Default)]
pub struct Parts {
    /// What the tokenizer puts before any text (a BOS token, or nothing).
    pub start: Vec<u32>,
    /// The text before the gap.
    pub prefix: Vec<u32>,
    /// The text after the gap.
    pub suffix: Vec<u32>,
    /// Text that goes after the prefix, where the answer begins (`/infill`'s `prompt`).
    pub prompt: Vec<u32>,
    /// The repository-level context ([`context`]).
    pub context: Vec<u32>,
}

/// How much of each part `/infill` keeps, as llama.cpp's server cuts them: the prefix's last
/// 3/4 of `window` tokens, the suffix's first `window / 4 - 2 - prompt` tokens, and the
/// context's last `context_len - window + 2` tokens (its `n_ctx - n_batch - 2 · n_predict`, with
/// the server's `--n-predict` at its default, -1: a request's own `n_predict` does not count).
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// llama.cpp's batch size (`--batch-size`), which it sizes prefix and suffix by.
    pub window: usize,
    /// The most tokens a prompt and its answer may hold.
    pub context_len: usize,
}

/// llama-server's default `--batch-size`: the window `/infill` fits prefix and suffix into.
pub const INFILL_WINDOW: usize = 2048;

/// The FIM prompt: context, start, `<prefix>` prefix prompt `<suffix>` suffix `<middle>`, each
/// part cut to `window` when one is given.
pub fn prompt(fim: &FimTokens, mut parts: Parts, window: Option<Window>) -> Vec<u32> {
    let mut context_from = 0;
    if let Some(w) = window {
        let prefix_take = parts.prefix.len().min(3 * (w.window / 4));
        let suffix_take = parts.suffix.len().min((w.window / 4).saturating_sub(2 + parts.prompt.len()));
        let context_take = parts.context.len().min((w.context_len + 2).saturating_sub(w.window));
        parts.prefix.drain(..parts.prefix.len() - prefix_take);
        parts.suffix.truncate(suffix_take);
        context_from = parts.context.len() - context_take;
    }
    let mut ids = parts.context.split_off(context_from);
    ids.extend(parts.start);
    ids.push(fim.prefix);
    ids.extend(parts.prefix);
    ids.extend(parts.prompt);
    ids.push(fim.suffix);
    ids.extend(parts.suffix);
    ids.push(fim.middle);
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen_like() -> FimTokens {
        let vocab = [("<|fim_prefix|>", 10), ("<|fim_middle|>", 11), ("<|fim_suffix|>", 12), ("<|fim_pad|>", 13), ("<|file_sep|>", 14)];
        FimTokens::find(|t| vocab.iter().find(|(s, _)| *s == t).map(|(_, id)| *id)).unwrap()
    }

    #[test]
    fn tokens_are_found_by_any_known_spelling_and_missing_ones_named() {
        let fim = qwen_like();
        assert_eq!((fim.prefix, fim.suffix, fim.middle, fim.pad, fim.repo, fim.file_sep), (10, 12, 11, Some(13), None, Some(14)));
        assert_eq!(fim.ends(), vec![13, 14]);
        // StarCoder's and Granite's spellings; `<reponame>` is a repository token there.
        let granite = [("<fim_prefix>", 1), ("<fim_suffix>", 2), ("<fim_middle>", 3), ("<reponame>", 4)];
        let fim = FimTokens::find(|t| granite.iter().find(|(s, _)| *s == t).map(|(_, id)| *id)).unwrap();
        assert_eq!((fim.prefix, fim.suffix, fim.middle, fim.repo), (1, 2, 3, Some(4)));
        // A chat model's vocabulary with a repository token but no FIM tokens (SmolLM2's).
        let smollm2 = [("<reponame>", 4), ("<file_sep>", 5)];
        let why = FimTokens::find(|t| smollm2.iter().find(|(s, _)| *s == t).map(|(_, id)| *id)).unwrap_err();
        assert_eq!(why, "prefix token is missing. suffix token is missing. middle token is missing.");
        let only_middle_missing = [("<PRE>", 1), ("<SUF>", 2)];
        let why = FimTokens::find(|t| only_middle_missing.iter().find(|(s, _)| *s == t).map(|(_, id)| *id)).unwrap_err();
        assert_eq!(why, "middle token is missing.");
    }

    #[test]
    fn the_prompt_is_prefix_suffix_middle_after_the_context() {
        let fim = qwen_like();
        let parts = || Parts { start: vec![0], prefix: vec![1, 2, 3], suffix: vec![4, 5], prompt: vec![6], context: vec![7, 8] };
        assert_eq!(prompt(&fim, parts(), None), vec![7, 8, 0, 10, 1, 2, 3, 6, 12, 4, 5, 11]);
        let empty = Parts::default();
        assert_eq!(prompt(&fim, empty, None), vec![10, 12, 11]);
    }

    /// llama.cpp's cuts: the prefix keeps its end, the suffix its start, the context its end.
    #[test]
    fn a_window_keeps_the_prefix_end_the_suffix_start_and_the_context_end() {
        let fim = qwen_like();
        let parts = Parts {
            start: vec![],
            prefix: (100..120).collect(),
            suffix: (200..220).collect(),
            prompt: vec![1],
            context: (300..330).collect(),
        };
        // window 16: prefix 12, suffix 4 - 2 - 1 = 1; context 40 - 16 + 2 = 26.
        let ids = prompt(&fim, parts, Some(Window { window: 16, context_len: 40 }));
        let expected: Vec<u32> = (304..330).chain([10]).chain(108..120).chain([1, 12, 200, 11]).collect();
        assert_eq!(ids, expected);
        let tight = Parts { prefix: vec![1, 2], suffix: vec![3], prompt: vec![4, 5, 6], context: vec![9; 5], ..Parts::default() };
        let cut = prompt(&fim, tight, Some(Window { window: 8, context_len: 8 }));
        assert_eq!(cut, vec![9, 9, 10, 1, 2, 4, 5, 6, 12, 11]);
    }
}
