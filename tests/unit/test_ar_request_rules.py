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
    sampling = fields.pop("sampling", None)
    msg = pb.ARGenerateRequest(**fields)
    if sampling is not None:
        msg.sampling.CopyFrom(sampling)
    return msg


def test_a_valid_request_passes():
    assert validate_request(request()) is None
    assert validate_request(request(grid_width=4, grid_height=3, negative_prompt="blurry")) is None
    assert validate_request(request(decoding=pb.DecodingParams(mode=pb.AR_DECODING_JACOBI))) is None  # window 0: 16


@pytest.mark.parametrize("changes, fragment", [
    (dict(request_id=""), "request_id is required"),
    (dict(prompt=" \u200b\t"), "prompt is blank"),
    (dict(prompt="x" * (MAX_PROMPT_CHARS + 1)), f"longer than {MAX_PROMPT_CHARS}"),
    (dict(negative_prompt="x" * (MAX_PROMPT_CHARS + 1)), f"longer than {MAX_PROMPT_CHARS}"),
    (dict(width=0), "width must be a positive multiple of 16, got 0"),
    (dict(height=40), "height must be a positive multiple of 16, got 40"),
    (dict(grid_width=4), "grid_width and grid_height go together"),
    (dict(dit_address=""), "dit_address is required"),
    (dict(reservation_token=""), "reservation_token is required"),
    (dict(sampling=pb.SamplingParams(temperature=-0.1)), "temperature must be >= 0"),
    (dict(sampling=pb.SamplingParams(top_p=1.5)), "top_p in [0, 1]"),
    (dict(decoding=pb.DecodingParams(mode=pb.AR_DECODING_JACOBI, window=1)), "decoding: jacobi_window"),
    (dict(decoding=pb.DecodingParams(mode=pb.AR_DECODING_JACOBI, window=65)), "decoding: jacobi_window"),
    (dict(decoding=pb.DecodingParams(mode=7)), "decoding: ar_decoding: unknown mode 7"),
])
def test_each_rule_names_the_problem(changes, fragment):
    problem = validate_request(request(**changes))
    assert problem is not None and fragment in problem
