"""The relay tree of a slice's command stream (pure, milliseconds)."""

from __future__ import annotations

import pytest

from pathways_ray.transport.fanout import FANOUT_ENV, check_fanout, default_fanout, relay_tree


def _depth(tree: dict[int, list[int]], root: int) -> int:
    return 1 + max((_depth(tree, c) for c in tree.get(root, [])), default=0)


def test_one_host_relays_from_its_first_chip():
    assert relay_tree([[0, 1, 2, 3]], 8) == {0: [1, 2, 3]}
    assert relay_tree([[7]], 8) == {}


def test_every_chip_is_reached_once_and_depth_grows_with_the_log_of_hosts():
    for hosts_n, fanout in [(2, 1), (16, 8), (64, 8), (1024, 8), (1024, 16)]:
        hosts = [[4 * h + c for c in range(4)] for h in range(hosts_n)]
        tree = relay_tree(hosts, fanout)
        reached = [c for children in tree.values() for c in children]
        assert sorted(reached) == list(range(1, 4 * hosts_n))  # all but the root, once
        assert max(len(c) for c in tree.values()) <= 3 + fanout
        levels = 1
        while (fanout ** levels - 1) // max(fanout - 1, 1) < hosts_n and fanout > 1:
            levels += 1
        assert _depth(tree, 0) <= levels + 1 if fanout > 1 else hosts_n + 1
    # a host's own chips come first: one local hop before the next host
    assert relay_tree([[0, 1], [2, 3], [4, 5]], 8)[0] == [1, 2, 4]


def test_ranks_need_not_be_in_host_order():
    tree = relay_tree([[3, 1], [0, 2]], 8)
    assert tree == {3: [1, 0], 0: [2]}


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="fanout=0"):
        relay_tree([[0]], 0)
    with pytest.raises(ValueError, match="non-empty"):
        relay_tree([[0], []], 8)
    with pytest.raises(ValueError, match="twice"):
        relay_tree([[0, 1], [1]], 8)


def test_the_setting(monkeypatch):
    monkeypatch.delenv(FANOUT_ENV, raising=False)
    assert default_fanout() == 8
    monkeypatch.setenv(FANOUT_ENV, "0")
    assert default_fanout() == 0
    for bad in ("two", "-1"):
        monkeypatch.setenv(FANOUT_ENV, bad)
        with pytest.raises(ValueError, match=FANOUT_ENV):
            default_fanout()


def test_a_bad_fanout_argument_is_named():
    assert check_fanout(0) == 0 and check_fanout(16) == 16
    for bad in (-1, 2.5, "8", True):
        with pytest.raises(ValueError, match=r"fanout=.* or 0 for one stream per chip"):
            check_fanout(bad)
