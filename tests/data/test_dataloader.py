"""StatefulDataLoader: per-epoch seeded order, and exact resumption from a saved state."""

import pytest

from rlhf_megatron.data.dataloader import StatefulDataLoader


def run(loader, n_batches):
    out = []
    while len(out) < n_batches:
        for batch in loader:
            out.append(batch)
            if len(out) == n_batches:
                break
    return out


def test_epochs_cover_dataset_with_seeded_orders():
    loader = StatefulDataLoader(list(range(10)), batch_size=3, shuffle=True, seed=7)
    assert len(loader) == 3
    epoch0, epoch1 = list(loader), list(loader)
    assert all(len(b) == 3 for b in epoch0 + epoch1)
    assert len(set(sum(epoch0, []))) == 9  # one row dropped by drop_last
    assert epoch0 != epoch1
    assert loader.state_dict() == {"epoch": 2, "position": 0, "seed": 7}
    again = StatefulDataLoader(list(range(10)), batch_size=3, shuffle=True, seed=7)
    assert list(again) == epoch0
    other_seed = StatefulDataLoader(list(range(10)), batch_size=3, shuffle=True, seed=8)
    assert list(other_seed) != epoch0


def test_no_shuffle_and_keep_last():
    loader = StatefulDataLoader(list(range(5)), batch_size=2, shuffle=False, drop_last=False)
    assert len(loader) == 3 and list(loader) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("k", [1, 4, 5, 9])
def test_resume_sees_the_same_batches(k):
    data = list(range(23))
    reference = run(StatefulDataLoader(data, 4, seed=3), 15)  # 5 batches/epoch: 3 epochs
    first = StatefulDataLoader(data, 4, seed=3)
    head = run(first, k)
    state = first.state_dict()
    resumed = StatefulDataLoader(data, 4, seed=0)
    resumed.load_state_dict(state)
    assert head + run(resumed, 15 - k) == reference


def test_collate_fn_is_applied():
    loader = StatefulDataLoader(list(range(4)), 2, shuffle=False, collate_fn=sum)
    assert list(loader) == [1, 5]


def test_errors():
    with pytest.raises(ValueError, match="fewer than batch_size=8"):
        StatefulDataLoader(list(range(5)), 8)
    loader = StatefulDataLoader(list(range(10)), 2)
    with pytest.raises(ValueError, match="position 9 is outside"):
        loader.load_state_dict({"epoch": 0, "position": 9, "seed": 0})
    with pytest.raises(KeyError, match="lacks"):
        loader.load_state_dict({"epoch": 0})
