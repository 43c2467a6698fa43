"""``agent.proxy_records``: an agent's recorded calls into samples (merge, fork, retry, per call)."""

import pytest

from rlhf_megatron.agent.proxy_records import MASKED_VERSION, CallRecord, assemble_samples


def call(call_id, prompt, output, version=0):
    return CallRecord(
        call_id, tuple(prompt), tuple(output), tuple(-0.1 * (k + 1) for k in range(len(output))), version
    )


def test_a_conversation_that_extends_each_reply_is_one_sample_with_the_between_masked():
    a = call("a", [1, 2, 3], [10, 11])
    b = call("b", [1, 2, 3, 10, 11, 50, 51], [12], version=1)  # + the tool's answer, then a reply
    c = call("c", [1, 2, 3, 10, 11, 50, 51, 12, 60], [13, 14], version=1)
    samples, counts = assemble_samples([a, b, c])
    assert counts == {"calls": 3, "samples": 1, "merged": 2, "forked": 0, "retried": 0}
    (s,) = samples
    assert s.prompt_ids == [1, 2, 3]
    assert s.response_ids == [10, 11, 50, 51, 12, 60, 13, 14]
    assert s.response_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert s.log_probs == [-0.1, pytest.approx(-0.2), 0.0, 0.0, -0.1, 0.0, -0.1, pytest.approx(-0.2)]
    assert s.versions == [0, 0, MASKED_VERSION, MASKED_VERSION, 1, MASKED_VERSION, 1, 1]
    assert s.call_ids == ["a", "b", "c"] and s.full_ids() == list(c.full_ids)


def test_rewritten_history_forks_a_sample_with_its_own_prompt():
    a = call("a", [1, 2, 3], [10, 11, 12])  # e.g. <think>..</think> answer
    b = call("b", [1, 2, 3, 12, 50], [13])  # the template dropped the thinking tokens
    samples, counts = assemble_samples([a, b])
    assert counts["samples"] == 2 and counts["forked"] == 1 and counts["merged"] == 0
    assert samples[1].prompt_ids == [1, 2, 3, 12, 50] and samples[1].response_mask == [1]


def test_a_retried_call_is_dropped_and_its_retry_continues():
    a = call("a", [1, 2], [10])  # the agent threw this reply away ...
    a2 = call("a2", [1, 2], [11])  # ... and asked again
    b = call("b", [1, 2, 11, 5], [12])
    samples, counts = assemble_samples([a, a2, b])
    assert counts == {"calls": 3, "samples": 1, "merged": 1, "forked": 0, "retried": 1}
    assert samples[0].call_ids == ["a2", "b"] and samples[0].response_ids == [11, 5, 12]


def test_a_used_reply_asked_again_is_not_a_retry():
    """Two continuations of one reply (a sub-agent branching): the first merges, the second forks."""
    a = call("a", [1, 2], [10])
    b = call("b", [1, 2, 10, 5], [11])
    c = call("c", [1, 2, 10, 6], [12])
    samples, counts = assemble_samples([a, b, c])
    assert counts["retried"] == 0 and counts["samples"] == 2
    assert samples[0].call_ids == ["a", "b"] and samples[1].call_ids == ["c"]
    assert samples[1].prompt_ids == [1, 2, 10, 6]  # a's tokens are trained on once, in sample 0


def test_the_longest_matching_call_is_continued():
    a = call("a", [1], [2])
    b = call("b", [1, 2, 3], [4])
    c = call("c", [1, 2, 3, 4, 5], [6])  # extends both a and b: b is the nearer
    samples, counts = assemble_samples([a, b, c])
    assert counts["samples"] == 1 and samples[0].response_ids == [2, 3, 4, 5, 6]


def test_per_call_mode_makes_every_call_a_sample_but_still_drops_retries():
    a = call("a", [1, 2], [10])
    a2 = call("a2", [1, 2], [11])
    b = call("b", [1, 2, 11, 5], [12])
    samples, counts = assemble_samples([a, a2, b], mode="per_call")
    assert counts == {"calls": 3, "samples": 2, "merged": 0, "forked": 1, "retried": 1}
    assert [s.prompt_ids for s in samples] == [[1, 2], [1, 2, 11, 5]]
    assert all(s.response_mask == [1] for s in samples)


def test_no_calls_no_samples_and_bad_input_is_named():
    assert assemble_samples([]) == ([], {"calls": 0, "samples": 0, "merged": 0, "forked": 0, "retried": 0})
    with pytest.raises(ValueError, match="mode 'tree' is not one of merge, per_call"):
        assemble_samples([], mode="tree")
    with pytest.raises(ValueError, match="call x: 1 log-probs for 2 output ids"):
        CallRecord("x", (1,), (2, 3), (0.0,), 0)
    with pytest.raises(ValueError, match="call y: an empty prompt"):
        CallRecord("y", (), (2,), (0.0,), 0)
