"""The gateway's admission, in process: each branch of `gateway.admission.Admission.admit` and the
queue's accounting (tickets, the ``queue_depth`` gauge)."""

from __future__ import annotations

import pytest

from gateway.admission import (Admission, AdmissionQueue, GatewayState, require_available)
from gateway.backends import BackendPool
from gateway.errors import OverloadedError, UnavailableError, error_info
from gateway.metrics import GatewayMetrics
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc


class ServingPool:
    """Stands in for a stage's `BackendPool` with a replica SERVING (admission reads only
    ``available()``); the unavailable case uses a real, empty `BackendPool`."""

    def available(self) -> bool:
        return True


def empty_pool(metrics: GatewayMetrics) -> BackendPool:
    return BackendPool("dit", [], "mammoth.v1.DiT", pb_grpc.DiTStub, metrics,
                       probe_timeout_seconds=1.0)


def gauge(metrics: GatewayMetrics) -> float:
    return metrics.registry.get_sample_value("mammoth_gateway_queue_depth")


def make(capacity: int = 2, draining: bool = False, dit_available: bool = True,
         interval: float = 0.2):
    metrics = GatewayMetrics()
    dit = ServingPool() if dit_available else empty_pool(metrics)
    admission = Admission(GatewayState(draining=draining), (("AR", ServingPool()), ("DiT", dit)),
                          AdmissionQueue(capacity, metrics), interval)
    return admission, metrics


def test_a_draining_gateway_refuses_first_with_503_draining():
    admission, _ = make(draining=True, dit_available=False)
    with pytest.raises(UnavailableError) as info:
        admission.admit(1)
    status, body, headers = error_info(info.value)
    assert (status, body.code, headers["Retry-After"]) == (503, "draining", "1")


@pytest.mark.parametrize("interval,retry_after", [(0.2, "1"), (4.5, "5")])
def test_a_stage_without_backends_is_503_no_backend_naming_it(interval, retry_after):
    admission, metrics = make(dit_available=False, interval=interval)
    with pytest.raises(UnavailableError) as info:
        admission.admit(1)
    status, body, headers = error_info(info.value)
    assert (status, body.code, body.message) == (503, "no_backend", "no DiT backend is serving")
    assert headers["Retry-After"] == retry_after  # max(1 s, the health interval), rounded up
    assert admission.queue.waiting == 0


def test_require_available_passes_an_available_pool():
    require_available(ServingPool(), "AR", 0.2)
    with pytest.raises(UnavailableError):
        require_available(empty_pool(GatewayMetrics()), "AR", 0.2)


def test_a_full_queue_is_429_queue_full_with_retry_after():
    admission, metrics = make(capacity=2)
    admission.admit(1)
    admission.admit(3)
    assert (admission.queue.waiting, gauge(metrics)) == (2, 2.0)
    with pytest.raises(OverloadedError) as info:
        admission.admit(1)
    status, body, headers = error_info(info.value)
    assert (status, body.code, headers["Retry-After"]) == (429, "queue_full", "1")
    assert admission.queue.waiting == 2


def test_a_ticket_leaves_when_every_image_holds_a_slot_or_on_leave_once():
    admission, metrics = make(capacity=1)
    ticket = admission.admit(2)
    ticket.image_reserved()
    assert admission.queue.waiting == 1  # one image still waits for its slot
    ticket.image_reserved()
    assert (admission.queue.waiting, gauge(metrics)) == (0, 0.0)
    ticket.leave()  # idempotent: the request ending later does not leave twice
    assert admission.queue.waiting == 0
    other = admission.admit(1)
    other.leave()
    other.leave()
    assert admission.queue.waiting == 0


def test_capacity_is_at_least_one():
    queue = AdmissionQueue(0, GatewayMetrics())
    queue.enter(1)
    with pytest.raises(OverloadedError):
        queue.enter(1)
