import numpy as np
import pytest
import torch

from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.staging import ALIGN_BYTES, DevicePlan, StagingRing, layout


def make_plan(ctx, q=None, w=256, ps=16, policy="packed"):
    q = q or [1] * len(ctx)
    return ChunkPlanner(w, ps, policy).plan(PrefillBatch(q, ctx, page_size=ps))


def assert_matches(dp: DevicePlan, plan, token_tables=False):
    arrays = plan.device_arrays(token_tables=True) if token_tables else plan.device_arrays()
    assert list(dp.tensors) == list(arrays)
    for name, arr in arrays.items():
        t = dp.tensors[name]
        assert t.dtype == torch.int32 and tuple(t.shape) == arr.shape, name
        assert np.array_equal(t.cpu().numpy(), arr), name


class FakeEvent:
    """Completes only when the test says so; counts synchronize() calls."""

    def __init__(self, log):
        self.done = True
        self.syncs = 0
        self.log = log

    def record(self, stream=None):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.syncs += 1
        self.log.append(self)
        self.done = True


@pytest.fixture
def fake_events():
    events, syncs = [], []

    def factory():
        e = FakeEvent(syncs)
        events.append(e)
        return e

    return factory, events, syncs


def test_layout_aligned_and_sized():
    arrays = {"a": np.zeros(3, np.int32), "b": np.zeros((2, 5), np.int32),
              "c": np.zeros((0, 4), np.int32), "d": np.zeros(1, np.int32)}
    entries, total = layout(arrays)
    offs = [off for _, off, _ in entries]
    assert all(off * 4 % ALIGN_BYTES == 0 for off in offs)
    assert offs == [0, 16, 32, 32] and total == 33
    assert [shape for _, _, shape in entries] == [(3,), (2, 5), (0, 4), (1,)]
    with pytest.raises(TypeError, match="'x' has dtype int64; staging ships int32"):
        layout({"x": np.zeros(2, np.int64)})


@pytest.mark.parametrize("mode", ["ring", "pin", "pageable"])
def test_round_trip_every_mode_on_cpu(mode):
    ring = StagingRing("cpu", mode=mode)
    for ctx in ([100, 0, 700], [0, 0], [5000], [17] * 40):
        plan = make_plan(ctx)
        dp = ring.upload(plan)
        assert dp.plan is plan
        assert_matches(dp, plan)
        assert dp.cu_seq_lens is dp.tensors["cu_seq_lens"]
        assert "token_to_seq" not in dp.tensors  # compact: O(iterations x requests) only
        # ... but the vLLM-shaped table is still there on request, built on the device
        assert np.array_equal(dp.token_to_seq.numpy(), plan.token_to_seq)
        full = ring.upload(plan, token_tables=True)
        assert_matches(full, plan, token_tables=True)
        assert full["token_to_seq"] is full.token_to_seq
        for name, arr in plan.device_arrays(token_tables=True).items():
            assert not np.shares_memory(full.tensors[name].numpy(), arr)
    assert ring.stats.uploads == 8
    assert ring.stats.bytes >= sum(a.nbytes for a in plan.device_arrays().values())
    assert ring.stats.host_seconds > 0 and len(ring.stats.host_times) == 8
    assert ring.stats.p50() <= ring.stats.p99()


def test_generic_over_device_arrays():
    class Wrapped:  # the StagedPlan contract: a chunk plan plus arrays of its own
        def __init__(self, plan):
            self.chunk_plan = plan

        def device_arrays(self, *, token_tables=False):
            d = dict(self.chunk_plan.device_arrays(token_tables=token_tables))
            d["gather_index"] = np.arange(37, dtype=np.int32)[::-1].copy()
            return d

    w = Wrapped(make_plan([300, 20]))
    for mode in ("ring", "pin", "pageable"):
        dp = StagingRing("cpu", mode=mode).upload(w)
        assert_matches(dp, w)
        assert dp["gather_index"].tolist() == list(range(36, -1, -1))


