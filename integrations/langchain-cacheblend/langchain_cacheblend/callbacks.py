"""`StatsCallbackHandler`: the package's stats of every generation in a run, from any chain; `RetrievedPassages`:
what retrievers returned in each run tree, for the package's models in that tree to learn."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any, cast
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.tracers.context import register_configure_hook

from .retrievers import document_chunk_id

__all__ = ["RetrievedPassages", "StatsCallbackHandler"]


class StatsCallbackHandler(BaseCallbackHandler):
    """Collects the stats of every CacheBlendLLM / ChatCacheBlend generation in a run (pass it in `callbacks`).

    Example:
        >>> stats = StatsCallbackHandler()
        >>> _ = ChatCacheBlend(engine=engine, max_tokens=2).invoke("Hi", config={"callbacks": [stats]})
        >>> sorted(k for k in stats.last if k.startswith("chunk_"))
        ['chunk_hits', 'chunk_ids', 'chunk_misses']
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        """Stats of each generation, in the order they ended."""
        self.retrieved: list[list[str]] = []
        """Chunk ids of each retriever run, in the order runs ended (a wrapper ends after what it wraps)."""
        self._lock = threading.Lock()

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        """Record the chunk ids a retriever returned."""
        with self._lock:
            self.retrieved.append([d.metadata.get("chunk_id") or document_chunk_id(d) for d in documents])

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        """Record each generation's stats."""
        with self._lock:
            for gens in response.generations:
                for gen in gens:
                    if isinstance(gen, ChatGeneration) and "cacheblend" in gen.message.response_metadata:
                        self.requests.append(gen.message.response_metadata["cacheblend"])
                    elif gen.generation_info and "chunk_ids" in gen.generation_info:
                        self.requests.append(gen.generation_info)

    @property
    def last(self) -> dict[str, Any] | None:
        """Stats of the latest generation."""
        return self.requests[-1] if self.requests else None


class RetrievedPassages(BaseCallbackHandler):
    """The page_content of what retrievers returned, per run tree (a chain's root run), for `ChatCacheBlend` /
    `CacheBlendLLM` in the same tree to learn after their answer (`engine.learn`): the next run that retrieves
    those passages reuses their KV, with no `warm_from_vectorstore` step.

    The models read it from their run's callback manager (`run_manager.handlers`), so it travels with the run:
    one passed in `config={"callbacks": [RetrievedPassages()]}` serves that run alone. A run that has none gets a
    new one at its root through LangChain's configure hook (as its tracers are added), inherited by every run it
    calls, so a chain invoked with no callbacks learns too: each run tree has its own, dropped with the tree's
    callback managers, and no instance is shared between requests. It is bounded (`max_runs`) and locked, since
    one passed by the user may serve many runs, from several threads.

    Example:
        >>> passages = RetrievedPassages()
        >>> root, retriever = UUID(int=1), UUID(int=2)
        >>> passages.on_chain_start({}, {}, run_id=root)
        >>> passages.on_retriever_end([Document("Bees have five eyes.")], run_id=retriever, parent_run_id=root)
        >>> passages.texts_for(root)
        ['Bees have five eyes.']
    """

    run_inline = True  # recorded before the model of the same tree asks

    def __init__(self, max_runs: int = 4096) -> None:
        self.max_runs = max_runs
        self._parent: OrderedDict[UUID, UUID | None] = OrderedDict()
        self._texts: OrderedDict[UUID, list[str]] = OrderedDict()  # by root run
        self._lock = threading.Lock()

    def _note(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            self._parent[run_id] = parent_run_id
            while len(self._parent) > self.max_runs:
                self._parent.popitem(last=False)

    def _root(self, run_id: UUID) -> UUID:
        seen = 0
        while (parent := self._parent.get(run_id)) is not None and seen < self.max_runs:
            run_id, seen = parent, seen + 1
        return run_id

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       **kwargs: Any) -> None:
        """Note where the run sits."""
        self._note(run_id, parent_run_id)

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                           **kwargs: Any) -> None:
        """Note where the run sits."""
        self._note(run_id, parent_run_id)

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID,
                            parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        """Note where the run sits."""
        self._note(run_id, parent_run_id)

    def on_llm_start(self, serialized: Any, prompts: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        """Note where the run sits."""
        self._note(run_id, parent_run_id)

    def on_retriever_end(self, documents: Sequence[Document], *, run_id: UUID, parent_run_id: UUID | None = None,
                         **kwargs: Any) -> None:
        """Keep the documents' text under the run's tree."""
        self._note(run_id, parent_run_id)
        texts = [d.page_content for d in documents if d.page_content.strip()]
        with self._lock:
            root = self._root(run_id)
            self._texts.setdefault(root, []).extend(texts)
            self._texts.move_to_end(root)
            while len(self._texts) > self.max_runs:
                self._texts.popitem(last=False)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        """A tree's root ended: forget what it retrieved."""
        if parent_run_id is None:
            with self._lock:
                self._texts.pop(run_id, None)

    on_chain_error = on_chain_end

    def texts_for(self, run_id: UUID) -> list[str]:
        """The passages retrieved so far in the tree of this run, in order, without repeats."""
        with self._lock:
            return list(dict.fromkeys(self._texts.get(self._root(run_id), ())))


class _NewPerRunTree:
    """What LangChain's configure hook reads in place of a context variable: `get()` is a new `RetrievedPassages`
    each time, which `CallbackManager.configure` adds (as inheritable) only where the run's manager holds no
    `RetrievedPassages` yet, i.e. at the root of a run tree; the runs below inherit that one. Stateless: the
    passages live on the run tree's callback managers, not here."""

    name = "langchain_cacheblend_retrieved"  # as a ContextVar's: what LangChain's registry lists hooks by

    def get(self) -> RetrievedPassages:
        """A new recorder, for a run tree that has none."""
        return RetrievedPassages()


# LangChain's own registry of handlers added to every run (as `langchain_core.callbacks.usage` registers its own at
# import); what the hook adds is a new, per-tree handler: no process-wide instance.
register_configure_hook(cast("ContextVar[RetrievedPassages | None]", _NewPerRunTree()), inheritable=True,
                        handle_class=RetrievedPassages)
