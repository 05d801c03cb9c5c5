"""LCEL chains over any retriever and LLM: stuff (one fused prompt), map-reduce and map-rerank."""

from __future__ import annotations

import re
from collections.abc import Sequence

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate
from langchain_core.prompts import PromptTemplate as LCPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

from .prompts import CacheBlendPromptTemplate

__all__ = ["RERANK_QUESTION", "create_map_reduce_chain", "create_map_rerank_chain", "create_stuff_chain",
           "parse_scored_answer"]


def create_stuff_chain(retriever: Runnable, llm: Runnable, prompt: BasePromptTemplate | None = None) -> Runnable:
    """question → answer: all retrieved chunks in one fused prompt (the CacheBlend path)."""
    chain = {"context": retriever, "question": RunnablePassthrough()} | (prompt or CacheBlendPromptTemplate()) \
        | llm | StrOutputParser()
    return chain.with_config(run_name="cacheblend_stuff_chain")


_REDUCE_PROMPT = LCPromptTemplate.from_template(
    "Partial answers to the question, each from one passage:\n{answers}\n\n"
    "Question: {question}\nGive the single best final answer in a few words.\nAnswer:"
)


def _fan_out(inputs: dict) -> list[dict]:
    return [{"context": [doc], "question": inputs["question"]} for doc in inputs["context"]]


def _format_answers(answers: Sequence[str]) -> str:
    return "\n".join(f"{i}. {a.strip() or '(no answer)'}" for i, a in enumerate(answers, 1))


def create_map_reduce_chain(retriever: Runnable, llm: Runnable, reduce_prompt: BasePromptTemplate | None = None) -> Runnable:
    """question → answer: an answer per chunk (each prompt one cached chunk), then one reduce call over them."""
    map_chain = CacheBlendPromptTemplate() | llm | StrOutputParser()
    answers = RunnableLambda(_fan_out) | map_chain.map()

    def reduce_inputs(inputs: dict) -> dict:
        return {"answers": _format_answers(inputs["answers"]), "question": inputs["question"]}

    chain = (RunnableParallel(context=retriever, question=RunnablePassthrough())
             | RunnablePassthrough.assign(answers=answers)
             | RunnableLambda(reduce_inputs) | (reduce_prompt or _REDUCE_PROMPT) | llm | StrOutputParser())
    return chain.with_config(run_name="cacheblend_map_reduce_chain")


RERANK_QUESTION = "{question}\nAfter the answer, write 'Score:' and how sure you are, from 0 to 100."
_SCORE_RE = re.compile(r"score\s*[:=]?\s*(\d{1,3})", re.IGNORECASE)


def parse_scored_answer(text: str) -> tuple[str, int]:
    """(answer, score) from "answer ... Score: N"; a missing score counts as 0."""
    m = _SCORE_RE.search(text)
    if not m:
        return text.strip(), 0
    return text[: m.start()].strip().rstrip(".,;-(").strip(), min(int(m.group(1)), 100)


def create_map_rerank_chain(retriever: Runnable, llm: Runnable) -> Runnable:
    """question → answer: an answer with a 0–100 confidence per chunk; the best score wins.

    Ties (and answers without a parseable score, which count as 0) go to the better-ranked chunk.
    """
    map_chain = CacheBlendPromptTemplate(question_template=RERANK_QUESTION) | llm | StrOutputParser()
    answers = RunnableLambda(_fan_out) | map_chain.map()

    def pick(inputs: dict) -> str:
        scored = [parse_scored_answer(a) for a in inputs["answers"]]
        scored = [(ans, score, -i) for i, (ans, score) in enumerate(scored) if ans]
        return max(scored, key=lambda t: (t[1], t[2]))[0] if scored else ""

    chain = (RunnableParallel(context=retriever, question=RunnablePassthrough())
             | RunnablePassthrough.assign(answers=answers) | RunnableLambda(pick))
    return chain.with_config(run_name="cacheblend_map_rerank_chain")
