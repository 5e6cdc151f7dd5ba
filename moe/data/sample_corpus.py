"""Generate the bundled sample in data/sample/ (deterministic: same bytes every run).

`python -m moe.data.sample_corpus [OUT_DIR]` writes
  train.txt       one document a line: short stories, arithmetic facts, lists, simple facts;
                  templated with repetition, so a tiny model learns it within a few hundred steps
  chat.jsonl      a handful of rows in the HuggingFaceH4/no_robots schema (prompt, prompt_id,
                  messages [role/content], category) plus a `completion` column
  tokenizer.json  byte-level BPE, vocab 512, trained on both, with <|endoftext|> (EOS), <|pad|>,
                  <|user|> and <|assistant|> as special tokens (+ tokenizer_config.json,
                  special_tokens_map.json so transformers.AutoTokenizer loads the directory)
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

from moe.data.tokenizer import EOS, PAD, save_tokenizer, train_bpe

SEED = 20240601
NUM_DOCS = 2600
VOCAB_SIZE = 512
SPECIAL_TOKENS = [EOS, PAD, "<|user|>", "<|assistant|>"]

NAMES = ["Tom", "Lily", "Sam", "Mia", "Ben", "Anna", "Max", "Lucy", "Tim", "Sue", "Jack", "Emma"]
ANIMALS = ["cat", "dog", "bird", "fish", "rabbit", "frog", "duck", "horse", "bear", "mouse"]
PLACES = ["park", "garden", "forest", "river", "house", "school", "beach", "farm", "town", "hill"]
THINGS = ["ball", "box", "hat", "book", "kite", "cup", "shell", "stone", "key", "boat", "cake", "toy"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "pink", "brown"]
SIZES = ["big", "small", "little", "tall", "round", "soft", "old", "new"]
FEELINGS = ["happy", "sad", "scared", "tired", "proud", "excited", "angry", "calm"]
VERBS = ["play", "run", "jump", "sing", "read", "swim", "dance", "draw", "walk", "climb"]
FRIENDS = ["mom", "dad", "friend", "sister", "brother", "teacher", "grandma", "neighbor"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
                "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
KINDS = {"animal": ANIMALS, "color": COLORS, "place": PLACES, "toy": ["ball", "kite", "doll", "boat", "top"]}


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def story(r: random.Random, name: str | None = None, animal: str | None = None) -> str:
    name, friend, animal = name or r.choice(NAMES), r.choice(FRIENDS), animal or r.choice(ANIMALS)
    place, thing, color, size = r.choice(PLACES), r.choice(THINGS), r.choice(COLORS), r.choice(SIZES)
    verb, feel, feel2 = r.choice(VERBS), r.choice(FEELINGS), r.choice(FEELINGS)
    opening = r.choice(["Once upon a time, there was", "One day, there was", "Long ago, there lived"])
    parts = [f"{opening} {article(size)} {animal} named {name}.",
             f"{name} liked to {verb} in the {place}.",
             f"One day, {name} found {article(color)} {thing} near the {place}.",
             f"{name} felt {feel}."]
    parts += r.choice([
        [f"{name} showed the {thing} to the {friend}.",
         f"The {friend} said, \"What a nice {thing}!\"",
         f"{name} and the {friend} played with the {thing} all day."],
        [f"But the {thing} fell into the {r.choice(['river', 'hole', 'grass', 'mud'])}.",
         f"{name} was {feel2}.", f"Then the {friend} came and helped {name} get the {thing} back."],
        [f"{name} wanted to give the {thing} to a friend.", f"{name} walked to the {r.choice(PLACES)}.",
         f"The friend smiled and said, \"Thank you, {name}!\""],
    ])
    parts.append(r.choice([
        f"From that day on, {name} was never {r.choice(['sad', 'alone', 'scared'])} again.",
        f"At night, {name} went home and slept well.", "The end."]))
    return " ".join(parts)


def arithmetic(r: random.Random) -> str:
    facts = []
    for _ in range(r.randint(3, 6)):
        a, b = r.randint(0, 10), r.randint(0, 10)
        kind = r.random()
        if kind < 0.35:
            facts.append(f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}.")
        elif kind < 0.7:
            facts.append(f"{a} + {b} = {a + b}.")
        elif kind < 0.85:
            hi, lo = max(a, b), min(a, b)
            facts.append(f"{hi} - {lo} = {hi - lo}.")
        else:
            facts.append(f"{a} times {b} is {a * b}.")
    return " ".join(facts)


def counting(r: random.Random) -> str:
    start = r.randint(0, 10)
    n = r.randint(4, 10)
    if r.random() < 0.5:
        seq = ", ".join(NUMBER_WORDS[start:start + n])
        return f"Let us count: {seq}."
    seq = ", ".join(str(i) for i in range(start, start + n * 2, 2))
    return f"Counting by twos: {seq}."


def calendar(r: random.Random) -> str:
    if r.random() < 0.5:
        i = r.randrange(7)
        return (f"{DAYS[i]} comes before {DAYS[(i + 1) % 7]}. {DAYS[(i + 1) % 7]} comes after {DAYS[i]}. "
                f"The days of the week are {', '.join(DAYS[:-1])} and {DAYS[-1]}.")
    i = r.randrange(12)
    return (f"{MONTHS[i]} comes before {MONTHS[(i + 1) % 12]}. There are twelve months in a year. "
            f"The first month is January and the last month is December.")


def facts(r: random.Random) -> str:
    kind = r.choice(sorted(KINDS))
    items = r.sample(KINDS[kind], k=min(len(KINDS[kind]), r.randint(3, 5)))
    lines = [f"{article(item).capitalize()} is {article(kind)}." for item in items]
    lines.append(f"Here is a list of {kind}s: {', '.join(items[:-1])} and {items[-1]}.")
    return " ".join(lines)


def corpus_lines(seed: int = SEED, num_docs: int = NUM_DOCS) -> list[str]:
    r = random.Random(seed)
    makers = [story] * 6 + [arithmetic] * 2 + [counting, calendar, facts]
    return [r.choice(makers)(r) for _ in range(num_docs)]


def chat_rows(seed: int = SEED) -> list[dict]:
    """~20 rows shaped like HuggingFaceH4/no_robots (with a system turn and multi-turn rows)."""
    r = random.Random(seed + 1)
    rows = []
    for i in range(20):
        a, b = r.randint(0, 10), r.randint(0, 10)
        name, animal, place = r.choice(NAMES), r.choice(ANIMALS), r.choice(PLACES)
        category, prompt, completion = [
            ("Open QA", f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
            ("Generation", f"Write a short story about a {animal} named {name}.",
             story(r, name, animal)),
            ("Brainstorm", f"Name three things you can find in a {place}.",
             f"In the {place} you can find {article(r.choice(THINGS))}, {article(r.choice(THINGS))} "
             f"and {article(r.choice(ANIMALS))}."),
            ("Classify", f"Is {article(animal)} an animal or a color?",
             f"{article(animal).capitalize()} is an animal."),
        ][i % 4]
        messages = [{"content": prompt, "role": "user"}, {"content": completion, "role": "assistant"}]
        if i % 5 == 0:
            messages.insert(0, {"content": "You are a kind helper who answers in short sentences.",
                                "role": "system"})
        if i % 7 == 3:
            messages += [{"content": "Thank you! Can you say it again?", "role": "user"},
                         {"content": f"Yes. {completion}", "role": "assistant"}]
        rows.append({"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(),
                     "messages": messages, "category": category, "completion": completion})
    return rows


def chat_training_text(row: dict) -> str:
    return "\n".join(m["content"] for m in row["messages"])


def write_sample(out_dir: str | Path) -> list[Path]:
    """Write train.txt, chat.jsonl and the tokenizer files into `out_dir`; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = corpus_lines()
    rows = chat_rows()
    (out / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    texts = lines + [chat_training_text(row) for row in rows]
    tok = train_bpe(texts, VOCAB_SIZE, SPECIAL_TOKENS, length=len(texts), show_progress=False)
    save_tokenizer(tok, out, eos=EOS, pad=PAD)
    return [out / n for n in ("train.txt", "chat.jsonl", "tokenizer.json", "tokenizer_config.json",
                              "special_tokens_map.json")]


if __name__ == "__main__":
    for path in write_sample(sys.argv[1] if len(sys.argv) > 1 else "data/sample"):
        print(f"{path}  {path.stat().st_size:,} bytes")
