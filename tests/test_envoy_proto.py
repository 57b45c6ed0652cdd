"""The ext_proc messages setup.py generates (trio_router._envoy_proto): a picker's answer
survives the wire, the service is the one Envoy calls, and the generated package leaves the
top-level proto packages alone, opentelemetry's above all (the OTLP exporter's)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import opentelemetry
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from trio_router._envoy_proto.envoy.config.core.v3 import base_pb2
from trio_router._envoy_proto.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from trio_router._envoy_proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc

HEADER = "x-gateway-destination-endpoint"
ENDPOINT = "10.0.0.1:8000"


def test_a_picker_answer_round_trips() -> None:
    sent = ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(key=HEADER, raw_value=ENDPOINT.encode()),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    ]
                ),
                clear_route_cache=True,
            )
        )
    )
    sent.dynamic_metadata.update({"envoy.lb": {HEADER: ENDPOINT}})

    got = ep.ProcessingResponse.FromString(sent.SerializeToString())

    assert got == sent
    assert got.WhichOneof("response") == "request_headers"
    common = got.request_headers.response
    assert common.clear_route_cache
    [option] = common.header_mutation.set_headers
    assert (option.header.key, option.header.raw_value) == (HEADER, ENDPOINT.encode())
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert json_format.MessageToDict(got.dynamic_metadata) == {"envoy.lb": {HEADER: ENDPOINT}}


def test_the_service_is_the_one_envoy_calls() -> None:
    method = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].methods_by_name["Process"]
    assert method.full_name == "envoy.service.ext_proc.v3.ExternalProcessor.Process"
    assert method.client_streaming and method.server_streaming
    assert method.input_type is ep.ProcessingRequest.DESCRIPTOR
    assert ep.DESCRIPTOR.name == "envoy/service/ext_proc/v3/external_processor.proto"
    assert hasattr(external_processor_pb2_grpc, "add_ExternalProcessorServicer_to_server")


def test_generated_modules_live_under_the_package_only() -> None:
    assert ep.ProcessingRequest.__module__ == ep.__name__
    assert ep.__name__.startswith("trio_router._envoy_proto.")
    assert [m for m in sys.modules if m.partition(".")[0] in {"xds", "udpa", "validate"}] == []


def test_opentelemetry_proto_is_still_opentelemetry_protos() -> None:
    """The module the OTLP exporter imports is opentelemetry-proto's own file, and
    `opentelemetry` is still a namespace package (a distribution shipping its own
    opentelemetry/__init__.py, as xds-protos does, would shadow the others)."""
    files = importlib.metadata.files("opentelemetry-proto") or []
    shipped = {Path(str(f.locate())).resolve() for f in files}
    assert Path(trace_service_pb2.__file__).resolve() in shipped
    assert getattr(opentelemetry, "__file__", None) is None
