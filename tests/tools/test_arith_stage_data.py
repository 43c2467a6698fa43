"""tools/data/arith_sft.py and arith_prefs.py: the stages before RL get the RL task's problems, in the
RL prompt format, with answers the arith reward scores 1 (SFT, chosen) and 0 (rejected)."""

import importlib.util
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_megatron.data.preference import tokenize_pair
from rlhf_megatron.data.sft import single_turn_messages, tokenize_conversation
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer
from rlhf_megatron.rewards import default_compute_score

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "data"


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tools_data_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(name, out, *args, train="40", test="8", seed="0"):
    argv = ["--output-dir", str(out), "--train-size", train, "--test-size", test, "--seed", seed, *args]
    return [pq.read_table(p).to_pylist() for p in load_tool(name).main(argv)]


def sum_of(question: str) -> str:
    """The ground truth of ``"a+b="``, worked out independently of the generators."""
    a, b = question.removesuffix("=").split("+")
    return str(int(a) + int(b))


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def rl_split(tmp_path_factory):
    """The RL task's (train, test) rows for seed 0, as tools/data/arith.py writes them."""
    return generate("arith", tmp_path_factory.mktemp("arith"))


def test_sft_transcripts_solve_the_rl_task(tmp_path, tok, rl_split):
    train, test = generate("arith_sft", tmp_path)
    assert (len(train), len(test)) == (40, 8)
    assert {"messages", "question", "answer", "data_source", "extra_info"} <= set(train[0])
    rl_test = {r["prompt"][0]["content"]: r["reward_model"]["ground_truth"] for r in rl_split[1]}
    assert {r["question"]: r["answer"] for r in test} == rl_test, "the same seed gives the RL test split"
    assert not {r["question"] for r in train} & set(rl_test), "no SFT transcript solves an RL test problem"
    for row in train + test:
        user, assistant = row["messages"]
        assert user == {"role": "user", "content": row["question"]}
        assert assistant == {"role": "assistant", "content": row["answer"]}
        assert default_compute_score("arith", assistant["content"], sum_of(row["question"])) == 1.0


def test_sft_rows_tokenize_as_the_tiny_model_pretrains(tmp_path, tok):
    (row, *_), _ = generate("arith_sft", tmp_path, train="4", test="2")
    multi = tokenize_conversation(tok, row["messages"], source="row 0")
    single = tokenize_conversation(
        tok, single_turn_messages(row["question"], row["answer"], "row 0"), source="row 0"
    )
    assert multi == single, "both SFT modes read the same transcript"
    # tools/make_tiny_model.py: the generation-prompt render of the question, then answer + eos trained
    text = tok.apply_chat_template(
        [{"role": "user", "content": row["question"]}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    answer = tok.encode(row["answer"], add_special_tokens=False) + [tok.eos_token_id]
    assert list(multi.input_ids) == prompt + answer
    assert list(multi.loss_mask) == [0] * len(prompt) + [1] * len(answer)


def test_preference_pairs_are_scored_one_and_zero_by_the_arith_reward(tmp_path, tok, rl_split):
    train, test = generate("arith_prefs", tmp_path)
    assert (len(train), len(test)) == (40, 8)
    assert {"prompt", "chosen", "rejected", "extra_info"} <= set(train[0])
    assert [r["prompt"] for r in test] == [r["prompt"][0]["content"] for r in rl_split[1]]
    assert [r["prompt"] for r in train] == [r["prompt"][0]["content"] for r in rl_split[0]]
    for i, row in enumerate(train + test):
        truth = row["extra_info"]["ground_truth"]
        assert truth == sum_of(row["prompt"])
        assert default_compute_score("arith", row["chosen"], truth) == 1.0
        assert default_compute_score("arith", row["rejected"], truth) == 0.0, row
        pair = tokenize_pair(tok, row, f"row {i}")
        assert pair.chosen_ids != pair.rejected_ids


@pytest.mark.parametrize("malformed", ["0", "0.5", "1"])
def test_every_problem_gets_a_wrong_answer_of_the_asked_kind(tmp_path, malformed):
    # max-operand 3 has 16 problems; 200 rows cover each (0+0= included) many times
    train, _ = generate(
        "arith_prefs",
        tmp_path,
        "--max-operand",
        "3",
        "--malformed-fraction",
        malformed,
        train="200",
        test="1",
    )
    kinds = Counter(r["extra_info"]["rejected_kind"] for r in train)
    for row in train:
        truth = row["extra_info"]["ground_truth"]
        assert default_compute_score("arith", row["rejected"], truth) == 0.0, row
        if row["extra_info"]["rejected_kind"] == "off_by":
            assert 1 <= abs(int(row["rejected"]) - int(truth)) <= 3 and int(row["rejected"]) >= 0
    if malformed == "0":
        assert set(kinds) == {"off_by"}
    elif malformed == "1":
        assert set(kinds) == {"run_on", "echo"}
    else:
        assert set(kinds) == {"off_by", "run_on", "echo"}


def test_a_zero_sum_never_runs_on_into_another_zero():
    wrong_answer = load_tool("arith_prefs").wrong_answer
    rng = random.Random(0)
    answers = {wrong_answer("0+0=", "0", rng, malformed=1.0, max_offset=3) for _ in range(200)}
    assert ("echo", "0+0=0") in answers and {("run_on", f"0{d}") for d in range(1, 10)} < answers
    assert ("run_on", "00") not in answers  # "00" reads as 0, the right answer


@pytest.mark.parametrize("name", ["arith_sft", "arith_prefs"])
def test_deterministic_for_a_seed(tmp_path, name):
    first = generate(name, tmp_path / "a")
    assert generate(name, tmp_path / "b") == first
    assert generate(name, tmp_path / "c", seed="1") != first


def test_prefs_cli_and_bad_arguments(tmp_path):
    out = tmp_path / "prefs"
    cmd = [sys.executable, str(TOOLS / "arith_prefs.py"), "--output-dir", str(out), "--train-size", "6"]
    result = subprocess.run([*cmd, "--test-size", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote 6 rows" in result.stdout and (out / "test.parquet").exists()
    with pytest.raises(SystemExit):
        load_tool("arith_prefs").main(
            ["--output-dir", str(out), "--train-size", "1", "--test-size", "1", "--max-offset", "0"]
        )
