//! llama.cpp's infill sampler (`llama_sampler_init_infill`, `"infill"` in a request's
//! `samplers`), which code-completion clients (llama.vim, llama.vscode) put in their chains: when
//! the tokens that end the answer are likely enough it keeps only them; otherwise it adds each
//! candidate's probability to a likelier candidate whose text it begins (or that begins it), and
//! keeps the candidates left with at least 0.2 of the mass, then those above 1 / (kept + 1).
//! The draw after it is from the survivors' own logits, as llama.cpp's `dist` draws; with no
//! text candidate left, the answer ends.

use std::collections::HashSet;

/// What the sampler reads of a vocabulary.
pub struct InfillVocab {
    /// Each token's text as the model writes it (empty for special tokens, as llama.cpp's
    /// `token_to_piece` without specials gives them).
    bytes: Vec<Vec<u8>>,
    /// The tokens that end an answer (llama.cpp's end-of-generation set).
    ends: HashSet<u32>,
    /// The token that ends an answer left without text candidates (llama.cpp's EOT, else EOS).
    end: u32,
}

impl InfillVocab {
    pub fn new(bytes: Vec<Vec<u8>>, ends: impl IntoIterator<Item = u32>, end: u32) -> Self {
        Self { bytes, ends: ends.into_iter().collect(), end }
    }

    /// The tokens that end an answer.
    pub fn ends(&self) -> impl Iterator<Item = u32> + '_ {
        self.ends.iter().copied()
    }

    fn bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }
}

impl std::fmt::Debug for InfillVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InfillVocab {{ tokens: {}, ends: {:?}, end: {} }}", self.bytes.len(), self.ends, self.end)
    }
}

