"""LocalSearchTool: BM25 over a local JSONL / parquet corpus, Search-R1 formatting, config errors."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_megatron.agent import OpenAIFunctionCallSchema, ToolConfigError, load_tools, run_tool_call
from rlhf_megatron.agent.tools import LocalSearchTool, search
from rlhf_megatron.agent.tools.search import get_search_index

DOCS = [
    {"id": "d1", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "d2", "contents": '"Berlin"\nBerlin is the capital of Germany, on the river Spree.'},
    {"id": "d3", "contents": '"Lyon"\nLyon is a city in France known for its cuisine.'},
    {"id": "d4", "contents": '"Cat"\nThe cat is a small domesticated carnivorous mammal.'},
    {
        "id": "d5",
        "contents": '"Spree"\nThe Spree is a river that flows through Saxony, Brandenburg and Berlin.',
    },
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def corpus(tmp_path):
    return _jsonl(tmp_path / "wiki.jsonl", DOCS)


def _search(tool, **arguments):
    call = OpenAIFunctionCallSchema(name=tool.name, arguments=arguments)
    return asyncio.run(run_tool_call(tool, "i", call, timeout_s=10))


def test_ranking_and_search_r1_format(corpus):
    tool = LocalSearchTool({"type": "native", "corpus_path": str(corpus)})
    assert tool.name == "search" and tool.topk == 3
    response, reward, metrics, status = _search(tool, query="capital of France")
    assert status == "ok" and reward == 0.0
    lines = response.text.split("\n")
    # Paris matches both words; Berlin only "capital", Lyon only "France".
    assert lines[0] == "Doc 1 (Title: Paris) Paris is the capital and largest city of France."
    # Berlin's shorter document outscores Lyon's (BM25 length normalisation).
    assert [line.split(" (Title: ")[1].split(")")[0] for line in lines] == ["Paris", "Berlin", "Lyon"]
    assert [line.split(" ")[1] for line in lines] == ["1", "2", "3"]
    assert metrics["query_count"] == 1 and metrics["total_results"] == 3


def test_topk_from_call_and_config(corpus):
    tool = LocalSearchTool({"corpus_path": str(corpus), "topk": 1})
    response, _, _, _ = _search(tool, query="river Spree Berlin")
    assert response.text.count("Doc ") == 1
    # The title is indexed with the text: Berlin's document names the river and, in its title, Berlin.
    assert response.text == "Doc 1 (Title: Berlin) Berlin is the capital of Germany, on the river Spree."
    response, _, metrics, _ = _search(tool, query="river Spree Berlin", topk=2)
    titles = {line.split("(Title: ")[1].split(")")[0] for line in response.text.split("\n")}
    assert titles == {"Spree", "Berlin"} and metrics["total_results"] == 2
    # Only documents that match at all are returned, even when more are asked for.
    response, _, metrics, _ = _search(tool, query="cuisine", topk=5)
    assert response.text == "Doc 1 (Title: Lyon) Lyon is a city in France known for its cuisine."
    response, _, _, status = _search(tool, query="cat", topk=11)
    assert (
        status == "error" and response.text == "Error: search: topk must be an integer from 1 to 10, got 11"
    )


def test_no_match_and_verl_query_list(corpus):
    tool = LocalSearchTool({"corpus_path": str(corpus)})
    response, _, metrics, status = _search(tool, query="zebra the of")
    assert status == "ok" and response.text == "No results found for 'zebra the of'."
    assert metrics["total_results"] == 0
    # verl's search tool argument (its schema would come from the tool config; the default one
    # lists only query/topk, so check the tool method directly).
    result, _, _ = asyncio.run(tool.execute("i", {"query_list": ["cat mammal", "Germany"]}))
    first, second = result.text.split("\n---\n")
    assert first.startswith("Doc 1 (Title: Cat)") and second.startswith("Doc 1 (Title: Berlin)")


def test_title_text_rows_and_parquet(tmp_path):
    rows = [
        {"id": 1, "title": "Mercury", "text": "Mercury is the smallest planet."},
        {"id": 2, "title": "Venus", "text": "Venus is the hottest planet."},
    ]
    jsonl = _jsonl(tmp_path / "planets.jsonl", rows)
    parquet = tmp_path / "planets.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        tool = LocalSearchTool({"corpus_path": str(path), "topk": 2})
        response, _, _, _ = _search(tool, query="hottest")
        assert response.text == "Doc 1 (Title: Venus) Venus is the hottest planet."


def test_index_is_built_once_per_corpus(corpus):
    first = LocalSearchTool({"corpus_path": str(corpus)})
    second = LocalSearchTool({"corpus_path": str(corpus), "topk": 2})
    assert first.index is second.index is get_search_index(str(corpus))
    # A changed file gets a new index.
    _jsonl(corpus, DOCS[:2])
    third = LocalSearchTool({"corpus_path": str(corpus)})
    assert third.index is not first.index and len(third.index.documents) == 2
    assert all(index is not first.index for index in search._INDEXES.values())  # the stale one is freed


def test_missing_and_empty_corpus(tmp_path):
    with pytest.raises(ToolConfigError, match=r"missing\.jsonl \(config\.corpus_path\) does not exist"):
        LocalSearchTool({"corpus_path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ToolConfigError, match=r"config\.corpus_path is required"):
        LocalSearchTool({"type": "native"})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ToolConfigError, match=r"empty\.jsonl has no documents"):
        LocalSearchTool({"corpus_path": str(empty)})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(DOCS[0]) + "\n{oops\n")
    with pytest.raises(ToolConfigError, match=r"bad\.jsonl line 2: not valid JSON"):
        LocalSearchTool({"corpus_path": str(bad)})
    no_text = _jsonl(tmp_path / "notext.jsonl", [{"id": 1, "body": "x"}])
    with pytest.raises(ToolConfigError, match=r"notext\.jsonl line 1: has neither 'contents' nor 'text'"):
        LocalSearchTool({"corpus_path": str(no_text)})


def test_loads_from_a_verl_search_config(tmp_path, corpus):
    # verl's search_tool_config.yaml with class_name changed and the retriever URL replaced by a corpus.
    config = tmp_path / "search_tool_config.yaml"
    config.write_text(
        f"""
tools:
  - class_name: rlhf_megatron.agent.tools.LocalSearchTool
    config:
      corpus_path: {corpus}
      num_workers: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries.
          required:
            - query_list
"""
    )
    [tool] = load_tools(config)
    response, _, metrics, status = _search(tool, query_list=["largest city France"])
    assert status == "ok" and response.text.startswith("Doc 1 (Title: Paris)")
    response, _, _, status = _search(tool, query="x")
    assert status == "error" and "missing required argument 'query_list'" in response.text


def test_unreadable_corpus(tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not a parquet file")
    with pytest.raises(ToolConfigError, match=r"corrupt\.parquet cannot be read: ArrowInvalid"):
        LocalSearchTool({"corpus_path": str(corrupt)})
