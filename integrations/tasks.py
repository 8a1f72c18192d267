"""Synthetic long-context tasks in the spirit of RULER (Hsieh et al. 2024), from scratch.

Every task hides facts in a haystack of filler text and asks for them back; a sample is
fitted to a target length in tokens of the model's tokenizer (by bisection on the number
of filler lines), and scored by the share of expected strings found in the answer
(RULER's ``string_match_all``). Tasks:

- ``passkey``: a number stated twice among filler lines (Mohtashami & Jaggi 2023);
- ``niah_number``, ``niah_word``, ``niah_uuid``: one "special magic" value for a key;
- ``niah_multikey``: four needles with different keys (three distractors), one asked;
- ``multivalue``: four values for one key, all asked;
- ``multiquery``: four keys asked at once;
- ``variable_tracking``: a chain ``VAR A = 12345, VAR B = VAR A, ...``, all names asked;
- ``common_words``: a numbered word list where ten words repeat often, the ten asked.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from vecstore.errors import InvalidValueError

__all__ = ["Sample", "TASKS", "make_sample", "score"]

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again.")
ADJECTIVES = ("amber ancient bitter brave bright calm clever cold crimson curious dark eager "
              "early fancy fierce gentle giant golden happy hidden hollow humble icy jolly "
              "kind lazy lively lonely loud lucky mellow misty narrow noble odd pale proud "
              "quiet rapid rare rough royal rusty shiny silent silver sleepy smooth solid "
              "spicy steady stormy sunny swift tender tiny vivid warm wild wise young").split()
NOUNS = ("anchor apple arrow badge barrel basket beacon bell bottle bridge candle canyon "
         "castle cloud comet compass crystal desert dragon drum eagle engine falcon feather "
         "forest fountain garden glacier hammer harbor helmet island jacket kettle ladder "
         "lantern lemon meadow mirror mountain needle ocean orchard otter parrot pebble "
         "pepper piano planet pocket rabbit river rocket saddle shadow shell spoon statue "
         "tiger tower tulip valley violin wagon whistle window wizard").split()
_CONSONANTS, _VOWELS = "bcdfghjklmnprstvwz", "aeiou"


@dataclass(frozen=True, slots=True)
class Sample:
    """One prompt and what its answer must contain.

    Attributes
    ----------
    task : str
        Task name (a key of :data:`TASKS`).
    length : int
        Target prompt length in tokens.
    seed : int
        Seed the sample was drawn with.
    prompt : str
        The full prompt text (chat template applied, answer prefix appended).
    answers : tuple[str, ...]
        Strings the answer must contain.
    max_new_tokens : int
        Tokens to generate.
    depth : float
        Relative position of the first needle in the haystack (0 = start).
    """

    task: str
    length: int
    seed: int
    prompt: str
    answers: tuple[str, ...]
    max_new_tokens: int
    depth: float


@dataclass(frozen=True, slots=True)
class _Draft:
    header: str
    needles: list[str]
    question: str
    prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    filler: Callable[[int], list[str]] | None = None  # lines for common_words


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = make(rng)
        if x not in out:
            out.append(x)
    return out


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


_VALUES: dict[str, Callable[[random.Random], str]] = {
    "number": _number, "word": _pseudo_word, "uuid": _uuid}


def _niah(kind: str, keys: int, values: int, asked: int) -> Callable[[random.Random], _Draft]:
    def draft(rng: random.Random) -> _Draft:
        names = _distinct(rng, _key, keys)
        make = _VALUES[kind]
        vals = {k: _distinct(rng, make, values if i < asked else 1) for i, k in enumerate(names)}
        needles = [f"One of the special magic {kind}s for {k} is: {v}."
                   for k in names for v in vals[k]]
        rng.shuffle(needles)
        query = names[:asked]
        what = f"special magic {kind}s" if values * asked > 1 else f"special magic {kind}"
        q = ", ".join(query[:-1]) + (" and " if asked > 1 else "") + query[-1]
        answers = tuple(v for k in query for v in vals[k])
        verb = "are" if len(answers) > 1 else "is"
        return _Draft(
            header=f"Some special magic {kind}s are hidden within the following text. Make "
                   "sure to memorize them. I will quiz you about them afterwards.",
            needles=needles, question=f"What are all the {what} for {q} mentioned in the "
                                      "provided text?",
            prefix=f"The {what} for {q} mentioned in the provided text {verb}:",
            answers=answers, max_new_tokens=12 + 12 * len(answers) * (3 if kind == "uuid" else 1))
    return draft


def _passkey(rng: random.Random) -> _Draft:
    key = str(rng.randint(10_000, 99_999))
    return _Draft(
        header="There is an important info hidden inside a lot of irrelevant text. Find it "
               "and memorize it. I will quiz you about the important information there.",
        needles=[f"The pass key is {key}. Remember it. {key} is the pass key."],
        question="What is the pass key?", prefix="The pass key is", answers=(key,),
        max_new_tokens=8)


def _variable_tracking(rng: random.Random) -> _Draft:
    names = _distinct(rng, lambda r: "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
                                             for _ in range(5)), 5)
    value = str(rng.randint(10_000, 99_999))
    needles = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
    return _Draft(
        header="Memorize and track the chain(s) of variable assignment hidden in the "
               "following text.",
        needles=needles, question=f"Find all variables that are assigned the value {value} "
                                  "in the text above.",
        prefix=f"Answer: According to the chain(s) of variable assignment in the text above, "
               f"5 variables are assigned the value {value}, they are:",
        answers=tuple(names), max_new_tokens=40)


def _common_words(rng: random.Random) -> _Draft:
    common = _distinct(rng, _pseudo_word, 10)
    seed = rng.random()

    def lines(n: int) -> list[str]:
        # ten words repeated up to 30 times each, every other word 3 times (RULER's cwe)
        r = random.Random(seed)
        reps = min(30, max(4, n // 20))
        words = [w for w in common for _ in range(reps)]
        rest = max(0, n - len(words))
        rare = [w for w in _distinct(r, _pseudo_word, rest // 3 + 11) if w not in common]
        words += [w for w in rare[: rest // 3 + 1] for _ in range(3)][:rest]
        r.shuffle(words)
        return [f"{i + 1}. {w}" for i, w in enumerate(words)]

    return _Draft(
        header="Below is a numbered list of words. In these words, some appear more often "
               "than others. Memorize the ones that appear most often.",
        needles=[], question="What are the 10 most common words in the above list?",
        prefix="Answer: The top 10 words that appear most often in the list are:",
        answers=tuple(common), max_new_tokens=64, filler=lines)


TASKS: dict[str, Callable[[random.Random], _Draft]] = {
    "passkey": _passkey,
    "niah_number": _niah("number", 1, 1, 1),
    "niah_word": _niah("word", 1, 1, 1),
    "niah_uuid": _niah("uuid", 1, 1, 1),
    "niah_multikey": _niah("number", 4, 1, 1),
    "multivalue": _niah("number", 1, 4, 1),
    "multiquery": _niah("number", 4, 1, 4),
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
}
"""Task name → generator of the task's needles, question and answers."""


