import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab.workload.future import censor_lookahead, next_access
from cachelab.policy import NO_NEXT


@settings(deadline=None)  # the first call loads the compiled kernel
@given(st.lists(st.integers(0, 6), max_size=60))
def test_next_access_matches_a_scan(keys):
    keys = np.array(keys, dtype=np.int64)
    got = next_access(keys)
    for i, k in enumerate(keys.tolist()):
        later = [j for j in range(i + 1, len(keys)) if keys[j] == k]
        assert got[i] == (later[0] if later else NO_NEXT)


def test_lookahead_censors_far_reuse():
    keys = np.array([1, 2, 1, 3, 4, 1])
    offsets = np.array([0, 2, 4, 6])  # steps: [1,2] [1,3] [4,1]
    nxt = next_access(keys)
    assert nxt.tolist()[:3] == [2, NO_NEXT, 5]
    assert censor_lookahead(nxt, offsets, 1).tolist()[:3] == [2, NO_NEXT, 5]
    assert censor_lookahead(nxt, offsets, 0)[0] == NO_NEXT
