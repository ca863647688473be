"""Request lists for `kvpool bench serve`: pure functions of their arguments and a seed.

Same arguments and seed, same requests, byte for byte (string seeds go through SHA-512 in
`random.Random`, so `PYTHONHASHSEED` plays no part). Text is drawn from a fixed vocabulary of
common English words, each about one token for a BPE tokenizer, so `words` ~ prompt tokens.

- `random_requests`: independent prompts; no shared prefix beyond chance.
- `mixed_requests`: the same, a given fraction of them long (cold long prompts among short ones).
- `chat_requests`: multi-round conversations over a few long shared system prompts; round k
  carries rounds 1..k-1 (with a deterministic stand-in for the assistant's answers), ordered
  round by round so a conversation's earlier turn is sent before its later one.
- `docqa_requests`: long documents, each asked several questions, interleaved so a document
  comes back after the others.
- `trace_requests`: a Mooncake-format JSONL trace; one text block per hash id (equal ids give
  identical text), so the trace's prefix sharing carries over to the prompts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

# Common English words, single tokens for the usual BPE vocabularies (with a leading space).
VOCAB = tuple(dict.fromkeys("""
the of and to in is was for on with as by at from that this it be are or an have has had not
but all were when we there can more if no man out other so what time up about than into them
only some could these two may first then do any like my now over such our even most made after
also did many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work long here
get both between life being under never day same another know while last might us great old year
off come since against go came right used take three states himself few house use during without
again place around however home small found thought went say part once general high upon school
every does got united left number course war until always away something fact water though less
public put think almost hand enough far took head yet government system better set told nothing
night end why called did eyes find going look asked later knew point next program city business
give group toward young days let room president side social given present several order national
second possible rather per face among form important often things looked early white case john
become large big need four within felt along children saw best church ever least power development
light thing seemed family interest want members mind country area others done turned although open
god service certain kind problem began different door thus help sense means whole matter perhaps
itself york times law human line above name example action company hands local show whether five
history gave today either act feet across taken past quite anything seen having death experience
body word half really field week car words already themselves information tell college shall money
period held keep sure free seems real behind cannot miss political air question making office brought
whose special heard major problems ago became federal available known result street economic boy
""".split()))

QUESTIONS = ("What is the main point of the text above?", "Which name appears most often above?",
             "Summarize the second paragraph in one sentence.", "What happens at the end of the text?",
             "List three words that the text repeats.", "Who is the text written for?",
             "What question does the text leave open?", "Give the text a short title.")


@dataclass(frozen=True)
class Request:
    """One request of a workload: chat messages (role, content), an answer budget, and for a
    trace replay the arrival offset in seconds from the first request (else None)."""

    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    prompt_words: int
    arrival_s: float | None = None
    tag: str = ""

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    def prompt(self) -> str:
        """The text for a plain completions endpoint: a lone user turn as is, a dialogue as lines."""
        if len(self.messages) == 1:
            return self.messages[0][1]
        return "\n\n".join(f"{role}: {content}" for role, content in self.messages) + "\n\nassistant:"

    def salted(self, salt: str) -> Request:
        """The same request with `salt` in front of its first message (a new prefix, same shape)."""
        (role, content), *rest = self.messages
        return replace(self, messages=((role, salt + content), *rest))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def _span(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(max(low, 1), max(high, 1)))


def random_requests(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[Request]:
    """Prompts of `input_len` words (± `range_ratio`), answers of `output_len` tokens (± the same)."""
    if not 0 <= range_ratio < 1:
        raise ValueError("range_ratio must be in [0, 1)")
    rng = random.Random(f"random-{seed}")
    out = []
    for i in range(num_requests):
        n_in, n_out = _span(rng, input_len, range_ratio), _span(rng, output_len, range_ratio)
        out.append(Request(messages=(("user", words(rng, n_in)),), max_tokens=n_out, prompt_words=n_in,
                           tag=f"random {i}"))
    return out


def mixed_requests(num_requests: int, long_fraction: float, long_len: int, short_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[Request]:
    """Independent prompts, each long (`long_len` words) with probability `long_fraction`, else
    short (`short_len`), lengths ± `range_ratio`; answers of `output_len` tokens (± the same).
    Every prompt is new text: nothing is cached (the seed's "long cold prompts among short ones")."""
    if not 0 <= range_ratio < 1 or not 0 <= long_fraction <= 1:
        raise ValueError("range_ratio must be in [0, 1) and long_fraction in [0, 1]")
    rng = random.Random(f"mixed-{seed}")
    out = []
    for i in range(num_requests):
        long = rng.random() < long_fraction
        n_in = _span(rng, long_len if long else short_len, range_ratio)
        n_out = _span(rng, output_len, range_ratio)
        out.append(Request(messages=(("user", words(rng, n_in)),), max_tokens=n_out, prompt_words=n_in,
                           tag=f"{'long' if long else 'short'} {i}"))
    return out


def chat_requests(conversations: int, rounds: int, system_prompts: int, system_len: int, turn_len: int,
                  output_len: int, seed: int = 0) -> list[Request]:
    """`conversations` chats of `rounds` user turns; conversation c uses system prompt c mod
    `system_prompts`. Round k's request is the system prompt, turns 1..k-1 with their stand-in
    answers (`output_len` words each), and turn k; requests are ordered round-major."""
    rng = random.Random(f"chat-{seed}")
    systems = [f"You are assistant {s}. " + words(rng, system_len) for s in range(max(1, system_prompts))]
    turns = [[(words(rng, turn_len), words(rng, output_len)) for _ in range(rounds)] for _ in range(conversations)]
    out = []
    for k in range(rounds):
        for c in range(conversations):
            msgs: list[tuple[str, str]] = [("system", systems[c % len(systems)])]
            for user, answer in turns[c][:k]:
                msgs += [("user", user), ("assistant", answer)]
            msgs.append(("user", turns[c][k][0]))
            n_words = sum(len(text.split()) for _, text in msgs)
            out.append(Request(messages=tuple(msgs), max_tokens=output_len, prompt_words=n_words,
                               tag=f"chat c{c} r{k}"))
    return out


def docqa_requests(documents: int, doc_len: int, questions: int, output_len: int, seed: int = 0) -> list[Request]:
    """`documents` documents of `doc_len` words, each asked `questions` questions; the order is
    question-major (d0 q0, d1 q0, ..., d0 q1, ...), so each document repeats every `documents`."""
    rng = random.Random(f"docqa-{seed}")
    docs = [f"Document {d}.\n" + words(rng, doc_len) for d in range(documents)]
    out = []
    for q in range(questions):
        question = QUESTIONS[q % len(QUESTIONS)] + ("" if q < len(QUESTIONS) else f" (take {q // len(QUESTIONS)})")
        for d, doc in enumerate(docs):
            text = f"{doc}\n\nQuestion: {question}"
            out.append(Request(messages=(("user", text),), max_tokens=output_len, prompt_words=len(text.split()),
                               tag=f"docqa d{d} q{q}"))
    return out


MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in a Mooncake trace


def block_text(hash_id: int, block_words: int, seed: int = 0) -> str:
    """The text that stands for hash block `hash_id`: the same for the same id, wherever it appears."""
    return words(random.Random(f"block-{seed}-{hash_id}"), block_words)


def trace_requests(path: str | Path, *, limit: int | None = None, block_words: int = 32,
                   output_scale: float | None = None, max_output: int = 64, seed: int = 0) -> list[Request]:
    """Replay of a Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    Each full 512-token block becomes `block_words` words (its `block_text`); the last, partial
    block keeps the first words of its block text in proportion. Answers are `output_length`
    scaled by `output_scale` (default: the input's own scale, block_words/512), between 1 and
    `max_output`. `arrival_s` is the timestamp relative to the first line, in seconds.
    """
    scale = block_words / MOONCAKE_BLOCK_TOKENS if output_scale is None else output_scale
    out: list[Request] = []
    first_ms: float | None = None
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts, n_in, n_out, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from None
            first_ms = ts if first_ms is None else first_ms
            blocks = [block_text(h, block_words, seed) for h in ids]
            if blocks:
                tail_tokens = n_in - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)
                keep = min(block_words, max(1, math.ceil(tail_tokens / MOONCAKE_BLOCK_TOKENS * block_words)))
                blocks[-1] = " ".join(blocks[-1].split()[:keep])
            text = " ".join(blocks) or "Hello"
            out.append(Request(messages=(("user", text),), max_tokens=max(1, min(max_output, round(n_out * scale))),
                               prompt_words=len(text.split()), arrival_s=(ts - first_ms) / 1000.0,
                               tag=f"trace {lineno}"))
    return out
