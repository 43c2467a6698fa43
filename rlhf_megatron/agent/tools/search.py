"""Search-R1-style retrieval over a local corpus with BM25 (``bm25s``), as a tool.

``LocalSearchTool`` answers ``search(query, topk?)`` from the file named by ``config.corpus_path``:
JSONL or parquet rows with an ``id`` and either ``contents`` (Search-R1's wiki dump: the first
line is the title) or ``title`` / ``text``. Results read like Search-R1's retriever:
``Doc 1 (Title: ...) ...``. It also takes verl's ``query_list`` argument, so verl's search tool
config works with only class_name (and the retriever URL replaced by corpus_path) changed.

The index is built once per process per corpus file (the first tool constructed builds it, and
any later tool on the same unchanged file reuses it) and works offline: bm25s's bundled English
stopwords, no stemmer, nothing downloaded. Searches run in a thread, off the rollout's event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.agent.base import BaseTool
from rlhf_megatron.agent.errors import ToolConfigError, ToolError
from rlhf_megatron.agent.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["Document", "LocalSearchTool", "SearchIndex", "get_search_index", "load_corpus"]

_CORPUS_FORMAT = "JSONL or parquet rows with 'id' and 'contents' (title on the first line) or 'title'/'text'"


@dataclass(frozen=True)
class Document:
    """One passage of the corpus; ``title`` and ``text`` are both indexed."""

    id: str
    title: str
    text: str


def load_corpus(path: str) -> list[Document]:
    """Read every document of a JSONL or parquet corpus; ``ToolConfigError`` names the bad line."""
    if not os.path.isfile(path):
        raise ToolConfigError(f"search corpus {path} (config.corpus_path) does not exist; {_CORPUS_FORMAT}.")
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            rows, where = enumerate(pq.read_table(path).to_pylist(), start=1), "row"
        else:
            rows, where = _jsonl_rows(path), "line"
        documents = [_document(path, f"{where} {n}", n, row) for n, row in rows]
    except ToolConfigError:
        raise
    except Exception as err:  # a corrupt parquet file, a JSONL file that is not UTF-8
        raise ToolConfigError(f"search corpus {path} cannot be read: {type(err).__name__}: {err}") from err
    if not documents:
        raise ToolConfigError(f"search corpus {path} has no documents; {_CORPUS_FORMAT}.")
    return documents


def _jsonl_rows(path: str):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as err:
                raise ToolConfigError(f"search corpus {path} line {n}: not valid JSON ({err.msg}).") from err


def _document(path: str, where: str, n: int, row: Any) -> Document:
    if not isinstance(row, dict):
        raise ToolConfigError(f"search corpus {path} {where}: expected an object; {_CORPUS_FORMAT}.")
    doc_id = str(row.get("id", n))
    if isinstance(row.get("contents"), str):
        # Search-R1's wiki dump: '"Title"\nbody'.
        title, _, text = row["contents"].partition("\n")
        return Document(doc_id, title.strip().strip('"'), text.strip())
    if isinstance(row.get("text"), str):
        return Document(doc_id, str(row.get("title") or "").strip(), row["text"].strip())
    raise ToolConfigError(
        f"search corpus {path} {where}: has neither 'contents' nor 'text'; {_CORPUS_FORMAT}."
    )


class SearchIndex:
    """A BM25 index over one corpus. ``search`` may be called from several threads."""

    def __init__(self, documents: list[Document]):
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.documents = documents
        self._tokenizer = Tokenizer(stopwords="en", stemmer=None)
        corpus_tokens = self._tokenizer.tokenize(
            [f"{d.title}\n{d.text}" for d in documents], return_as="tuple", show_progress=False
        )
        self._retriever = bm25s.BM25()
        self._retriever.index(corpus_tokens, show_progress=False)
        # bm25s maps a query with no known word to the empty token; it matches nothing.
        self._empty_id = self._tokenizer.get_vocab_dict().get("")
        # bm25s does not promise thread safety (the tokenizer keeps per-call state); searches are
        # milliseconds, so one at a time costs little.
        self._lock = threading.Lock()

    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        """The best ``k`` documents with a positive score, best first."""
        with self._lock:
            ids = self._tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)
            if not [t for t in ids[0] if t != self._empty_id]:
                return []
            k = min(k, len(self.documents))  # bm25s refuses a k above the corpus size
            hits, scores = self._retriever.retrieve(ids, k=k, show_progress=False)
        return [(self.documents[int(i)], float(s)) for i, s in zip(hits[0], scores[0]) if s > 0]


_INDEXES: dict[tuple[str, int, int], SearchIndex] = {}
_INDEXES_LOCK = threading.Lock()


def get_search_index(path: str) -> SearchIndex:
    """The process's index of the corpus at ``path``, built on first use (rebuilt if the file changed)."""
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        raise ToolConfigError(f"search corpus {path} (config.corpus_path) does not exist; {_CORPUS_FORMAT}.")
    stat = os.stat(real)
    key = (real, stat.st_mtime_ns, stat.st_size)
    with _INDEXES_LOCK:
        if key not in _INDEXES:
            for stale in [k for k in _INDEXES if k[0] == real]:  # the file changed: free the old index
                del _INDEXES[stale]
            _INDEXES[key] = SearchIndex(load_corpus(real))
        return _INDEXES[key]


