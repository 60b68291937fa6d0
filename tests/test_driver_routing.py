"""TeacherRouter on the reference multi-teacher spec, and least-outstanding balancing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubedistill.api.validate import load_job
from kubedistill.runtime.driver.routing import EndpointPool, TeacherRouter

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
    with router.lease("geo3k") as (teacher, url):
        assert (teacher, url) == ("vision", "http://vision-0:8000")
        assert router.pools["vision"].outstanding() == 1
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
        with pool.lease() as url:
            picks.append(url)
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
