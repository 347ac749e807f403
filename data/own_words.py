"""Every IFEval constraint type, in the project's own words: what `data/instructions.py` builds its prompts from.

The checker library's own instruction texts are IFEval's: prompts built with them shared a 13-word span with an
IFEval test prompt (499 of the 2,000 bundled before issue 61), which the data stage now refuses. Here each type has
four wordings written for this project, with the arguments its checker reads (`if_verifiable.ifeval`, IFEval's
checkers, the same ones the reward and the benchmark use), drawn from ranges a short answer can meet.
`constraint(type, rng, request, held_out)` returns one wording and its arguments; the last wording of each type is
kept for held-out prompts. `TYPES` lists what is covered (all 25 of IFEval's). IFBench's types are never covered:
IFBench measures transfer."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese", "pl": "Polish"}
"""Languages for `language:response_language` (ISO 639-1, as the checker's language detector names them)."""
KEYWORDS = tuple(
    "window garden river ticket lantern pencil harbour blanket orchard compass "
    "meadow kettle mirror ladder basket candle bridge pillow market violin".split()
)
"""Everyday words a keyword constraint names (any of them fits any request)."""
CLOSINGS = (
    "That is all for now.",
    "Thanks for reading!",
    "Let me know what you think.",
    "Hope this helps.",
    "Talk soon.",
)
"""End phrases for `startend:end_checker`."""
RELATIONS = {"less than": ("fewer than", "under"), "at least": ("at least", "no fewer than")}
"""The checker's relation and the words ours say it with."""


@dataclass(frozen=True)
class Kind:
    """One constraint type: its wordings (`str.format` templates) and what fills them: `draw(rng, request)` gives the
    template's fields and the arguments the checker reads."""

    texts: tuple[str, ...]
    draw: Callable[[random.Random, str], tuple[dict[str, Any], dict[str, Any]]] = lambda rng, request: ({}, {})


def _relation(rng: random.Random) -> tuple[str, str]:
    relation = rng.choice(tuple(RELATIONS))
    return relation, rng.choice(RELATIONS[relation])


def _counted(low: int, high: int, name: str, relation_name: str, choose: Callable | None = None):
    """A draw for "<relation> N" constraints: the number `name`, the relation `relation_name`, `choose`'s fields."""

    def draw(rng: random.Random, request: str) -> tuple[dict[str, Any], dict[str, Any]]:
        count, (relation, said) = rng.randint(low, high), _relation(rng)
        extra = choose(rng) if choose else {}
        return {"n": count, "said": said, **extra}, {name: count, relation_name: relation, **extra}

    return draw


def _two_words(name: str):
    def draw(rng: random.Random, request: str) -> tuple[dict[str, Any], dict[str, Any]]:
        a, b = rng.sample(KEYWORDS, 2)
        return {"a": a, "b": b}, {name: [a, b]}

    return draw


def _number(low: int, high: int, name: str):
    def draw(rng: random.Random, request: str) -> tuple[dict[str, Any], dict[str, Any]]:
        count = rng.randint(low, high)
        return {"n": count}, {name: count}

    return draw


def _language(rng: random.Random, request: str) -> tuple[dict[str, Any], dict[str, Any]]:
    code = rng.choice(tuple(LANGUAGES))
    return {"name": LANGUAGES[code]}, {"language": code}


def _nth_paragraph(rng: random.Random, request: str) -> tuple[dict[str, Any], dict[str, Any]]:
    count = rng.randint(2, 4)
    nth, word = rng.randint(1, count), rng.choice(("today", "first", "also", "finally", "still"))
    return {"n": count, "k": nth, "w": word}, {"num_paragraphs": count, "nth_paragraph": nth, "first_word": word}


def _sections(rng: random.Random, request: str) -> tuple[dict[str, Any], dict[str, Any]]:
    count, name = rng.randint(2, 4), rng.choice(("Section", "Part", "Step"))
    return {"n": count, "s": name}, {"section_spliter": name, "num_sections": count}


def _one_of(field: str, values: tuple[str, ...], name: str):
    def draw(rng: random.Random, request: str) -> tuple[dict[str, Any], dict[str, Any]]:
        value = rng.choice(values)
        return {field: value}, {name: value}

    return draw


KINDS: dict[str, Kind] = {
    "keywords:existence": Kind(
        (
            "Work the words '{a}' and '{b}' into your reply.",
            "Somewhere in your answer, use both '{a}' and '{b}'.",
            "Make sure '{a}' and '{b}' each appear in what you write.",
            "Include the two words '{a}' and '{b}' at least once each.",
        ),
        _two_words("keywords"),
    ),
    "keywords:frequency": Kind(
        (
            "Use the word '{keyword}' {said} {n} times.",
            "The word '{keyword}' should show up {said} {n} times in your reply.",
            "Count your uses of '{keyword}': {said} {n}.",
            "Let '{keyword}' appear {said} {n} times.",
        ),
        _counted(1, 3, "frequency", "relation", lambda rng: {"keyword": rng.choice(KEYWORDS)}),
    ),
    "keywords:forbidden_words": Kind(
        (
            "Leave out the words '{a}' and '{b}' entirely.",
            "Do not write '{a}' or '{b}' anywhere in the reply.",
            "Avoid the words '{a}' and '{b}'.",
            "Neither '{a}' nor '{b}' may appear in your answer.",
        ),
        _two_words("forbidden_words"),
    ),
    "keywords:letter_frequency": Kind(
        (
            "The letter '{letter}' should appear {said} {n} times in your reply.",
            "Use the letter '{letter}' {said} {n} times.",
            "Keep count of the letter '{letter}': {said} {n} times in all.",
            "Write so that '{letter}' occurs {said} {n} times.",
        ),
        _counted(2, 8, "let_frequency", "let_relation", lambda rng: {"letter": rng.choice("abcdeghilmnoprstuw")}),
    ),
    "language:response_language": Kind(
        (
            "Reply only in {name}; no other language.",
            "Write the whole answer in {name}.",
            "Answer in {name} from start to finish.",
            "Everything you write should be in {name}.",
        ),
        _language,
    ),
    "length_constraints:number_sentences": Kind(
        (
            "Keep it to {said} {n} sentences.",
            "Write {said} {n} sentences.",
            "Your reply should have {said} {n} sentences.",
            "Say it in {said} {n} sentences.",
        ),
        _counted(2, 6, "num_sentences", "relation"),
    ),
    "length_constraints:number_paragraphs": Kind(
        (
            "Write exactly {n} paragraphs and put a line with *** between each two of them.",
            "Give {n} paragraphs in all, split from each other by the markdown divider ***.",
            "Use {n} paragraphs, with *** on its own line between them.",
            "Break the reply into {n} paragraphs, with a line holding only *** between one and the next.",
        ),
        _number(2, 4, "num_paragraphs"),
    ),
    "length_constraints:number_words": Kind(
        (
            "Use {said} {n} words.",
            "The reply should run to {said} {n} words.",
            "Write {said} {n} words in total.",
            "Aim for {said} {n} words.",
        ),
        _counted(10, 60, "num_words", "relation"),
    ),
    "length_constraints:nth_paragraph_first_word": Kind(
        (
            "Write {n} paragraphs separated by blank lines; paragraph number {k} must begin with the word '{w}'.",
            "Give {n} paragraphs, each apart from the next by an empty line, and start paragraph {k} with '{w}'.",
            "Your answer has {n} paragraphs with a blank line between them, and the word '{w}' opens paragraph {k}.",
            "Compose {n} paragraphs with an empty line after each; the first word of paragraph {k} is '{w}'.",
        ),
        _nth_paragraph,
    ),
    "detectable_content:number_placeholders": Kind(
        (
            "Leave {n} or more blanks for the reader to fill, each in square brackets, like [name].",
            "Include at least {n} fill-in fields written in square brackets, such as [date].",
            "Put {n} or more placeholders in square brackets (for example [place]) in the text.",
            "Add {n} or more square-bracket slots to fill in later, such as [address].",
        ),
        _number(1, 3, "num_placeholders"),
    ),
    "detectable_content:postscript": Kind(
        (
            "Close with an afterthought that begins with {m}",
            "Finish by adding a note that starts with {m}",
            "After the main text, add a short note beginning {m}",
            "End with a short extra note that opens with {m}",
        ),
        _one_of("m", ("P.S.", "P.P.S"), "postscript_marker"),
    ),
    "detectable_format:number_bullet_lists": Kind(
        (
            "Answer as a list of exactly {n} markdown bullets, each line starting with '* '.",
            "Give {n} points, no more and no fewer, as markdown bullets ('* ' at the start of each).",
            "Lay the answer out as {n} bullet points written with '* '.",
            "Reply with {n} bullets in markdown, each beginning '* ', and nothing more in list form.",
        ),
        _number(2, 5, "num_bullets"),
    ),
    "detectable_format:constrained_response": Kind(
        (
            "End by choosing one of these lines, word for word: 'My answer is yes.', 'My answer is no.' or 'My "
            "answer is maybe.'",
            "Reply with one of 'My answer is yes.', 'My answer is no.' or 'My answer is maybe.' and nothing else.",
            "Pick one reply, copied exactly: 'My answer is yes.', 'My answer is no.', 'My answer is maybe.'",
            "Answer only with 'My answer is yes.', 'My answer is no.' or 'My answer is maybe.'",
        )
    ),
    "detectable_format:number_highlighted_sections": Kind(
        (
            "Mark {n} or more parts in italics with single asterisks, like *this part*.",
            "Highlight at least {n} phrases by wrapping each in asterisks, as in *key idea*.",
            "Emphasise {n} or more bits of the text with *asterisks around them*.",
            "Put *asterisks* around {n} or more words or phrases you want to stress.",
        ),
        _number(1, 3, "num_highlights"),
    ),
    "detectable_format:multiple_sections": Kind(
        (
            "Split the reply into {n} numbered parts, each headed '{s} 1', '{s} 2' and so on.",
            "Organise the answer as {n} blocks whose headings are '{s}' followed by the block's number.",
            "Give {n} sections, labelled '{s} 1' up to '{s} {n}'.",
            "Divide your reply into {n} parts, each starting with a line '{s} X' where X is its number.",
        ),
        _sections,
    ),
    "detectable_format:json_format": Kind(
        (
            "Return the whole reply as valid JSON.",
            "Format everything you write as one JSON object; you may put it in a markdown code block.",
            "The output must parse as JSON, from the first character to the last.",
            "Write your whole response as JSON and nothing else.",
        )
    ),
    "detectable_format:title": Kind(
        (
            "Start with a title in double angle brackets, like <<A Good Title>>.",
            "Give the reply a title wrapped in << and >>.",
            "Put a heading at the top between double angle brackets, for example <<My Note>>.",
            "Head your reply with a title inside << and >>, such as <<Morning Notes>>.",
        )
    ),
    "combination:two_responses": Kind(
        (
            "Give two different answers, separated by a line of six asterisks (******).",
            "Write two versions that differ from each other, with ****** between them.",
            "Offer two distinct replies and put six asterisks, ******, between the first and the second.",
            "Write one answer, then a line of ******, then a second answer that is different.",
        )
    ),
    "combination:repeat_prompt": Kind(
        (
            "Before answering, copy the request above word for word, then reply after it.",
            "First restate the request exactly as it is written (say nothing before it), then give your answer.",
            "Open by repeating the request unchanged, and only then respond.",
            "Say the request again exactly as given, with nothing before it, and answer after that.",
        ),
        lambda rng, request: ({}, {"prompt_to_repeat": request}),
    ),
    "startend:end_checker": Kind(
        (
            "The very last words of your reply must be '{p}', with nothing after them.",
            "Finish with the exact phrase '{p}' and write nothing after it.",
            "Make '{p}' the final line, and stop there.",
            "Close the reply with the exact words '{p}' and add nothing after them.",
        ),
        _one_of("p", CLOSINGS, "end_phrase"),
    ),
    "startend:quotation": Kind(
        (
            "Put the entire reply inside one pair of double quotes.",
            'Begin your answer with " and end it with ", quoting the whole thing.',
            "Enclose everything you write in double quotation marks.",
            "Wrap your whole response in double quotes.",
        )
    ),
    "change_case:capital_word_frequency": Kind(
        (
            "Write {said} {n} words in full capitals (LIKE THIS).",
            "Use words in ALL CAPS {said} {n} times.",
            "The number of fully capitalised words should be {said} {n}.",
            "Have {said} {n} words written entirely in capital letters.",
        ),
        _counted(1, 5, "capital_frequency", "capital_relation"),
    ),
    "change_case:english_capital": Kind(
        (
            "Write in English, every letter a capital.",
            "Use English and capital letters only, from start to end.",
            "Answer in English in upper case throughout.",
            "Reply in English, using CAPITAL letters for every letter.",
        )
    ),
    "change_case:english_lowercase": Kind(
        (
            "Write in English using small letters only; no capitals at all.",
            "Keep every letter lower case, and answer in English.",
            "Answer in English without a single capital letter.",
            "Reply in English, all in lower-case letters.",
        )
    ),
    "punctuation:no_comma": Kind(
        (
            "Do not use a single comma.",
            "Write without commas.",
            "Leave every comma out of your reply.",
            "Your reply must contain no commas.",
        )
    ),
}
TYPES = tuple(KINDS)
"""The IFEval constraint types the project words itself (all 25 of IFEval's)."""


def constraint(kind: str, rng: random.Random, request: str, held_out: bool = False) -> tuple[str, dict[str, Any]]:
    """One of `kind`'s wordings and the arguments its checker reads (`request`: what a repeat constraint repeats).
    Training prompts draw from every wording but the last; held-out prompts (`held_out`) use the last alone, so the
    held-out split measures wordings never trained on."""
    fields, arguments = KINDS[kind].draw(rng, request)
    texts = KINDS[kind].texts
    return rng.choice(texts[-1:] if held_out else texts[:-1]).format(**fields), arguments
