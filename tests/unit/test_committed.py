"""`CommittedSet`: a watermark plus exceptions that behaves as a set of sample_ids."""

import json
import random

import pytest

from asyncrl.types import CommittedSet, make_sample_id

EPOCH_SIZE = 4096  # rows of a dataset: the epoch of feed index i is i // EPOCH_SIZE


def sid(index: int) -> str:
    return make_sample_id(index // EPOCH_SIZE, index)


def test_a_million_ids_done_out_of_order_keep_the_sidecar_small_and_membership_exact():
    rng = random.Random(14)
    n, window, pending = 1_000_000, 256, {999_990, 999_995}
    done = CommittedSet()
    most = 0
    # Groups finish out of feed order, within a window of ids in flight; a few at the very end never do.
    for start in range(0, n, window):
        block = [i for i in range(start, min(n, start + window)) if i not in pending]
        rng.shuffle(block)
        for i in block:
            done.add(sid(i))
            most = max(most, done.exceptions)
    assert most < window  # never more than the ids in flight are kept one by one
    assert len(done) == n - len(pending)
    assert done.watermark == min(pending) and done.missing(n) == sorted(pending)
    text = json.dumps(done.to_json())
    assert len(text) < 4096, len(text)  # 1M ids in a few hundred bytes; a list of them is ~14 MB
    back = CommittedSet.from_json(json.loads(text))
    assert back == done and back.to_json() == done.to_json()
    for i in [*rng.sample(range(n), 2000), 0, EPOCH_SIZE - 1, EPOCH_SIZE, n - 1, *pending]:
        assert (sid(i) in back) == (i not in pending), i
        assert make_sample_id(i // EPOCH_SIZE + 1, i) not in back  # right index, wrong epoch
    assert done.max_index() == n - 1


def test_behaves_as_a_set_of_str():
    ids = {sid(i) for i in (0, 1, 2, 5, EPOCH_SIZE - 1, EPOCH_SIZE, 9000)} | {"g-7", "sample_x_1", "sample_01_3"}
    done = CommittedSet(ids)
    assert done == ids and set(done) == ids and len(done) == len(ids)
    assert done | {"y"} == ids | {"y"} and isinstance(done | {"y"}, CommittedSet)
    assert "g-7" in done and "sample_0_3" not in done and 3 not in done
    assert "sample_1_3" not in done and "sample_01_3" in done  # non-canonical ids are kept verbatim
    copy = done.copy()
    copy.add(sid(3))
    assert sid(3) not in done and sid(3) in copy  # a copy is independent
    assert CommittedSet.from_json(sorted(ids)) == done  # older sidecars stored a plain list


def test_the_watermark_crosses_epochs_and_iterates_back_every_id():
    done = CommittedSet(sid(i) for i in reversed(range(2 * EPOCH_SIZE + 3)))
    assert done.watermark == 2 * EPOCH_SIZE + 3 and done.exceptions == 0
    assert done.to_json()["epochs"] == [[0, 0], [EPOCH_SIZE, 1], [2 * EPOCH_SIZE, 2]]
    assert list(done) == [sid(i) for i in range(2 * EPOCH_SIZE + 3)]


def test_ids_sharing_an_index_stay_exact_and_bad_json_names_what_is_wrong():
    done = CommittedSet([sid(0), sid(7)])
    done.add(sid(0))  # adding again is a no-op
    assert len(done) == 2
    # Another feed's ids with the same indices (two producers numbering their own feeds) are
    # kept one by one: the set stays exact, and survives its JSON.
    done.update(["sample_3_0", "sample_1_7"])
    assert len(done) == 4 and done.exceptions == 3
    assert {"sample_3_0", "sample_1_7", sid(0), sid(7)} == set(done)
    assert "sample_3_0" in done and "sample_2_0" not in done and "sample_1_7" in done
    assert CommittedSet.from_json(done.to_json()) == done
    with pytest.raises(ValueError, match="malformed committed set.*watermark"):
        CommittedSet.from_json({"epochs": []})
    with pytest.raises(ValueError, match="must start at index 0"):
        CommittedSet.from_json({"watermark": 5, "epochs": [], "exceptions": []})