def format_results(hits: list[tuple[Document, float]]) -> str:
    return "\n".join(f"Doc {i} (Title: {doc.title}) {doc.text}" for i, (doc, _) in enumerate(hits, start=1))


class LocalSearchTool(BaseTool):
    """``search(query, topk?)`` over ``config.corpus_path``; ``config.topk`` (default 3) is the default
    number of documents, ``config.max_topk`` (default 10) caps what a call may ask for."""

    default_tool_schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search a knowledge base and return the most relevant documents.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to search for, as a short query."},
                    "topk": {"type": "integer", "description": "How many documents to return."},
                },
                "required": ["query"],
            },
        },
    }

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        corpus_path = self.config.get("corpus_path")
        if not corpus_path:
            raise ToolConfigError(
                f"{type(self).__name__}: config.corpus_path is required ({_CORPUS_FORMAT})."
            )
        self.topk = int(self.config.get("topk", 3))
        self.max_topk = int(self.config.get("max_topk", 10))
        if not 1 <= self.topk <= self.max_topk:
            raise ToolConfigError(
                f"{type(self).__name__}: config.topk must be in 1..{self.max_topk}, got {self.topk}."
            )
        # Built here so a bad corpus fails when the config is loaded, not at the first call.
        self.index = get_search_index(str(corpus_path))

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        queries = _queries(parameters)
        topk = parameters.get("topk", self.topk)
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= self.max_topk:
            raise ToolError(f"search: topk must be an integer from 1 to {self.max_topk}, got {topk!r}")
        hits = await asyncio.to_thread(lambda: [self.index.search(q, topk) for q in queries])
        blocks = [format_results(h) if h else f"No results found for {q!r}." for q, h in zip(queries, hits)]
        metrics = {"query_count": len(queries), "total_results": sum(len(h) for h in hits)}
        return ToolResponse(text="\n---\n".join(blocks)), 0.0, metrics


def _queries(parameters: dict[str, Any]) -> list[str]:
    """``query`` (ours) or ``query_list`` (verl's search tool), as a non-empty list of strings."""
    if "query_list" in parameters:
        queries = parameters["query_list"]
        if not isinstance(queries, list) or not queries or not all(isinstance(q, str) for q in queries):
            raise ToolError("search: query_list must be a non-empty list of strings")
    else:
        queries = [parameters.get("query")]
    if not all(isinstance(q, str) and q.strip() for q in queries):
        raise ToolError("search: the query is empty; write what to search for")
    return queries
