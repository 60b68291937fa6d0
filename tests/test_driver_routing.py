"""TeacherRouter on the reference multi-teacher spec, least-outstanding balancing, and per-endpoint
failure accounting (out of rotation after failures in a row, back on restore)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubedistill.api.validate import load_job
from kubedistill.runtime.driver.routing import MAX_TRANSPORT_FAILURES, AllEndpointsDown, EndpointPool, TeacherRouter

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def spec():
    return load_job(ROOT / "examples/multi-teacher-6gpu.yaml").spec


def endpoints() -> dict[str, list[str]]:
    return {
        "math": ["http://math-0:8000", "http://math-1:8000"],
        "vision": ["http://vision-0:8000"],
    }


def test_samples_go_to_the_teacher_of_their_data_source(spec) -> None:
    router = TeacherRouter(spec, endpoints())
    assert router.key == "data_source"
    assert router.teacher_for("gsm8k") == "math"
    assert router.teacher_for("geo3k") == "vision"
    assert router.route_value({"data_source": "geo3k", "prompt": []}) == "geo3k"
    with pytest.raises(LookupError, match="no teacher matches data_source='chat'"):
        router.teacher_for("chat")
    with pytest.raises(KeyError, match="no column 'data_source'"):
        router.route_value({"prompt": []})
    teacher, url = router.acquire("geo3k")
    assert (teacher, url) == ("vision", "http://vision-0:8000")
    assert router.pools["vision"].outstanding() == 1
    router.release(teacher, url)
    assert router.pools["vision"].outstanding() == 0


def test_least_outstanding_requests_balancing(spec) -> None:
    router = TeacherRouter(spec, endpoints())
    a = router.acquire("gsm8k")
    b = router.acquire("gsm8k")
    assert {a[1], b[1]} == {"http://math-0:8000", "http://math-1:8000"}
    router.release(*a)  # a's replica is now idle, b's still busy
    c = router.acquire("gsm8k")
    assert c[1] == a[1]
    pool = router.pools["math"]
    assert pool.outstanding(b[1]) == 1 and pool.outstanding() == 2


def test_pool_spreads_evenly_when_requests_finish_in_time() -> None:
    pool = EndpointPool("rollout", ["u0", "u1", "u2"])
    picks = []
    for _ in range(9):
        picks.append(served(pool))
    assert sorted(picks) == ["u0"] * 3 + ["u1"] * 3 + ["u2"] * 3
    with pytest.raises(ValueError, match="without a matching acquire"):
        pool.release("u0")
    with pytest.raises(ValueError, match="unknown endpoint"):
        pool.release("u9")


def test_endpoints_must_cover_every_teacher(spec) -> None:
    with pytest.raises(ValueError, match=r"no base URL for teachers \['vision'\]"):
        TeacherRouter(spec, {"math": ["http://m:8000"]})
    with pytest.raises(ValueError, match=r"unknown teachers \['physics'\]"):
        TeacherRouter(spec, {**endpoints(), "physics": ["http://p:8000"]})
    with pytest.raises(ValueError, match="no endpoints"):
        EndpointPool("rollout", [])


def served(pool: EndpointPool) -> str:
    """One request that was answered: the endpoint it went to."""
    url = pool.acquire()
    pool.release(url)
    return url


def fail(pool: EndpointPool, url: str, times: int) -> list[bool]:
    """`times` transport failures of requests to `url`; whether each took it out of rotation."""
    return [pool.failed(url) for _ in range(times)]


def test_failures_in_a_row_count_per_endpoint() -> None:
    pool = EndpointPool("rollout", ["u0", "u1", "u2"], max_failures=3)
    assert pool.max_failures == 3 and EndpointPool("r", ["u"]).max_failures == MAX_TRANSPORT_FAILURES
    assert fail(pool, "u0", 2) == [False, False]
    pool.succeeded("u1")  # another endpoint's success does not forgive u0 ...
    assert pool.failed("u0") is True
    assert pool.out_of_rotation() == ["u0"] and pool.serving() == ["u1", "u2"]
    pool.succeeded("u1")
    assert fail(pool, "u1", 2) == [False, False]
    pool.succeeded("u1")  # ... its own does
    assert fail(pool, "u1", 2) == [False, False]
    assert pool.serving() == ["u1", "u2"]
    picks = []
    for _ in range(6):
        picks.append(served(pool))
    assert sorted(picks) == ["u1"] * 3 + ["u2"] * 3
    assert pool.failed("u0") is False  # a request already on its way when it was taken out
    assert pool.urls == ["u0", "u1", "u2"]


def test_a_restored_endpoint_takes_its_share_again() -> None:
    pool = EndpointPool("rollout", ["u0", "u1"], max_failures=1)
    assert pool.failed("u1") is True
    for _ in range(10):
        served(pool)
    pool.restore("u1")
    assert pool.serving() == ["u0", "u1"] and pool.out_of_rotation() == []
    # Not every new request until it has caught up with the ten u0 took meanwhile: an even share.
    picks = []
    for _ in range(4):
        picks.append(served(pool))
    assert sorted(picks) == ["u0", "u0", "u1", "u1"]
    assert fail(pool, "u1", 1) == [True]  # its count restarted from zero and counts again


def test_the_last_endpoint_taking_requests_is_never_taken_out() -> None:
    only = EndpointPool("teacher math", ["m0"], max_failures=2)
    assert only.failed("m0") is False
    with pytest.raises(AllEndpointsDown, match=r"teacher math: m0 failed 2 times in a row and no other endpoint"):
        only.failed("m0")
    pool = EndpointPool("rollout", ["u0", "u1"], max_failures=2)
    assert fail(pool, "u0", 2) == [False, True]
    with pytest.raises(ValueError, match="cannot drain u1, the last endpoint taking requests"):
        pool.drain("u1")
    assert pool.failed("u1") is False
    with pytest.raises(AllEndpointsDown) as down:
        pool.failed("u1")
    assert "u0: out of rotation, 2 failures in a row; u1: serving, 2 failures in a row" in str(down.value)
    with pytest.raises(ValueError, match="max_failures"):
        EndpointPool("rollout", ["u0"], max_failures=0)


def test_an_endpoint_out_of_rotation_can_be_drained_and_removed() -> None:
    pool = EndpointPool("rollout", ["u0", "u1", "u2"], max_failures=1)
    assert pool.failed("u2") is True
    pool.drain("u2")
    pool.remove("u2")
    assert pool.urls == ["u0", "u1"] and pool.out_of_rotation() == []
    pool.drain("u0")  # u1 still takes requests
    assert pool.serving() == ["u1"]
    with pytest.raises(AllEndpointsDown, match="no other endpoint"):
        pool.failed("u1")


def test_each_teachers_replicas_are_accounted_apart(spec) -> None:
    router = TeacherRouter(spec, endpoints())
    math, vision = router.pools["math"], router.pools["vision"]
    for _ in range(MAX_TRANSPORT_FAILURES - 1):
        assert math.failed("http://math-0:8000") is False
    vision.succeeded("http://vision-0:8000")
    assert math.failed("http://math-0:8000") is True
    assert {router.acquire("gsm8k")[1] for _ in range(3)} == {"http://math-1:8000"}
    assert vision.serving() == ["http://vision-0:8000"]
