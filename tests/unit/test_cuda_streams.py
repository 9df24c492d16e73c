"""`mammoth_core.cuda_streams`: one side stream per (device, purpose) for the process."""

import pytest
import torch

from mammoth_core.cuda_streams import side_stream


def test_side_stream_refuses_a_cpu_device_and_an_empty_purpose():
    with pytest.raises(ValueError, match="CUDA device"):
        side_stream("cpu", "d2h-copy")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="purpose"):
            side_stream("cuda", "")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA streams")
def test_side_stream_is_one_stream_per_device_and_purpose():
    a, b = side_stream("cuda", "graph-warm-up"), side_stream(torch.device("cuda", torch.cuda.current_device()), "graph-warm-up")
    assert a is b
    assert side_stream("cuda", "d2h-copy") is not a
