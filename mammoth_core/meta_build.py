"""Modules built for their shapes only: on PyTorch's ``meta`` device, without initialising weights.

Any computation on meta tensors (a random normal fill, a division) runs torch's Python reference
implementations, and the first one imports ``torch._dynamo``: about 1.5 s of CPU (3 s on a loaded
host) in a process that otherwise never imports it, such as the AR stage checking its checkpoint
part at start-up (`stage_ar.checkpoint_part`). `shapes_only` skips the weight fills (they do
nothing on meta tensors anyway); a module that computes a constant buffer in its constructor
computes it on the CPU when the default device is meta (`stage_ar.modeling_mammoth_ar`'s rotary
embedding). ``tests/unit/test_layering.py`` checks that the AR loads without torch._dynamo.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """``with torch.device("meta")`` (no memory, no values) with ``torch.nn.init`` fills skipped.

    Inside it, a public ``torch.nn.init.*_`` function called on a meta tensor returns that tensor
    unchanged; on any other tensor it runs as usual. Torch function modes are per thread: other
    threads are not affected.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    fills = {getattr(torch.nn.init, name) for name in dir(torch.nn.init)
             if name.endswith("_") and not name.startswith("_")}

    class _SkipFillsOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensor = args[0] if args else kwargs.get("tensor")
            if func in fills and isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return func(*args, **kwargs)

    with torch.device("meta"), _SkipFillsOnMeta():
        yield
