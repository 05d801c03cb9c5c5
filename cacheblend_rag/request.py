"""One request value: what to prefill, the policy that fuses it, and how to decode the answer.

Every surface (the engine's conveniences, LangChain, LlamaIndex, the server, the CLI) builds a `Request` with
`Request.of(...)`, which reads the loose keywords they all accept (sampling keys, `method`, `recompute_ratio`, the
method's own options) in one place, and hands it to the engine's `prefill_request` / `generate_request` /
`stream_request` / `start_request`. A request is validated when it is built, so a bad one fails at the call.
A surface with defaults of its own (an LLM object) merges one call's keywords over them with `call_keywords`;
its default method is `DEFAULT_METHOD` (the registry's) and its default ratio `DEFAULT_RECOMPUTE_RATIO`, that
policy's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .decode.generate import SamplingOptions
from .errors import ConfigError
from .fuse.layout import PromptTemplate
from .fuse.policies import DEFAULT_METHOD, POLICIES, call_options, make_policy, takes_ratio
from .fuse.policy import Policy
from .ingest.chunks import Chunk

Prompt = str | Sequence[dict]  # a text prompt, or chat messages [{"role": ..., "content": ...}, ...]

__all__ = ["DEFAULT_METHOD", "DEFAULT_RECOMPUTE_RATIO", "Prompt", "Request", "call_keywords", "default_policy"]

DEFAULT_RECOMPUTE_RATIO: float = POLICIES[DEFAULT_METHOD].recompute_ratio
"""The recompute ratio every surface defaults to: the default method's field default, defined there alone."""


