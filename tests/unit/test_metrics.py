"""observe_many() leaves a histogram exactly as one observe() per value would."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from relay.metrics import LATENCY_BUCKETS_S, observe_many


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


@given(st.lists(st.one_of(st.floats(min_value=0, max_value=1000, allow_nan=False),
                          st.sampled_from(LATENCY_BUCKETS_S)), max_size=200))
def test_observe_many_matches_observe(values: list[float]) -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", buckets=LATENCY_BUCKETS_S, registry=one)
    h2 = Histogram("h", "h", buckets=LATENCY_BUCKETS_S, registry=many)
    for v in values:
        h1.observe(v)
    observe_many(h2, values)
    expected, got = samples(one), samples(many)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_observe_many_uses_the_private_fields_it_expects() -> None:
    # If prometheus_client renames them, observe_many falls back to observe(): still
    # right, only slower.  This test says when that happens.
    h = Histogram("h", "h", buckets=LATENCY_BUCKETS_S, registry=CollectorRegistry())
    assert all(hasattr(h, name) for name in ("_upper_bounds", "_buckets", "_sum"))