/// One vocabulary per served model: two are the same when they are the same table.
impl PartialEq for InfillVocab {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

/// The candidates (token, logit) the sampler leaves, their logits as they were; `scale` is the
/// chain's 1 / temperature so far (the probabilities it reads are the softmax at it).
pub fn apply(mut c: Vec<(u32, f32)>, scale: f32, vocab: &InfillVocab) -> Vec<(u32, f32)> {
    if c.is_empty() {
        return c;
    }
    c.sort_by(|a, b| b.1.total_cmp(&a.1));
    let max = c[0].1;
    let mut p: Vec<f32> = c.iter().map(|x| ((x.1 - max) * scale).exp()).collect();
    let sum: f32 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= sum);
    let is_end = |t: u32| vocab.ends.contains(&t);
    let p_end: f32 = c.iter().zip(&p).filter(|(x, _)| is_end(x.0)).map(|(_, q)| q).sum();
    let p_text: f32 = c.iter().zip(&p).filter(|(x, _)| !is_end(x.0)).map(|(_, q)| q).sum();
    if 3.0 * p_end * c.len() as f32 > p_text {
        c.retain(|x| is_end(x.0));
        return c;
    }
    // A candidate that begins another's text gives its probability to the likelier of the two.
    let mut gone = vec![false; c.len()];
    for i0 in 0..c.len() {
        for i1 in 0..c.len() {
            if gone[i0] {
                break;
            }
            if i0 == i1 || gone[i1] {
                continue;
            }
            let (b0, b1) = (vocab.bytes(c[i0].0), vocab.bytes(c[i1].0));
            if !b0.is_empty() && b1.starts_with(b0) {
                let (dst, src) = if p[i1] > p[i0] { (i1, i0) } else { (i0, i1) };
                p[dst] += p[src];
                p[src] = 0.0;
                gone[src] = true;
            }
        }
    }
    let first: Vec<usize> = (0..c.len()).filter(|&i| !gone[i] && (is_end(c[i].0) || p[i] >= 0.2)).collect();
    let texts = first.iter().filter(|&&i| !is_end(c[i].0)).count();
    if texts == 0 {
        return vec![(vocab.end, 1.0)];
    }
    let sum: f32 = first.iter().map(|&i| p[i]).sum();
    let threshold = 1.0 / (texts + 1) as f32;
    first.into_iter().filter(|&i| is_end(c[i].0) || p[i] / sum >= threshold).map(|i| c[i]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token 0 ends answers (a special token: no text); 1 "re", 2 "return", 3 "ret", then
    /// texts that begin no other.
    fn vocab() -> InfillVocab {
        let bytes = ["", "re", "return", "ret", "x", "y", "a", "b", "c", "d"].iter().map(|s| s.as_bytes().to_vec()).collect();
        InfillVocab::new(bytes, [0], 0)
    }

    fn ids(c: &[(u32, f32)]) -> Vec<u32> {
        let mut v: Vec<u32> = c.iter().map(|x| x.0).collect();
        v.sort();
        v
    }

    #[test]
    fn likely_ends_leave_only_the_ends() {
        // p(end) 0.25 over 3 candidates: 3 x 0.25 x 3 > 0.75.
        let c = vec![(0, 0.25f32.ln()), (4, 0.5f32.ln()), (5, 0.25f32.ln())];
        assert_eq!(ids(&apply(c, 1.0, &vocab())), vec![0]);
    }

    #[test]
    fn prefixes_merge_into_the_likeliest_and_small_ones_go() {
        // "re" 0.3, "return" 0.25, "ret" 0.2, "x" 0.24, end 0.01: "re" takes "return" and "ret"
        // (0.75); "x" 0.24 passes 0.2, then falls below 1/3 of the 0.99 kept; the end stays.
        let c = vec![(1, 0.3f32.ln()), (2, 0.25f32.ln()), (3, 0.2f32.ln()), (4, 0.24f32.ln()), (0, 0.01f32.ln())];
        let left = apply(c, 1.0, &vocab());
        assert_eq!(ids(&left), vec![0, 1]);
        // The survivors keep their own logits (the draw is from them, as llama.cpp's dist).
        assert_eq!(left.iter().find(|x| x.0 == 1).unwrap().1, 0.3f32.ln());
    }

    /// llama.cpp's own sampler on candidates over SmolLM2's vocabulary (with FIM tokens), each
    /// token's text as its `token_to_piece` writes it
    /// (tests/reference/make_llama_cpp_infill_sampler_reference.py).
    #[test]
    fn leaves_what_llama_cpps_infill_sampler_leaves() {
        let reference: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/reference/llama-cpp-infill-sampler.json")).unwrap();
        let end = reference["end"].as_u64().unwrap() as u32;
        let cases = reference["cases"].as_array().unwrap();
        assert!(cases.len() >= 10);
        for case in cases {
            let pair = |x: &serde_json::Value| (x[0].as_u64().unwrap() as u32, x[1].as_f64().unwrap() as f32);
            let candidates: Vec<(u32, f32)> = case["candidates"].as_array().unwrap().iter().map(pair).collect();
            let top = candidates.iter().map(|c| c.0).max().unwrap().max(end) as usize;
            let mut bytes = vec![vec![]; top + 1];
            for (id, piece) in case["pieces"].as_object().unwrap() {
                bytes[id.parse::<usize>().unwrap()] = piece.as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
            }
            let ends = case["ends"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32);
            let vocab = InfillVocab::new(bytes, ends, end);
            let mut ours = apply(candidates, 1.0, &vocab);
            ours.sort_by_key(|c| c.0);
            let theirs: Vec<(u32, f32)> = case["left"].as_array().unwrap().iter().map(pair).collect();
            assert_eq!(ours, theirs, "{}", case["candidates"]);
        }
    }

    #[test]
    fn no_likely_text_ends_the_answer() {
        // Six texts at 1/6 each: none reaches 0.2, so the end token is the only candidate.
        let c: Vec<(u32, f32)> = (4..10).map(|t| (t, 0.0)).collect();
        assert_eq!(apply(c, 1.0, &vocab()), vec![(0, 1.0)]);
        // At a lower temperature (scale 10) the likeliest takes nearly all and stays alone.
        let c = vec![(4, 1.0), (5, 0.0), (6, 0.0)];
        assert_eq!(apply(c, 10.0, &vocab()), vec![(4, 1.0)]);
    }
}
