"""The plain-text form of a RAG prompt that integrations hand to LLMs, and its parser.

LangChain's BaseLLM and LlamaIndex's synthesizers pass prompts to the model as strings. To let chunk ids
survive that, prompts are rendered in one documented format that reads well to any LLM and parses back:

    Answer the question from the passages below in a few words.

    ### Passage
    <chunk 0 text>

    ### Passage
    <chunk 1 text>

    ### Question
    <question>

    ### Answer

Chunk texts are normalized (`normalize_text`) when rendered, so a parsed segment has the same content-hash
id as the chunk it came from. A chunk whose own text contains the separator is reassembled by matching the
joined segments against the known chunk ids (`parse_prompt(..., is_known=...)`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..ingest.chunks import chunk_id, normalize_text

INSTRUCTION = "Answer the question from the passages below in a few words."
PASSAGE_HEADER = "### Passage"
QUESTION_HEADER = "### Question"
ANSWER_HEADER = "### Answer"
CHUNK_SEPARATOR = f"\n\n{PASSAGE_HEADER}\n"  # what precedes every chunk's text
_QUESTION_SEP = f"\n\n{QUESTION_HEADER}\n"
_ANSWER_SEP = f"\n\n{ANSWER_HEADER}\n"
_PASSAGE_RE = re.compile(rf"(?:^|\n\n){re.escape(PASSAGE_HEADER)}\n")


def render_prompt(chunk_texts: Sequence[str], question: str, *, instruction: str = INSTRUCTION) -> str:
    """The documented string form of (chunks, question)."""
    body = "".join(CHUNK_SEPARATOR + normalize_text(t) for t in chunk_texts)
    return f"{instruction}{body}{_QUESTION_SEP}{question}{_ANSWER_SEP}"


@dataclass(frozen=True)
class ParsedPrompt:
    """Chunk texts and the question recovered from a rendered prompt string."""

    chunk_texts: list[str]
    question: str


def parse_prompt(text: str, *, is_known: Callable[[str], bool] | None = None) -> ParsedPrompt | None:
    """Chunks and question of a string made by `render_prompt`; None when it has no question section.

    `is_known(chunk_id)` says whether an id is a stored chunk; with it, consecutive segments are joined
    back (greedily, longest first) when only their join is a known chunk — a chunk that contained the
    separator. Without it, or when nothing matches, each segment is its own chunk (correct, just uncached).
    """
    body, sep, tail = text.rpartition(_QUESTION_SEP)
    if not sep:
        return None
    question, _, _ = tail.partition(_ANSWER_SEP)
    segments = [normalize_text(s) for s in _PASSAGE_RE.split(body)[1:]]
    segments = [s for s in segments if s]
    return ParsedPrompt(_regroup(segments, is_known) if is_known else segments, question.strip())


def _regroup(segments: list[str], is_known: Callable[[str], bool]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(segments):
        for j in range(len(segments), i, -1):
            candidate = CHUNK_SEPARATOR.join(segments[i:j])
            if j == i + 1 or is_known(chunk_id(candidate)):
                out.append(candidate)
                i = j
                break
    return out
