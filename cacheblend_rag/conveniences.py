"""The engine's one-line conveniences: each builds a `Request` with `Request.of(...)` from loose keywords and
hands it to one of the engine's four request methods (`prefill_request`, `generate_request`, `stream_request`,
`start_request`), which are the engine's own surface. `CacheBlendEngine` inherits them, so
`engine.generate(chunks, question)` works as it always has."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

from .request import DEFAULT_METHOD, Prompt, Request

if TYPE_CHECKING:
    from .decode.kv_decode import KVSequence
    from .engine import Generation
    from .fuse.policy import Policy
    from .fuse.prefill import Prefill, RequestStats
    from .ingest.chunks import Chunk

__all__ = ["RequestConveniences"]


class RequestConveniences:
    """`prefill` / `generate` / `stream` / `start` for (chunks, question), and their `*_prompt` twins for a whole
    prompt: keywords as `Request.of` (sampling keys, the policy's options, `history=`, `template=`)."""

    def prefill(self, chunks: str | Sequence[str | Chunk], question: str, method: str | Policy = DEFAULT_METHOD,
                recompute_ratio: float | str | None = None, *, store_holes: bool = True, **options) -> Prefill:
        """Fused prefill of [prefix][chunks][question]; `method` names the token-selection policy. Keywords as
        `Request.of` (the policy's options, `history=` earlier turns, `template=`); holes as `prefill_request`."""
        return self.prefill_request(Request.of(chunks, question, method, recompute_ratio, **options),
                                    store_holes=store_holes)

    def prefill_prompt(self, prompt: Prompt, method: str | Policy = DEFAULT_METHOD,
                       recompute_ratio: float | str | None = None, *, store_holes: bool = True, **options) -> Prefill:
        """Fused prefill of any prompt (a string, tokenized as is, or chat messages, rendered with the model's chat
        template): every ingested chunk whose text appears in it verbatim is fused from its cached KV; the text
        around the chunks is computed."""
        return self.prefill_request(Request.of(prompt=prompt, method=method, recompute_ratio=recompute_ratio,
                                               **options), store_holes=store_holes)

    def generate(self, chunks: str | Sequence[str | Chunk], question: str, method: str | Policy = DEFAULT_METHOD,
                 recompute_ratio: float | str | None = None, **options) -> Generation:
        """Fused prefill, then decode: greedy by default. Keywords as `Request.of`: `max_new_tokens` (or
        `max_tokens`), `temperature`, `top_p`, `stop`, `seed`, `grammar` or one `sampling=`; the policy's options;
        `history=` (the conversation's earlier turns), `template=`."""
        return self.generate_request(Request.of(chunks, question, method, recompute_ratio, **options))

    def stream(self, chunks: str | Sequence[str | Chunk], question: str, method: str | Policy = DEFAULT_METHOD,
               recompute_ratio: float | str | None = None, *, stats: dict | None = None,
               **options) -> Generator[str, None, None]:
        """`generate`, yielding text pieces as they are decoded (see `stream_request`)."""
        return self.stream_request(Request.of(chunks, question, method, recompute_ratio, **options), stats)

    def start(self, chunks: str | Sequence[str | Chunk], question: str, method: str | Policy = DEFAULT_METHOD,
              recompute_ratio: float | str | None = None, **options) -> tuple[KVSequence, RequestStats]:
        """`generate`'s prefill, then a sequence to decode with `advance` (see `start_request`)."""
        return self.start_request(Request.of(chunks, question, method, recompute_ratio, **options))

    def generate_prompt(self, prompt: Prompt, method: str | Policy = DEFAULT_METHOD,
                        recompute_ratio: float | str | None = None, **options) -> Generation:
        """`generate` for any prompt (a string or chat messages): the stored chunks found in it are reused."""
        return self.generate_request(Request.of(prompt=prompt, method=method, recompute_ratio=recompute_ratio,
                                                **options))

    def stream_prompt(self, prompt: Prompt, method: str | Policy = DEFAULT_METHOD,
                      recompute_ratio: float | str | None = None, *, stats: dict | None = None,
                      **options) -> Generator[str, None, None]:
        """`stream` for any prompt (a string or chat messages): the stored chunks found in it are reused."""
        return self.stream_request(Request.of(prompt=prompt, method=method, recompute_ratio=recompute_ratio,
                                              **options), stats)

    def start_prompt(self, prompt: Prompt, method: str | Policy = DEFAULT_METHOD,
                     recompute_ratio: float | str | None = None, **options) -> tuple[KVSequence, RequestStats]:
        """`start` for any prompt (a string or chat messages): the stored chunks found in it are reused."""
        return self.start_request(Request.of(prompt=prompt, method=method, recompute_ratio=recompute_ratio,
                                             **options))
