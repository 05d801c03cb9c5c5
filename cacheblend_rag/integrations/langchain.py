"""Re-exports of the `langchain-cacheblend` partner package (`from langchain_cacheblend import ...`)."""

from ..errors import MissingDependencyError

try:
    from langchain_cacheblend import *  # noqa: F403
    from langchain_cacheblend import __all__  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise MissingDependencyError(
        "the LangChain integration lives in the langchain-cacheblend package: "
        "pip install 'cacheblend-rag[langchain]' -e integrations/langchain-cacheblend"
    ) from e
