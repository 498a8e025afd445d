"""Pods from a Service's EndpointSlices: ready endpoints only, on the named port."""

from pagefleet_router.endpointslices import ready_endpoints


def endpoint_slice(ports, *endpoints):
    return {"ports": ports, "endpoints": list(endpoints)}


def endpoint(*addresses, ready=None):
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": list(addresses), "conditions": conditions}


def test_ready_endpoints_on_the_named_port_from_every_slice():
    http = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]
    slices = [
        endpoint_slice(http, endpoint("10.0.0.7", ready=True), endpoint("10.0.0.8", ready=False)),
        endpoint_slice(http, endpoint("fd00::5"), endpoint("10.0.0.7", ready=True)),
        endpoint_slice([{"name": "grpc", "port": 9000}], endpoint("10.0.0.9", ready=True)),
        endpoint_slice(None, endpoint("10.0.0.10")),  # no ports yet
    ]
    # not ready (terminating, starting): out; no condition: ready; duplicates once
    assert ready_endpoints(slices, "http") == ["http://10.0.0.7:8000", "http://[fd00::5]:8000"]
    assert ready_endpoints([], "http") == []
