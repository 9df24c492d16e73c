"""In-process A/B: idle-row masks on vs off, batch 1 and the served padded shape (16 slots)."""
import contextlib, json, sys, os, time
sys.path[:0] = [os.path.join(os.getcwd(), "benchmarks"), os.getcwd()]
import ar_decode as A
import stage_ar.runner as R
from stage_ar.attention import TritonDecodeAttention

out = sys.argv[1]
orig_live, orig_attn = R.live_rows, R.TritonDecodeAttention

class NoLive(TritonDecodeAttention):
    def __init__(self, *a, live=None, **k):
        super().__init__(*a, live=None, **k)

def masks(on):
    g, a = on
    R.live_rows = orig_live if g else (lambda m: contextlib.nullcontext())
    R.TritonDecodeAttention = orig_attn if a else NoLive

res = {"ceilings": A.ceilings()}
config, _ = A.preview_config()
model, _ = A.random_preview_modules(config, dit=False)
model.eval().requires_grad_(False)
A.set_linear_backend(model, A.select_backend("auto", "cuda"))
def save():
    json.dump(res, open(out, "w"), indent=2, default=str)
cap = min(A.DEFAULTS.max_sequence_length, model.config.max_position_embeddings)
for name, on in (("b1", (True, False)), ("b1", (False, True)), ("b1", (False, False)), ("served", (True, False)), ("served", (False, True)), ("served", (False, False)), ("b1", (True, True))):
    masks(on)
    tag = name + "_gemv%d_attn%d" % on
    if name == "b1":
        A.time_variant(model, res, tag, {}, (1,), 100, save=save)
    else:
        A.time_variant(model, res, tag, {"pad_to_max_bucket": True}, (1,), 100, slots=16, capacity=cap, save=save)
    v = res["timings"][tag + "_B1"]
    print("RESULT", tag, round(v["ms_per_step"], 4), round(v["graph_replay_ms"], 4), flush=True)
save()