@dataclass(frozen=True)
class Request:
    """What one call asks of the engine.

    Either `question` with its `chunks` (texts, ids or `Chunk`s, placed by the engine's template, after the
    conversation's earlier turns `history`), or a whole `prompt` (a string, tokenized as is, or chat messages,
    rendered with the model's chat template) in which the engine finds the stored chunks itself. `policy` fuses the
    chunks; `auto_ratio` lets the loading controller choose its recompute ratio; `sampling` says how to decode.
    `cache_salt` keeps the request's cached KV apart: requests with different salts never reuse each other's stored
    prefixes, segments or learned chunk KV (`ChunkCache.salted`); None shares with every unsalted request.
    """

    question: str | None = None
    chunks: tuple[str | Chunk, ...] = ()
    history: tuple[dict, ...] = ()
    template: PromptTemplate | None = None
    prompt: str | tuple[dict, ...] | None = None
    policy: Policy = field(default_factory=lambda: make_policy(DEFAULT_METHOD))
    auto_ratio: bool = False
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    tools: tuple[dict, ...] | None = None  # OpenAI tool specs a chat prompt's template lists (its own tool format)
    cache_salt: str | None = None
    # the caller named no ratio: the engine runs the policy at the model's calibrated one (the fidelity gate,
    # gate.py) where it has one for the method, else at the policy's own
    calibrated_ratio: bool = False
    # learned links (fuse/links): None runs the engine's where it has them and the method reuses chunk KV; False
    # turns them off for this request (True asks for them: a ConfigError at the engine if it has none)
    links: bool | None = None

    def __post_init__(self) -> None:
        if self.links is not None and not isinstance(self.links, bool):
            raise ConfigError(f"links must be True, False or None (the engine's), got {self.links!r}")
        if (self.prompt is None) == (self.question is None):
            raise ConfigError("a request has a question (with its chunks) or a whole prompt: pass exactly one")
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"policy must be a Policy (make_policy builds one by name), got {self.policy!r}")
        if not isinstance(self.sampling, SamplingOptions):
            raise ConfigError(f"sampling must be SamplingOptions, got {type(self.sampling).__name__}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ConfigError(f"cache_salt must be a non-empty string (or None: shared), got {self.cache_salt!r}")
        if self.tools is not None:
            object.__setattr__(self, "tools", check_tools(self.tools, self.prompt))
        if self.prompt is not None:
            if self.chunks or self.history or self.template is not None:
                raise ConfigError("a whole prompt carries its own chunks, turns and template: pass prompt alone, "
                                  "or question with chunks=, history=, template=")
            object.__setattr__(self, "prompt", check_prompt(self.prompt))
            return
        check_question(self.question)
        chunks = self.chunks
        if isinstance(chunks, (str, Chunk)):  # one chunk, never its characters
            chunks = (chunks,)
        if not isinstance(chunks, Iterable) or isinstance(chunks, (bytes, Mapping)):
            raise ConfigError(f"chunks must be a list of texts, chunk ids or Chunks, got {type(chunks).__name__}")
        object.__setattr__(self, "chunks", tuple(chunks))
        check_history(self.history)
        object.__setattr__(self, "history", tuple(self.history))

    @classmethod
    def of(cls, chunks: str | Sequence[str | Chunk] = (), question: str | None = None,
           method: str | Policy = DEFAULT_METHOD, recompute_ratio: float | str | None = None, *,
           prompt: Prompt | None = None, history: Sequence[dict] = (), template: PromptTemplate | None = None,
           sampling: SamplingOptions | None = None, tools: Sequence[dict] | None = None,
           cache_salt: str | None = None, calibrated_ratio: bool | None = None, links: bool | None = None,
           **options: Any) -> "Request":
        """A request from the keywords every surface takes: `max_new_tokens` (or `max_tokens`), `temperature`,
        `top_p`, `stop`, `seed`, `grammar` go to the sampling options (over `sampling=`), every other keyword is an
        option of `method`'s policy, built here once; `recompute_ratio="auto"` leaves the ratio to the engine;
        `tools` (OpenAI tool specs) go to the chat template of a chat `prompt`; `cache_salt` keeps its cache apart.
        A method named with no ratio runs at the model's calibrated ratio (`calibrated_ratio`, by default whether
        the call named none: a surface that built its policy from a body says so itself)."""
        sampling, policy_options = SamplingOptions.split(options, sampling)
        auto = recompute_ratio == "auto"
        policy = make_policy(method, None if auto else recompute_ratio, **policy_options)
        if calibrated_ratio is None:
            calibrated_ratio = recompute_ratio is None and isinstance(method, str) and takes_ratio(policy)
        return cls(question=question, chunks=chunks, history=history, template=template, prompt=prompt,
                   policy=policy, auto_ratio=auto, sampling=sampling, tools=_as_tuple(tools),
                   cache_salt=cache_salt, calibrated_ratio=calibrated_ratio, links=links)


def _as_tuple(items: object) -> object:
    """A collection's items as a tuple, for `Request` to check; anything else (None, a str, a dict, a number) as
    it is, for `Request` to refuse with a ConfigError that names it."""
    if isinstance(items, Iterable) and not isinstance(items, (str, bytes, Mapping)):
        return tuple(items)
    return items


def call_keywords(call: Mapping[str, Any], *, method: str, recompute_ratio: float | str,
                  policy_options: Mapping[str, Any], max_new_tokens: int, **sampling: Any) -> dict[str, Any]:
    """`Request.of` keywords for one call of a surface with defaults (an LLM object): the call's `method`,
    `recompute_ratio`, `max_new_tokens` (or `max_tokens`) and policy options over the surface's own (its options
    only where the call keeps its method), then the sampling keywords the surface resolved (`temperature`, `top_p`,
    `seed`, `stop`, ...). Nothing is checked here: `Request.of` checks it all."""
    chosen = call.get("method", method)
    return dict(
        call_options(chosen, method, policy_options, call),
        method=chosen,
        recompute_ratio=call.get("recompute_ratio", recompute_ratio),
        max_new_tokens=call.get("max_new_tokens", call.get("max_tokens", max_new_tokens)),
        **sampling,
    )


def default_policy(method: str, recompute_ratio: float | None, policy_options: Mapping[str, Any]) -> Policy:
    """The policy a surface's defaults (an LLM object's fields) make, built once when the surface is: the method's
    name, its ratio and its options are checked there, by the registry and the policy's own constructor, and by
    nothing else (a ConfigError is a ValueError: pydantic reports it as a ValidationError). A ratio in the options
    is the field's when the field names none, as a call merges them (`call_keywords`)."""
    options = dict(policy_options)
    ratio = options.pop("recompute_ratio", None)
    return make_policy(method, ratio if recompute_ratio is None else recompute_ratio, **options)


def check_question(question: object, what: str = "question") -> None:
    """A question (or prompt) is non-empty text that encodes as UTF-8 (no lone surrogates)."""
    if not isinstance(question, str):
        raise ConfigError(f"{what} must be a str, got {type(question).__name__}")
    if not question.strip():
        raise ConfigError(f"{what} is empty; ask something (the chunks alone are not a question)")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid text ({e.reason} at position {e.start}); pass UTF-8 text") from e


def check_history(history: object) -> None:
    """Earlier turns are a sequence of {"role": str, "content": str} messages, none of them a system message
    (that is the template's)."""
    if isinstance(history, (str, dict)) or not isinstance(history, Sequence) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in history):
        raise ConfigError("history must be a list of {'role': str, 'content': str} messages (the earlier turns)")
    if any(m["role"] in ("system", "developer") for m in history):
        raise ConfigError("history holds a system message; pass it as template=PromptTemplate(system=...)")


def check_prompt(prompt: object) -> str | tuple[dict, ...]:
    """A prompt is non-empty text, or a non-empty list of {"role": str, "content": str} messages whose user turns
    are non-empty text; returned as a string or a tuple of messages."""
    if isinstance(prompt, str):
        check_question(prompt, "prompt")
        return prompt
    if not isinstance(prompt, Sequence) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        raise ConfigError("prompt must be a string or a non-empty list of {'role': str, 'content': str} messages")
    for m in prompt:
        if m["role"] == "user":
            check_question(m["content"], "user message")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, Sequence) or not all(isinstance(c, dict) for c in calls)):
            raise ConfigError("an assistant message's tool_calls must be a list of {'id', 'type', 'function'} dicts")
    return tuple(prompt)


def check_tools(tools: object, prompt: object) -> tuple[dict, ...]:
    """Tools for the chat template are OpenAI tool specs `{"type": "function", "function": {"name", ...}}`, sent
    with chat messages (a string prompt or a question has no chat template call to list them in)."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        raise ConfigError("tools= lists tools in the chat template: pass the prompt as chat messages, or leave tools "
                          "out (the generic tool format puts them in the messages' system text)")
    if isinstance(tools, (str, dict)) or not isinstance(tools, Sequence) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise ConfigError('tools must be a list of {"type": "function", "function": {"name", "parameters"}} specs')
    return tuple(tools)