def _render(tokenizer: PreTrainedTokenizerBase, draft: _Draft, body: list[str],
            chat: bool) -> str:
    content = f"{draft.header}\n\n" + "\n".join(body) + f"\n\n{draft.question}"
    if not chat:
        return f"{content} {draft.prefix}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         tokenize=False, add_generation_prompt=True)
    return f"{text}{draft.prefix} "


def _body(draft: _Draft, lines: int, rng: random.Random, depth: float) -> list[str]:
    if draft.filler is not None:
        return draft.filler(lines)
    body = [FILLER] * lines
    # needles at evenly spread depths starting at ``depth``, in order
    span = (1.0 - depth) / max(1, len(draft.needles))
    for i, needle in enumerate(draft.needles):
        at = round((depth + i * span * rng.uniform(0.5, 1.0)) * len(body))
        body.insert(min(at + i, len(body)), needle)
    return body


def make_sample(task: str, length: int, seed: int, tokenizer: PreTrainedTokenizerBase, *,
                chat: bool = True) -> Sample:
    """Draw one sample of ``task`` fitted to ``length`` tokens (prompt + answer).

    Raises
    ------
    InvalidValueError
        For an unknown task or a length too short for the task's needles.
    """
    if task not in TASKS:
        raise InvalidValueError(f"task: expected one of {sorted(TASKS)}, got {task!r}")
    rng = random.Random(f"{task}/{length}/{seed}")
    draft = TASKS[task](rng)
    depth = rng.uniform(0.1, 0.7)
    budget = length - draft.max_new_tokens

    def size(lines: int) -> tuple[int, str]:
        text = _render(tokenizer, draft, _body(draft, lines, random.Random(seed), depth), chat)
        return len(tokenizer(text, add_special_tokens=False).input_ids), text

    lo, hi = 1, 2
    while size(hi)[0] <= budget:
        lo, hi = hi, hi * 2
    if size(lo)[0] > budget:
        raise InvalidValueError(f"length: {length} tokens is too short for task {task!r}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid)[0] <= budget else (lo, mid)
    return Sample(task=task, length=length, seed=seed, prompt=size(lo)[1],
                  answers=draft.answers, max_new_tokens=draft.max_new_tokens, depth=depth)


def score(prediction: str, answers: tuple[str, ...]) -> float:
    """Share of ``answers`` found in ``prediction``, case-insensitively (RULER's metric).

    Examples
    --------
    >>> score("The pass key is 12345.", ("12345",))
    1.0
    >>> score("ABCDE and FGHIJ", ("abcde", "fghij", "klmno", "pqrst"))
    0.5
    """
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)
