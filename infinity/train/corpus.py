"""The default corpus: English-like sentences from a small fixed grammar, generated
deterministically (a seeded random walk), so its text is ours to ship and every run trains on the
same bytes. `default/corpus.txt` is `generate()`'s output; a test keeps the two equal.

    python -m infinity.train.corpus > infinity/train/default/corpus.txt
"""

from __future__ import annotations

import random

_WORDS = {
    "Det": ["the", "a", "every", "one", "that", "this"],
    "Adj": ["small", "old", "quiet", "bright", "green", "patient", "heavy", "little", "cold",
            "gentle", "busy", "tired", "clever", "wooden", "silver", "early"],
    "Noun": ["cat", "dog", "river", "farmer", "child", "bird", "teacher", "garden", "boat",
             "mountain", "baker", "window", "lantern", "village", "horse", "letter", "road",
             "storm", "friend", "apple"],
    "Verb": ["sees", "follows", "finds", "carries", "watches", "helps", "paints", "remembers",
             "hears", "greets", "builds", "crosses"],
    "Intrans": ["sleeps", "sings", "waits", "runs", "rests", "laughs", "wanders", "shines",
                "listens"],
    "Adv": ["slowly", "quietly", "again", "today", "at dawn", "in the rain", "after supper",
            "once more", "without a sound", "near the bridge"],
    "Prep": ["near", "behind", "under", "beside", "across", "above", "past"],
    "Conj": ["and", "but", "while", "because", "so"],
}


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_WORDS["Det"])]
    if rng.random() < 0.6:
        words.append(rng.choice(_WORDS["Adj"]))
    words.append(rng.choice(_WORDS["Noun"]))
    if rng.random() < 0.2:
        words += [rng.choice(_WORDS["Prep"]), rng.choice(_WORDS["Det"]), rng.choice(_WORDS["Noun"])]
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    subject = _noun_phrase(rng)
    if rng.random() < 0.6:
        words = [subject, rng.choice(_WORDS["Verb"]), _noun_phrase(rng)]
    else:
        words = [subject, rng.choice(_WORDS["Intrans"])]
    if rng.random() < 0.4:
        words.append(rng.choice(_WORDS["Adv"]))
    return " ".join(words)


def sentence(rng: random.Random) -> str:
    """One sentence: a clause, sometimes joined to a second one, capitalised, with a full stop."""
    text = _clause(rng)
    if rng.random() < 0.3:
        text += f" {rng.choice(_WORDS['Conj'])} {_clause(rng)}"
    return text[0].upper() + text[1:] + "."


def generate(n_sentences: int = 3000, seed: int = 0) -> str:
    """`n_sentences` sentences, eight per paragraph, paragraphs separated by a blank line."""
    rng = random.Random(seed)
    lines = [sentence(rng) for _ in range(n_sentences)]
    paragraphs = [" ".join(lines[i:i + 8]) for i in range(0, len(lines), 8)]
    return "\n\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    print(generate(), end="")
