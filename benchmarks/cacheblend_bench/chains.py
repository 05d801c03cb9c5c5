"""Chain-based methods: the LCEL chains of the LangChain integration, timed the way a chain user sees them.

- `stuff`: `create_stuff_chain` on `CacheBlendLLM` (all passages in one fused prompt);
- `tutorial`: LangChain's own RAG tutorial chain, `{"context": retriever | format_docs, "question": ...} |
  ChatPromptTemplate(the tutorial's system prompt) | ChatCacheBlend`: no package prompt, no chunk ids; the
  engine finds the passages in the rendered chat (the drop-in path);
- `stuff_documents`: LangChain's `create_retrieval_chain(retriever, create_stuff_documents_chain(ChatCacheBlend,
  ChatPromptTemplate))` from `langchain-classic` (the chain the LangChain docs build), the documents stuffed by
  its own `format_document`/separator; stats come through callbacks (its output parser drops the metadata);
- `llama_query`: LlamaIndex the standard way — `Settings.llm = CacheBlendLLM(engine)`, the passages as one
  `TextNode` each in a `VectorStoreIndex` over `ChromaVectorStore` (an in-process Chroma collection, embedded
  with `LocalEmbedding` before the clock starts), `index.as_query_engine(similarity_top_k=len(passages),
  streaming=True)` with its default synthesizer; its TTFT includes embedding the query and searching Chroma
  (the in-memory retriever of the LangChain methods costs nothing); stats from `Response.metadata`;
- `map_reduce`, `map_rerank`: `create_map_reduce_chain` / `create_map_rerank_chain` on `CacheBlendLLM`;
- `hf_pipeline`: the stuff chain on langchain-huggingface's `HuggingFacePipeline` over the *same* model object,
  given the engine's prompt decoded to text. The pipeline re-tokenizes that string as a whole, so at a chunk
  boundary its token sequence can differ from the engine's by a token or two (`same_tokens` in each record).

The retriever is an in-memory one that returns this question's passages as Documents, wrapped in
`ChunkIdRetriever`. TTFT of a chain is the time from `.stream(question)` to its first non-empty chunk
(retrieval + prompt + prefill + the first decoded word; map_reduce includes every map call; map_rerank's last
step is not streamable, so its first chunk is its answer). Latency is a separate `.invoke(question)`.
"""

from __future__ import annotations

import statistics
import time

from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.errors import MissingDependencyError
from cacheblend_rag.fuse.layout import assemble
from .methods import MethodSpec

DEFAULT_CHAIN_METHOD = "cacheblend"
DEFAULT_CHAIN_RATIO = 0.15


def hf_available() -> bool:
    """Whether langchain-huggingface can be imported (the hf_pipeline method)."""
    try:
        import langchain_huggingface  # noqa: F401
    except Exception:  # noqa: BLE001 (ImportError, or a broken dependency pin)
        return False
    return True


def engine_prompt_text(engine: CacheBlendEngine, texts: list[str], question: str) -> tuple[str, list[int]]:
    """The engine's prompt for (chunks, question) as text, and the token ids the engine would run."""
    chunks = [engine.resolve_chunk(t) for t in texts]
    prefix, separator, suffix = engine.template.render(engine.tokenizer, question)
    ids = assemble(prefix, [c.token_ids for c in chunks], separator, suffix).token_ids.tolist()
    return engine.tokenizer.decode(ids, skip_special_tokens=False), ids


