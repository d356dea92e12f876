"""Hit query and read over interleaved local / remote runs (flatcake.adapter.cluster_walk), with
a store and a cluster member that follow the real ones' contracts: ``leading_run`` / ``get``
return leading runs, ``extend_run(keys, n)`` continues from ``n``, ``fill`` reads the run after
``out``'s first False and returns how many it delivered."""

import torch

from flatcake.adapter.cluster_walk import hit_run, read_run


class Store:
    def __init__(self, pages):
        self.pages = dict(pages)  # key -> value
        self.hit_queries = []

    def exists(self, k):
        return k in self.pages

    def leading_run(self, keys, prefix_keys=None):
        self.hit_queries.append(list(keys))
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def get(self, keys, layout, ids):
        out = [False] * len(keys)
        for i, k in enumerate(keys):
            if k not in self.pages:
                break
            layout[int(ids[i])] = self.pages[k]
            out[i] = True
        return out


class Member:
    def __init__(self, pages, broken=()):
        self.pages, self.broken, self.reads = dict(pages), set(broken), []

    def _run(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def extend_run(self, keys, n):
        return n + self._run(keys[n:])

    def fill(self, keys, out, layout, ids):
        n = next((i for i, ok in enumerate(out) if not ok), len(out))
        run = keys[n: n + self._run(keys[n:])]
        self.reads.append(list(run))
        h = 0
        for k in run:
            if k in self.broken:  # a checksum mismatch: a miss, the run ends
                break
            layout[int(ids[n + h])] = self.pages[k]
            out[n + h] = True
            h += 1
        return h


KEYS = [f"k{i}" for i in range(10)]
# turns alternating between nodes: k0-k2 here, k3-k5 on another node, k6-k7 here, k8 elsewhere
LOCAL = {k: f"L{k}" for k in KEYS[0:3] + KEYS[6:8]}
REMOTE = {k: f"R{k}" for k in KEYS[3:6] + KEYS[8:9]}


def test_hit_query_walks_alternating_runs_until_a_key_held_nowhere():
    st = Store(LOCAL)
    assert hit_run(st, Member(REMOTE), KEYS, None) == 9  # k9 is held by no node
    assert st.hit_queries == [KEYS]  # the store's hit bookkeeping sees one query, as without a cluster
    assert hit_run(Store(LOCAL), None, KEYS, None) == 3  # alone: the local run only


def test_read_delivers_each_run_from_where_it_lives():
    layout, ids = {}, torch.arange(100, 110)
    m = Member(REMOTE)
    out = read_run(Store(LOCAL), m, KEYS, layout, ids)
    assert out == [True] * 9 + [False]
    assert [layout[100 + i] for i in range(9)] == ["Lk0", "Lk1", "Lk2", "Rk3", "Rk4", "Rk5", "Lk6", "Lk7", "Rk8"]
    assert m.reads == [KEYS[3:6], KEYS[8:9], []]


def test_a_remote_miss_ends_the_run_and_nothing_after_it_is_reported():
    layout = {}
    out = read_run(Store(LOCAL), Member(REMOTE, broken={"k4"}), KEYS, layout, list(range(10)))
    assert out == [True] * 4 + [False] * 6
    assert sorted(layout) == [0, 1, 2, 3]  # k6/k7 are local but after the miss: not read


def test_a_key_held_locally_and_remotely_is_read_locally():
    both = dict(REMOTE, k0="Rk0", k1="Rk1")
    layout, m = {}, Member(both)
    out = read_run(Store(LOCAL), m, KEYS[:3], layout, [0, 1, 2])
    assert out == [True] * 3 and [layout[i] for i in range(3)] == ["Lk0", "Lk1", "Lk2"]
    assert m.reads == []
