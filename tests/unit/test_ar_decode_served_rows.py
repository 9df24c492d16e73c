"""`benchmarks/ar_decode.py`'s teacher-forced decode through the served step (`served_decode_rows`), which
measures the deviation of forms whose state lives only there (W8A8's delayed activation scales): every
step feeds the forced id, and its rows are the decode path's rows (`decode_rows`, one forward per id with
SDPA) within float32 rounding (another attention kernel)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytest.importorskip("triton")


def test_served_decode_rows_feeds_the_forced_ids_and_gives_the_decode_paths_rows(model, tokenizer, monkeypatch):
    from stage_ar import gemv
    from stage_ar.linear import GemvLinear, set_linear_backend

    if not gemv.available(torch.device("cpu")):
        pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
    sys.modules.pop("ar_decode", None)
    import ar_decode

    m = copy.deepcopy(model)
    set_linear_backend(m, GemvLinear(gemv.GemvConfig(128, 4, 1)))
    prompt = tokenizer.encode_t2i_prompt("a red cube", 4, 4)
    v0, eol = tokenizer.visual_token_start_id, tokenizer.eol_id
    grid = [v0 + (7 * i) % 200 if i % 5 < 4 else eol for i in range(12)]  # 4 codes then EOL per row
    ids = torch.tensor([prompt + grid])
    rows, codes = ar_decode.served_decode_rows(m, ids, len(prompt), 4, (eol, v0, tokenizer.visual_token_end_id))
    want_rows, want_codes = ar_decode.decode_rows(m, ids, len(prompt))
    assert rows.shape == (12, m.config.hidden_size)
    torch.testing.assert_close(rows, want_rows, rtol=1e-4, atol=1e-4)
    assert codes.shape == (12,)