class ChainRunner:
    """Builds the LLMs once and runs a chain method on one question's passages."""

    def __init__(self, engine: CacheBlendEngine, *, max_new_tokens: int, seed: int = 0) -> None:
        from langchain_cacheblend import CacheBlendLLM  # noqa: F401 (fails early without langchain-core)

        self.engine = engine
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self._llms: dict[tuple, object] = {}
        self._hf = None
        self._chroma = None  # one in-process Chroma for llama_query, a collection per question
        self._chroma_collections = 0
        self._embedding = None

    # -- LLMs --

    def cacheblend_llm(self, spec: MethodSpec):
        """A CacheBlendLLM on the shared engine, with the spec's method and ratio."""
        from langchain_cacheblend import CacheBlendLLM

        method = str(spec.options.get("method", DEFAULT_CHAIN_METHOD))
        ratio = spec.ratio if spec.ratio is not None else DEFAULT_CHAIN_RATIO
        key = (method, ratio)
        if key not in self._llms:
            self._llms[key] = CacheBlendLLM(engine=self.engine, method=method, recompute_ratio=ratio,
                                            max_new_tokens=self.max_new_tokens, seed=self.seed)
        return self._llms[key]

    def hf_llm(self):
        """HuggingFacePipeline over the engine's own model and tokenizer: greedy, new text only."""
        if self._hf is None:
            from langchain_huggingface import HuggingFacePipeline
            from transformers import pipeline

            kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": False, "return_full_text": False}
            pipe = pipeline("text-generation", model=self.engine.model, tokenizer=self.engine.tokenizer, **kwargs)
            self._hf = HuggingFacePipeline(pipeline=pipe, pipeline_kwargs=kwargs)
        return self._hf

    # -- one run --

    def chain(self, spec: MethodSpec, passages: list[str]):
        """The chain of a spec over a retriever that returns `passages`."""
        from langchain_core.documents import Document
        from langchain_core.runnables import RunnableLambda

        from langchain_cacheblend import (
            ChunkIdRetriever,
            create_map_reduce_chain,
            create_map_rerank_chain,
            create_stuff_chain,
        )

        docs = [Document(page_content=p) for p in passages]
        if spec.method == "llama_query":
            return self.llama_query_engine(spec, passages)
        if spec.method == "stuff_documents":
            return self.stuff_documents_chain(RunnableLambda(lambda _query: list(docs), name="passages"), spec)
        if spec.method == "tutorial":
            return self.tutorial_chain(RunnableLambda(lambda _query: list(docs), name="passages"), spec)
        retriever = ChunkIdRetriever(base=RunnableLambda(lambda _query: list(docs), name="passages"))
        if spec.method == "hf_pipeline":
            def prompt(inputs: dict) -> str:
                return engine_prompt_text(self.engine, [d.page_content for d in inputs["context"]],
                                          inputs["question"])[0]

            return create_stuff_chain(retriever, self.hf_llm(), RunnableLambda(prompt, name="engine_prompt"))
        make = {"stuff": create_stuff_chain, "map_reduce": create_map_reduce_chain,
                "map_rerank": create_map_rerank_chain}[spec.method]
        return make(retriever, self.cacheblend_llm(spec))

    def chat_model(self, spec: MethodSpec):
        """A ChatCacheBlend on the shared engine, with the spec's method and ratio."""
        from langchain_cacheblend import ChatCacheBlend

        method = str(spec.options.get("method", DEFAULT_CHAIN_METHOD))
        ratio = spec.ratio if spec.ratio is not None else DEFAULT_CHAIN_RATIO
        key = ("chat", method, ratio)
        if key not in self._llms:
            self._llms[key] = ChatCacheBlend(engine=self.engine, method=method, recompute_ratio=ratio,
                                             max_tokens=self.max_new_tokens, seed=self.seed)
        return self._llms[key]

    def stuff_documents_chain(self, retriever, spec: MethodSpec):
        """`create_retrieval_chain(retriever, create_stuff_documents_chain(chat, prompt))`, as LangChain's docs."""
        try:
            from langchain_classic.chains import create_retrieval_chain
            from langchain_classic.chains.combine_documents import create_stuff_documents_chain
        except ImportError as e:
            raise MissingDependencyError("the stuff_documents method needs langchain-classic: "
                                         "pip install -e 'benchmarks[chains]'") from e
        from langchain_core.prompts import ChatPromptTemplate

        prompt = ChatPromptTemplate.from_messages([
            ("system", "Use the given context to answer the question. If you don't know the answer, say you don't "
                       "know. Use three sentences maximum and keep the answer concise. Context: {context}"),
            ("human", "{input}"),
        ])
        return create_retrieval_chain(retriever, create_stuff_documents_chain(self.chat_model(spec), prompt))

    def llama_query_engine(self, spec: MethodSpec, passages: list[str]):
        """`Settings.llm = CacheBlendLLM(...)`, a VectorStoreIndex over ChromaVectorStore, `as_query_engine()`."""
        try:
            import chromadb
            from llama_index.core import Settings, StorageContext, VectorStoreIndex
            from llama_index.core.schema import TextNode
            from llama_index.vector_stores.chroma import ChromaVectorStore

            from llama_index.llms.cacheblend import CacheBlendLLM, LocalEmbedding
        except ImportError as e:
            raise MissingDependencyError("the llama_query method needs llama-index-core and "
                                         "llama-index-vector-stores-chroma: pip install -e 'benchmarks[chains]'") from e
        method = str(spec.options.get("method", DEFAULT_CHAIN_METHOD))
        ratio = spec.ratio if spec.ratio is not None else DEFAULT_CHAIN_RATIO
        key = ("llama", method, ratio)
        if key not in self._llms:
            self._llms[key] = CacheBlendLLM(engine=self.engine, method=method, recompute_ratio=ratio,
                                            max_new_tokens=self.max_new_tokens, generate_kwargs={"seed": self.seed})
        if self._chroma is None:
            self._chroma = chromadb.EphemeralClient(settings=chromadb.config.Settings(anonymized_telemetry=False))
        self._chroma_collections += 1  # a fresh collection per question: only its passages can be retrieved
        collection = self._chroma.create_collection(f"bench_{self._chroma_collections}")
        store = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
        # The standard way: Settings, read when the index and its query engine are built (they keep what they
        # read), then put back so that a process running the bench keeps its own Settings.
        saved = Settings._llm, Settings._embed_model
        try:
            Settings.llm, Settings.embed_model = self._llms[key], self._llama_embedding(LocalEmbedding)
            index = VectorStoreIndex([TextNode(text=p) for p in passages], storage_context=store)
            return index.as_query_engine(similarity_top_k=len(passages), streaming=True)
        finally:
            Settings._llm, Settings._embed_model = saved

    def _llama_embedding(self, factory):
        if self._embedding is None:
            self._embedding = factory()
        return self._embedding

    def tutorial_chain(self, retriever, spec: MethodSpec):
        """LangChain's RAG tutorial chain with the user's own prompt, on ChatCacheBlend."""
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_core.runnables import RunnablePassthrough

        prompt = ChatPromptTemplate.from_messages([
            ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                       "context to answer the question. If you don't know the answer, say that you don't know. "
                       "Use three sentences maximum and keep the answer concise.\n\n{context}"),
            ("human", "{question}"),
        ])

        def format_docs(docs) -> str:
            return "\n\n".join(d.page_content for d in docs)

        return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | self.chat_model(spec)

    def _run_chat(self, chain, question: str) -> dict:
        """The tutorial chain: TTFT to the first non-empty message chunk; stats from the message's metadata."""
        started = time.perf_counter()
        first = None
        pieces: list[str] = []
        for chunk in chain.stream(question):
            if chunk.content and first is None:
                first = time.perf_counter() - started
            pieces.append(chunk.content)
        stream_s = time.perf_counter() - started
        started = time.perf_counter()
        message = chain.invoke(question)
        latency = time.perf_counter() - started
        return self._record(first, stream_s, latency, message.content, pieces,
                            message.response_metadata.get("cacheblend", {}))

    def _run_stuff_documents(self, chain, question: str) -> dict:
        """create_retrieval_chain: TTFT to the first non-empty `answer` piece; stats through callbacks."""
        from langchain_cacheblend import StatsCallbackHandler

        started = time.perf_counter()
        first = None
        pieces: list[str] = []
        for chunk in chain.stream({"input": question}):
            piece = chunk.get("answer") or ""
            if piece and first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
        stream_s = time.perf_counter() - started
        handler = StatsCallbackHandler()
        started = time.perf_counter()
        answer = chain.invoke({"input": question}, config={"callbacks": [handler]})["answer"]
        latency = time.perf_counter() - started
        return self._record(first, stream_s, latency, answer, pieces, handler.last or {})

    def _run_llama(self, query_engine, question: str) -> dict:
        """LlamaIndex query engine: TTFT to the first non-empty streamed piece; stats from Response.metadata."""
        started = time.perf_counter()
        first = None
        response = query_engine.query(question)
        pieces: list[str] = []
        for piece in response.response_gen:
            if piece and first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
        stream_s = time.perf_counter() - started
        started = time.perf_counter()
        again = query_engine.query(question)
        answer = "".join(again.response_gen)
        latency = time.perf_counter() - started
        from llama_index.core import QueryBundle

        started = time.perf_counter()  # the part of its TTFT that the LangChain methods' fixed retriever skips
        query_engine.retrieve(QueryBundle(question))
        retrieve_s = time.perf_counter() - started
        record = self._record(first, stream_s, latency, answer, pieces, again.metadata.get("cacheblend", {}))
        record["retrieve_s"] = retrieve_s
        return record

    @staticmethod
    def _record(first: float | None, stream_s: float, latency: float, answer: str, pieces: list[str],
                stats: dict) -> dict:
        """A one-LLM-call chain's record from its timings and the package's stats of that call."""
        return {
            "kind": "chain", "ttft_kind": "first_stream_chunk",
            "ttft_s": first if first is not None else stream_s, "stream_s": stream_s, "latency_s": latency,
            "answer": str(answer).strip(), "stream_answer": "".join(pieces).strip(),
            "recompute_ratio_effective": stats.get("recompute_ratio_effective"), "kv_bytes_loaded": None,
            "num_tokens": stats.get("num_tokens"), "llm_calls": stats.get("calls", 1),
            "engine_ttft_s": stats.get("ttft_s"),
            "chunk_hits": len(stats.get("chunk_hits", ())), "chunk_misses": len(stats.get("chunk_misses", ())),
        }

    def run(self, spec: MethodSpec, passages: list[str], question: str) -> dict:
        """Stream once (TTFT), invoke once (latency, answer, engine stats); a record without KL/match."""
        from langchain_cacheblend import StatsCallbackHandler

        chain = self.chain(spec, passages)
        if spec.method == "tutorial":
            return self._run_chat(chain, question)
        if spec.method == "stuff_documents":
            return self._run_stuff_documents(chain, question)
        if spec.method == "llama_query":
            return self._run_llama(chain, question)
        streamed = StatsCallbackHandler()  # the engine's TTFT inside this very stream, beside its first chunk
        started = time.perf_counter()
        first = None
        pieces: list[str] = []
        for piece in chain.stream(question, config={"callbacks": [streamed]}):
            if piece and first is None:
                first = time.perf_counter() - started
            pieces.append(piece)
        stream_s = time.perf_counter() - started

        handler = StatsCallbackHandler()
        started = time.perf_counter()
        answer = chain.invoke(question, config={"callbacks": [handler]})
        latency = time.perf_counter() - started

        requests = handler.requests
        reused = sum(r.get("num_reused", 0) for r in requests)
        record = {
            "kind": "chain", "ttft_kind": "first_stream_chunk",
            "ttft_s": first if first is not None else stream_s, "stream_s": stream_s, "latency_s": latency,
            "answer": answer.strip(), "stream_answer": "".join(pieces).strip(),
            "recompute_ratio_effective": (sum(r.get("recompute_ratio_effective", 0.0) * r.get("num_reused", 0)
                                              for r in requests) / reused) if reused else (0.0 if requests else None),
            "kv_bytes_loaded": None, "num_tokens": sum(r.get("num_tokens", 0) for r in requests) or None,
            "llm_calls": len(requests) or None,
            # the engine's TTFT in the streamed run (the one `ttft_s` timed), else in the invoke
            "engine_ttft_s": sum(r.get("ttft_s", 0.0) for r in (streamed.requests or requests)) or None,
            "chunk_hits": sum(len(r.get("chunk_hits", ())) for r in requests) if requests else None,
            "chunk_misses": sum(len(r.get("chunk_misses", ())) for r in requests) if requests else None,
        }
        if spec.method == "hf_pipeline":
            text, ids = engine_prompt_text(self.engine, passages, question)
            pipe = self.hf_llm().pipeline
            seen = pipe.tokenizer(text, add_special_tokens=False)["input_ids"]
            # The string is re-tokenized as a whole: at a chunk boundary a merge can differ by a token or two.
            record.update(llm_calls=1, num_tokens=len(seen), engine_num_tokens=len(ids),
                          same_tokens=list(seen) == list(ids))
        return record


