"""Re-exports of the `llama-index-cacheblend` partner package (`llama_index.llms.cacheblend`,
`llama_index.postprocessor.cacheblend`)."""

from ..errors import MissingDependencyError

try:
    from llama_index.llms.cacheblend import *  # noqa: F403
    from llama_index.llms.cacheblend import __all__ as _llm_all
    from llama_index.postprocessor.cacheblend import KVAwareNodePostprocessor
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise MissingDependencyError(
        "the LlamaIndex integration lives in the llama-index-cacheblend package: "
        "pip install 'cacheblend-rag[llama-index]' -e integrations/llama-index-cacheblend"
    ) from e

__all__ = [*_llm_all, "KVAwareNodePostprocessor"]
