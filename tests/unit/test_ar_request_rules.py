"""`stage_ar.server.validate_request`: each rule of ``AR.Generate``'s request check, in-process (the
same rules answer INVALID_ARGUMENT over a real socket in the integration and gateway tests)."""

from __future__ import annotations

import pytest

from mammoth_core.pb import mammoth_pb2 as pb
from stage_ar.server import MAX_PROMPT_CHARS, validate_request


def request(**changes) -> pb.ARGenerateRequest:
    fields = dict(request_id="r", prompt="a red fox", width=64, height=48, dit_address="127.0.0.1:1",
                  reservation_token="tok")
    fields.update(changes)
    return pb.ARGenerateRequest(**fields)


def test_a_valid_request_passes():
    assert validate_request(request()) is None
    assert validate_request(request(grid_width=4, grid_height=3, negative_prompt="blurry")) is None
    assert validate_request(request(decoding=pb.DecodingParams(mode=pb.AR_DECODING_JACOBI))) is None  # window 0: 16


@pytest.mark.parametrize("changes, fragment", [
    (dict(request_id=""), "request_id is required"),
    # break-it pass: a direct call's newline went into the AR's log lines as is
    (dict(request_id="r\n16:40:00.000 CRITICAL forged"), "request_id may hold only"),
    (dict(request_id="r" * 100_000), "request_id is 100000 characters"),
    # and AR-side CFG took NaN, inf and 1e30 (the gateway's range is [0, 100])
    (dict(ar_guidance_scale=float("nan")), "ar_guidance_scale"),
    (dict(ar_guidance_scale=float("inf")), "ar_guidance_scale"),
    (dict(ar_guidance_scale=1e30), "ar_guidance_scale"),
    (dict(ar_guidance_scale=-1.0), "ar_guidance_scale"),
    (dict(prompt=" \u200b\t"), "prompt is blank"),
    (dict(prompt="x" * (MAX_PROMPT_CHARS + 1)), f"longer than {MAX_PROMPT_CHARS}"),
    (dict(negative_prompt="x" * (MAX_PROMPT_CHARS + 1)), f"longer than {MAX_PROMPT_CHARS}"),
    (dict(width=0), "width must be a positive multiple of 16, got 0"),
    (dict(height=40), "height must be a positive multiple of 16, got 40"),
    (dict(grid_width=4), "grid_width and grid_height go together"),
    (dict(dit_address=""), "dit_address is required"),
    (dict(reservation_token=""), "reservation_token is required"),
    (dict(decoding=pb.DecodingParams(mode=pb.AR_DECODING_JACOBI, window=1)), "decoding: jacobi_window"),
    (dict(decoding=pb.DecodingParams(mode=pb.AR_DECODING_JACOBI, window=65)), "decoding: jacobi_window"),
    (dict(decoding=pb.DecodingParams(mode=7)), "decoding: ar_decoding: unknown mode 7"),
])
def test_each_rule_names_the_problem(changes, fragment):
    problem = validate_request(request(**changes))
    assert problem is not None and fragment in problem


def test_the_removed_sampling_field_stays_reserved():
    """`SamplingParams sampling = 8` was never set by the gateway (the AR samples with the
    checkpoint's generation config); its number and name are reserved so no later field reuses them."""
    from google.protobuf import descriptor_pb2

    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    msg = next(m for m in fdp.message_type if m.name == "ARGenerateRequest")
    assert any(r.start <= 8 < r.end for r in msg.reserved_range) and "sampling" in msg.reserved_name
    assert "sampling" not in pb.ARGenerateRequest.DESCRIPTOR.fields_by_name
