"""Scores of text_similarity's metrics from the libraries OpenAI's graders name, for
tests/grpo.rs to compare against: rapidfuzz's fuzz.ratio, sacrebleu's sentence_bleu and
rouge-score's F-measures (each divided to [0, 1]).

    pip install rapidfuzz==3.14.6 sacrebleu==2.6.0 rouge-score==0.1.2
    python tests/reference/make_grader_reference.py > tests/reference/grader-similarity.json
"""
import json

from rapidfuzz import fuzz
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU

PAIRS = [
    ("The answer is 42.", "the answer is 42"),
    ("The cat sat on the mat, quietly.", "A cat was sitting on the mat."),
    ("1,000 people came at 3.5 p.m. to the pre-game show", "1,000 people arrived at 3.5 p.m. for the show"),
    ("Paris", "The capital of France is Paris."),
    ("short", "a much longer reference sentence with many words"),
    ("Hello, world! (twice) [x] {y} a/b", "Hello world twice x y a b"),
    ("nothing in common", "zebra"),
    ("same text, same text", "same text, same text"),
]

bleu = BLEU(effective_order=True)
scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
rows = []
for output, reference in PAIRS:
    r = scorer.score(reference, output)
    rows.append({
        "output": output,
        "reference": reference,
        "fuzzy_match": fuzz.ratio(output, reference) / 100,
        "bleu": bleu.sentence_score(output, [reference]).score / 100,
        "rouge_1": r["rouge1"].fmeasure,
        "rouge_2": r["rouge2"].fmeasure,
        "rouge_l": r["rougeL"].fmeasure,
    })
print(json.dumps(rows, indent=1))
