"""``platform/stacks.py``'s parsing: the last stack faulthandler wrote into a worker's log, where it
was, and whether it waited in a collective (the live path is in tests/scheduling/test_worker_group.py)."""

from rlhf_megatron.platform.stacks import describe, parse_last

LOG = """\
some warning
Stack (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 10 in all_reduce
  File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/repo/rlhf_megatron/workers/base.py", line 78 in all_reduce_sum
  File "/x/site-packages/ray/util/tracing/tracing_helper.py", line 487 in _resume_span
  File "/repo/rlhf_megatron/workers/actor.py", line 5 in update_actor
more output
Stack (most recent call first):
  File "/repo/tests/fault_hooks.py", line 99 in handler
  File "/repo/rlhf_megatron/platform/faults.py", line 40 in fault_point
  File "/repo/rlhf_megatron/workers/actor.py", line 7 in update_actor
"""


def test_the_last_stack_is_read_and_described():
    last = parse_last(LOG)
    assert last.frames[0] == ("/repo/tests/fault_hooks.py", 99, "handler")
    assert not last.in_collective
    first = parse_last(LOG.split("more output")[0])
    assert first.in_collective
    text = describe({1: first, 0: last})
    assert text == (
        "rank 0 (not in a collective) at tests/fault_hooks.py:99 in handler <- "
        "rlhf_megatron/platform/faults.py:40 in fault_point <- rlhf_megatron/workers/actor.py:7 in update_actor; "
        "rank 1 (waiting in a collective) at torch/distributed/distributed_c10d.py:10 in all_reduce <- "
        "rlhf_megatron/workers/base.py:78 in all_reduce_sum <- rlhf_megatron/workers/actor.py:5 in update_actor"
    )


def test_no_stack_in_a_log_is_none():
    assert parse_last("nothing here\n") is None
    assert parse_last("Stack (most recent call first):\nnot a frame\n") is None