def ttft_ratios(summary: dict[str, dict], records: list[dict], engine_label: str | None = None) -> str:
    """A markdown table of each chain's TTFT median over `stuff`'s and over the engine's (the first CacheBlend
    engine method, or `engine_label`), with its mean chunk hits and misses per question: the figures the drop-in
    promise is judged by (a chain within 1.2x of `stuff`)."""
    chains = [label for label, s in summary.items() if s.get("kind") == "chain"]
    if not chains:
        return ""
    if engine_label is None:
        engine_label = next((label for label, s in summary.items()
                             if s.get("kind") != "chain" and label.startswith("cacheblend")), None)
    stuff = summary.get("stuff", {}).get("ttft_median_s")
    engine = summary.get(engine_label, {}).get("ttft_median_s") if engine_label else None
    lines = [f"| chain | TTFT median (s) | x stuff | x engine ({engine_label or 'none'}) | engine TTFT inside "
             "the chain (s) | retrieval, in its TTFT (s) | chunk hits / misses |",
             "|---|---|---|---|---|---|---|"]

    def median_of(rows: list[dict], key: str) -> str:
        values = [r[key] for r in rows if r.get(key) is not None]
        return f"{statistics.median(values):.3f}" if values else "-"

    for label in chains:
        med = summary[label]["ttft_median_s"]
        rows = [r for r in records if r["method"] == label and r.get("chunk_hits") is not None]
        counts = (f"{sum(r['chunk_hits'] for r in rows) / len(rows):.1f} / "
                  f"{sum(r['chunk_misses'] for r in rows) / len(rows):.1f}") if rows else "-"
        lines.append(f"| {label} | {med:.3f} | {f'{med / stuff:.2f}' if stuff else '-'} | "
                     f"{f'{med / engine:.2f}' if engine else '-'} | {median_of(rows, 'engine_ttft_s')} | "
                     f"{median_of(rows, 'retrieve_s')} | {counts} |")
    return "\n".join(lines)