def test_ring_reuses_slots_when_copies_complete():
    ring = StagingRing("cpu")
    plans = [make_plan([i * 37 + 1, 200]) for i in range(50)]
    for p in plans:
        assert_matches(ring.upload(p), p)
    assert ring.num_slots == ring.valid_uploads + 1
    assert ring.stats.arenas_grown == 0 and ring.stats.stalls == 0


def test_device_plan_valid_for_valid_uploads_later_uploads():
    ring = StagingRing("cpu", valid_uploads=3)
    plans = [make_plan([i * 91 + 3, 64 * i]) for i in range(12)]
    dps = []
    for i, p in enumerate(plans):
        dps.append(ring.upload(p))
        for j in range(max(0, i - ring.valid_uploads), i + 1):
            assert_matches(dps[j], plans[j])


def test_busy_arena_never_overwritten_and_ring_grows(fake_events):
    factory, events, _ = fake_events
    ring = StagingRing("cpu", event_factory=factory, valid_uploads=1)
    dps, plans = [], []
    for i in range(6):  # no copy ever completes: every upload needs a fresh slot
        plans.append(make_plan([i * 50 + 10, 7]))
        dps.append(ring.upload(plans[i]))
        for dp, p in zip(dps, plans, strict=True):
            assert_matches(dp, p)  # nothing written so far was overwritten
    assert ring.num_slots == 6 and ring.stats.arenas_grown == 4 and ring.stats.stalls == 0
    # complete the oldest copy only: the next upload reuses exactly that slot, no growth
    oldest_host = ring._slots[0].host_np
    events[0].done = True
    ring.upload(make_plan([1, 1]))
    assert ring.num_slots == 6 and ring._slots[-1].host_np is oldest_host


def test_recently_used_slot_is_not_reused_even_if_complete(fake_events):
    factory, events, _ = fake_events
    ring = StagingRing("cpu", event_factory=factory, valid_uploads=2)
    p0, p1 = make_plan([33]), make_plan([44])
    d0 = ring.upload(p0)
    d1 = ring.upload(p1)
    for e in events:
        e.done = True  # both copies complete, but they are the 2 most recent uploads
    ring.upload(make_plan([55]))
    assert_matches(d0, p0)
    assert_matches(d1, p1)


def test_cap_stalls_on_oldest_only(fake_events):
    factory, events, syncs = fake_events
    ring = StagingRing("cpu", event_factory=factory, valid_uploads=1,
                       max_pinned_bytes=3 * 64 * 1024)
    plans = [make_plan([10 + i]) for i in range(5)]
    for p in plans[:3]:
        ring.upload(p)
    assert ring.stats.stalls == 0 and ring.stats.pinned_bytes == 3 * 64 * 1024
    first_slot = ring._slots[0]
    ring.upload(plans[3])  # every slot busy at the cap: wait for the oldest only
    assert ring.stats.stalls == 1 and len(syncs) == 1 and syncs[0] is first_slot.event
    assert sum(e.syncs for e in events) == 1
    assert ring._slots[-1] is first_slot and ring.num_slots == 3


def test_plan_bigger_than_cap_rejected():
    ring = StagingRing("cpu", max_pinned_bytes=4096)
    with pytest.raises(ValueError, match=r"more than max_pinned_bytes=4096"):
        ring.upload(make_plan([5000], w=2048), token_tables=True)


def test_arena_resized_for_bigger_plan():
    ring = StagingRing("cpu", valid_uploads=0)  # one slot: always reused
    small, big = make_plan([10]), make_plan([200_000], w=65536, ps=64)
    ring.upload(small)
    assert_matches(ring.upload(big, token_tables=True), big, token_tables=True)
    assert ring.stats.arenas_resized == 1 and ring.num_slots == 1
    assert ring.stats.pinned_bytes >= sum(
        a.nbytes for a in big.device_arrays(token_tables=True).values())
    assert_matches(ring.upload(small), small)
    assert ring.stats.arenas_resized == 1


