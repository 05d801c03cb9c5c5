"""`CacheBlendPromptTemplate`: formats retrieved chunks and a question into a prompt value that carries them."""

from __future__ import annotations

from typing import Any

from cacheblend_rag.ingest.chunks import chunk_id, normalize_text
from cacheblend_rag.retrieval.prompt import INSTRUCTION, render_prompt
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.prompt_values import StringPromptValue
from langchain_core.prompts import BasePromptTemplate
from pydantic import ConfigDict, Field

__all__ = ["CacheBlendPromptTemplate", "CacheBlendPromptValue", "PromptText"]


class PromptText(str):
    """The string form of a `CacheBlendPromptValue` that still carries its chunks and question.

    LangChain hands an LLM the prompt's string (`PromptValue.to_string()`: `generate_prompt`, `invoke`, `stream`,
    their async forms), so the chunks travel on it to `CacheBlendLLM._generate` / `_stream`; any other LLM reads
    it as the plain string it is. A new string made from it (`text + " "`, `text.strip()`) is plain again.

    Example:
        >>> text = PromptText("Context: Bees have five eyes. Question: Eyes?", ["Bees have five eyes."], "Eyes?")
        >>> text.chunk_texts, text.question, text.endswith("Eyes?"), type(text + " ") is str
        (('Bees have five eyes.',), 'Eyes?', True, True)
    """

    chunk_texts: tuple[str, ...]
    question: str

    def __new__(cls, text: str, chunk_texts: Any = (), question: str = "") -> PromptText:
        self = super().__new__(cls, text)
        self.chunk_texts = tuple(chunk_texts)
        self.question = question
        return self


class CacheBlendPromptValue(StringPromptValue):
    """A string prompt that also carries its chunks (ids + texts) and its question.

    `text` is the documented plain form (`render_prompt`), so any LLM can take it; `CacheBlendLLM` uses the
    chunks directly: its string form (`to_string()`, what LangChain hands an LLM) is a `PromptText` that carries
    them.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    chunk_ids: list[str] = Field(default_factory=list)
    """Content-hash ids of the chunks, in prompt order."""
    chunk_texts: list[str] = Field(default_factory=list)
    """Normalized chunk texts, in prompt order."""
    question: str = ""
    """The question, as the engine puts it after the chunks."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """Not part of LangChain's serializable namespace."""
        return False

    def to_string(self) -> PromptText:
        """The string form, carrying the chunks and the question (`PromptText`)."""
        return PromptText(self.text, self.chunk_texts, self.question)

    def to_messages(self) -> list[BaseMessage]:
        """The string form as one human message (for chat models)."""
        return [HumanMessage(content=self.text)]


def _as_texts(context: Any) -> list[str]:
    if context is None:
        return []
    if isinstance(context, (str, Document)):
        context = [context]
    texts = []
    for item in context:
        text = item.page_content if isinstance(item, Document) else str(item)
        if normalize_text(text):
            texts.append(normalize_text(text))
    return texts


class CacheBlendPromptTemplate(BasePromptTemplate):
    """Formats `context` (Documents or strings) and `question` into a `CacheBlendPromptValue`.

    Empty chunks are left out. Any LLM reads the string form; `CacheBlendLLM` takes the chunks as they are.

    Example:
        >>> value = CacheBlendPromptTemplate().invoke({"context": ["Bees have five eyes.", ""], "question": "Eyes?"})
        >>> value.chunk_texts, value.question
        (['Bees have five eyes.'], 'Eyes?')
        >>> value.chunk_ids == [chunk_id("Bees have five eyes.")]
        True
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, use_attribute_docstrings=True)

    input_variables: list[str] = Field(default_factory=lambda: ["context", "question"])
    """The inputs: retrieved chunks and the question."""
    context_key: str = "context"
    """Input holding the chunks (list of Documents or strings)."""
    question_key: str = "question"
    """Input holding the question."""
    question_template: str = "{question}"
    """How the question is put after the chunks (e.g. to ask for a score); `{question}` is replaced."""
    instruction: str = INSTRUCTION
    """First line of the string form (ignored by CacheBlendLLM, which uses the engine's template)."""

    @property
    def _prompt_type(self) -> str:
        return "cacheblend"

    def format_prompt(self, **kwargs: Any) -> CacheBlendPromptValue:
        """The prompt value for these inputs."""
        kwargs = self._merge_partial_and_user_variables(**kwargs)
        texts = _as_texts(kwargs.get(self.context_key))
        question = self.question_template.format(question=kwargs.get(self.question_key, ""))
        return CacheBlendPromptValue(
            text=render_prompt(texts, question, instruction=self.instruction),
            chunk_ids=[chunk_id(t) for t in texts], chunk_texts=texts, question=question,
        )

    def format(self, **kwargs: Any) -> str:
        """The string form."""
        return self.format_prompt(**kwargs).to_string()
