"""Benchmark data: the core's MuSiQue-style loading, and re-chunking a question's passages to a token length."""

from __future__ import annotations

from cacheblend_rag.datasets import FALLBACK_DATASET, load_dataset, passages_of, resolve_dataset

__all__ = ["FALLBACK_DATASET", "load_dataset", "passages_of", "question_passages", "rechunk", "resolve_dataset"]


def rechunk(passages: list[str], chunk_tokens: int, num_chunks: int, tokenizer) -> list[str]:
    """`num_chunks` chunks of about `chunk_tokens` tokens cut from the passages read in order.

    Passages are joined with blank lines and the token stream is cut every `chunk_tokens` tokens (a long
    passage is split, short ones merge): chunk length varies while the chunk count stays fixed (Figure 15).
    Cuts move forward to the next token that starts a word, so chunks are whole words; re-tokenized on their
    own, a chunk is within a few tokens of `chunk_tokens`.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    ids = tokenizer("\n\n".join(passages), add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    starts_word = [p.startswith(("Ġ", "▁", "Ċ", " ", "\n")) for p in pieces]
    chunks: list[str] = []
    start = 0
    while start < len(ids) and len(chunks) < num_chunks:
        end = min(start + chunk_tokens, len(ids))
        while end < len(ids) and not starts_word[end] and end - start < chunk_tokens + 16:
            end += 1
        text = tokenizer.decode(ids[start:end], skip_special_tokens=True).strip()
        if text:
            chunks.append(text)
        start = end
    return chunks


def question_passages(item: dict, num_chunks: int, chunk_tokens: int | None, tokenizer) -> list[str]:
    """The chunks one question is answered from: its first passages, or all of them re-cut to `chunk_tokens`."""
    if chunk_tokens:
        return rechunk(passages_of(item, None), chunk_tokens, num_chunks, tokenizer)
    return passages_of(item, num_chunks)