def test_resize_at_cap_frees_idle_slots_first(fake_events):
    factory, events, syncs = fake_events
    ring = StagingRing("cpu", event_factory=factory, valid_uploads=1,
                       max_pinned_bytes=2 * 64 * 1024)
    ring.upload(make_plan([10]))
    ring.upload(make_plan([11]))
    for e in events:
        e.done = True
    big = make_plan([12_000], w=8192, ps=64)  # > 64 KiB staged: needs a 128 KiB arena
    assert_matches(ring.upload(big, token_tables=True), big, token_tables=True)
    assert ring.stats.stalls == 0 and not syncs and ring.stats.arenas_resized == 1
    assert ring.stats.pinned_bytes == 2 * 64 * 1024


def test_resize_at_cap_waits_for_oldest_busy(fake_events):
    factory, events, syncs = fake_events
    ring = StagingRing("cpu", event_factory=factory, valid_uploads=1,
                       max_pinned_bytes=2 * 64 * 1024)
    ring.upload(make_plan([10]))
    ring.upload(make_plan([11]))
    events[0].done = True  # slot 0 reusable; slot 1 still busy and holds the other 64 KiB
    big = make_plan([12_000], w=8192, ps=64)
    assert_matches(ring.upload(big, token_tables=True), big, token_tables=True)
    assert ring.stats.stalls == 1 and syncs == [events[1]]


def test_views_cached_per_slot_and_layout():
    ring = StagingRing("cpu", valid_uploads=0)
    a, b = make_plan([100, 50]), make_plan([120, 30])  # same shapes
    da = ring.upload(a)
    db = ring.upload(b)
    assert da.tensors["chunk_lens"].data_ptr() == db.tensors["chunk_lens"].data_ptr()
    assert_matches(db, b)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(mode="fast"), ValueError, r"mode must be one of \['ring', 'pin', 'pageable'\]"),
    (dict(max_pinned_bytes=0), ValueError, r"max_pinned_bytes must be an int >= 64"),
    (dict(valid_uploads=-1), ValueError, r"valid_uploads must be an int in \[0, 1024\]"),
    # was 90 s of slot and event objects, then a MemoryError
    (dict(valid_uploads=10**9), ValueError, r"valid_uploads must be an int in \[0, 1024\]"),
])
def test_ring_arg_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        StagingRing("cpu", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available; use device='cpu'"):
        StagingRing("cuda")


def test_pin_mode_rejects_non_int32():
    class Bad:  # a StagedPlan (chunk_plan and device_arrays) whose array is not int32
        chunk_plan = None

        def device_arrays(self, *, token_tables=False):
            return {"x": np.zeros(3, np.float32)}

    with pytest.raises(TypeError, match="'x' has dtype float32"):
        StagingRing("cpu", mode="pin").upload(Bad())


def test_zero_broadcast_skip_never_leaves_stale_data():
    # One slot, reused every upload: one-request plans (token_to_seq = zero broadcast, whose fill
    # the ring may skip) interleaved with multi-request plans that write non-zeros there.
    rng = np.random.default_rng(0)
    ring = StagingRing("cpu", valid_uploads=0)
    for _ in range(120):
        r = int(rng.integers(1, 4))
        ctx = rng.integers(0, 700, size=r).tolist()
        plan = make_plan(ctx, w=int(rng.choice([128, 256])))
        assert_matches(ring.upload(plan, token_tables=True), plan, token_tables=True)
    one = make_plan([600])
    assert not any(one.token_to_seq.strides)  # the broadcast case is really exercised
    two = make_plan([300, 300])
    for p in (one, two, one, one, two, one):
        assert_matches(ring.upload(p, token_tables=True), p, token_tables=True)


@pytest.mark.parametrize("bad", [None, 3, object(), "plan", [1, 2]])
def test_upload_of_something_else_is_a_type_error_and_changes_nothing(bad):
    """Was: AttributeError ('NoneType' object has no attribute 'device_arrays')."""
    ring = StagingRing("cpu")
    before = (ring.stats.uploads, ring.stats.bytes)
    with pytest.raises(TypeError, match="plan must be a ChunkPlan"):
        ring.upload(bad)
    assert (ring.stats.uploads, ring.stats.bytes) == before
