"""The host tier as a hypothesis state machine against a model of the bytes: random backups, loads
(one layer or all), frees and allocations on both backends and layouts.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvassert import HOST_BACKENDS, HOST_LAYOUTS, dev_rows, fill_random_, host_rows, make_device_pool, make_host


# --- a state machine against a model of the bytes ---------------------------------------------------


class HostTierMachine(RuleBasedStateMachine):
    """Random backups, loads (one layer or all), frees and allocations; before each step every
    device row is refilled with fresh bytes, so a load that writes the wrong row or misses one shows.
    The model is the full byte contents of both pools."""

    @initialize(layout=st.sampled_from(HOST_LAYOUTS), staging=st.sampled_from([100, 1 << 20]), seed=st.integers(0, 99))
    def setup(self, layout, staging, seed):
        self.pool = make_device_pool(size=24, page_size=2, seed=seed, layer_num=2)
        self.host = make_host(self.pool, layout, page_size=2, ratio=1.0, seed=seed + 1, staging_bytes=staging)
        self.rows = self.pool.size + self.pool.page_size
        self.held: list[torch.Tensor] = []  # allocated host pages, a tensor per allocation
        self.model_host = [host_rows(self.host, l, w).clone() for l in range(2) for w in "kv"]
        self.seed = seed

    def _model_dev(self):
        return [dev_rows(self.pool, l, w).clone() for l in range(2) for w in "kv"]

    def _poison_device(self, data):
        self.seed += 1
        fill_random_(self.pool.k_buffer + self.pool.v_buffer, self.seed)
        return self._model_dev()

    @rule(pages=st.integers(1, 4))
    def alloc(self, pages):
        got = self.host.alloc(pages * 2)
        if pages * 2 > self.host.available_size() + (0 if got is None else pages * 2):
            assert got is None
        if got is not None:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        self.host.free(self.held.pop(i))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), backend=st.sampled_from(HOST_BACKENDS))
    def backup(self, data, backend):
        h = data.draw(st.sampled_from(self.held))
        d = data.draw(st.lists(st.integers(0, self.rows - 1), min_size=h.shape[0], max_size=h.shape[0]))
        model_dev = self._poison_device(data)
        self.host.backup_from_device_all_layer(self.pool, h, torch.tensor(d), backend)
        for i, rows in enumerate(model_dev):
            self.model_host[i][h] = rows[torch.tensor(d)]
        self.check(model_dev)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), backend=st.sampled_from(HOST_BACKENDS), layer=st.one_of(st.none(), st.integers(0, 1)))
    def load(self, data, backend, layer):
        h = data.draw(st.sampled_from(self.held))
        d = data.draw(st.permutations(range(self.rows)))[: h.shape[0]]
        model_dev = self._poison_device(data)
        d_t = torch.tensor(d, dtype=torch.int32)
        if layer is None:
            self.host.load_to_device_all_layer(self.pool, h, d_t, backend)
        else:
            self.host.load_to_device_per_layer(self.pool, h, d_t, layer, backend)
        for i in range(len(model_dev)):
            if layer is None or i // 2 == layer:
                model_dev[i][d_t.long()] = self.model_host[i][h]
        self.check(model_dev)

    def check(self, model_dev):
        for i, rows in enumerate(model_dev):
            assert torch.equal(dev_rows(self.pool, i // 2, "kv"[i % 2]), rows), f"device buffer {i}"
        for i, rows in enumerate(self.model_host):
            assert torch.equal(host_rows(self.host, i // 2, "kv"[i % 2]), rows), f"host buffer {i}"

    @invariant()
    def accounting(self):
        if hasattr(self, "host"):
            held = sum(t.shape[0] for t in self.held)
            assert self.host.available_size() + held == self.host.size


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)
